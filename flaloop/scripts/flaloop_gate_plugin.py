"""pytest plugin loaded into the gate's pytest (`-p flaloop_gate_plugin`); never imports flaloop.

It arms flaloop's lifeline (flaloop_lifeline.py, beside this file) in pytest and in every
xdist worker, so none of them outlives flaloop. Otherwise it only observes: the selected test
ids, each outcome (for progress; a failure with its one-line message), where the target package was imported from, and whether a
weakening variable got set inside the test process.
Events go as JSON lines to the file named by FLALOOP_GATE_EVENTS.
"""

from __future__ import annotations

import json
import os
import sys

import flaloop_lifeline  # beside this plugin, on the gate's PYTHONPATH
import pytest


def _emit(event: dict) -> None:
    path = os.environ.get("FLALOOP_GATE_EVENTS")
    if not path:
        return
    with open(path, "a") as fh:
        fh.write(json.dumps(event) + "\n")


def _weakening_env() -> dict[str, str]:
    watch = [w for w in os.environ.get("FLALOOP_GATE_WATCH_ENV", "").split(",") if w]
    out = {}
    for name, value in os.environ.items():
        for w in watch:
            if (w.endswith("*") and name.startswith(w[:-1])) or name == w:
                out[name] = value
    return out


def _package_file() -> str | None:
    pkg = os.environ.get("FLALOOP_GATE_PACKAGE", "")
    mod = sys.modules.get(pkg)
    f = getattr(mod, "__file__", None) if mod else None
    if f is None and mod is not None:  # namespace package
        paths = list(getattr(mod, "__path__", []))
        f = paths[0] if paths else None
    return f


def _marker_skips(items) -> list[str] | None:
    """Ids that skip/skipif markers will skip, evaluated the way pytest's setup would.

    This lets a collect-only run at the base count its skips in seconds instead of running the
    whole (on a cold GPU, many-minute) test file. None when pytest no longer offers the hook.
    """
    try:
        from _pytest.skipping import evaluate_skip_marks
    except ImportError:
        return None
    out = []
    for item in items:
        try:
            if evaluate_skip_marks(item) is not None:
                out.append(item.nodeid)
        except Exception:  # noqa: BLE001 - a condition that errors here errors in the real run too
            continue
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """Arm the lifeline before the conftests import anything slow. Under xdist, pin each worker to
    one GPU of FLALOOP_GATE_GPUS before anything imports CUDA."""
    flaloop_lifeline.arm()
    gpus = [g for g in os.environ.get("FLALOOP_GATE_GPUS", "").split(",") if g]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if gpus and worker.startswith("gw") and worker[2:].isdigit():
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


def pytest_collection_finish(session):
    event = {"event": "collected", "ids": [item.nodeid for item in session.items],
             "env": _weakening_env(), "package_file": _package_file(),
             "worker": os.environ.get("PYTEST_XDIST_WORKER"),
             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if os.environ.get("FLALOOP_GATE_MARKER_SKIPS") == "1":
        event["marker_skips"] = _marker_skips(session.items)
    _emit(event)


def _crash(report) -> str:
    """The failure's one-line message (pytest's reprcrash), for the gate to tell why a test failed."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    return str(getattr(crash, "message", "") or "")[:500]


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and not report.passed):
        event = {"event": "result", "id": report.nodeid, "outcome": report.outcome, "when": report.when}
        if report.failed:
            event["crash"] = _crash(report)
        _emit(event)


def pytest_sessionfinish(session, exitstatus):
    _emit({"event": "finish", "exitstatus": int(exitstatus), "env": _weakening_env(),
           "package_file": _package_file()})
