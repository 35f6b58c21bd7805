"""pytest plugin loaded into the gate's pytest (`-p flaloop_gate_plugin`); never imports flaloop.

It arms flaloop's lifeline (flaloop_lifeline.py, beside this file) in pytest and in every
xdist worker, so none of them outlives flaloop. Otherwise it only observes: the selected test
ids, each outcome (for progress; a failure with its one-line message), where the target package was imported from, and whether a
weakening variable got set inside the test process. And it keeps the test honest in memory
(flaloop_gate_integrity.py, beside this file): its snapshot is taken here, as pytest loads this
plugin and before any conftest or target import, and checked after each test's call, after its
teardown and at the end of the session; every change the tree made goes out as a `guard-*` event.
Events go as JSON lines to the file named by FLALOOP_GATE_EVENTS, through a descriptor opened
as this plugin loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest


def _beside(name: str):
    """A module beside this file, loaded from its path: a module of the same name in the tree
    under test (which pytest may put first on sys.path) must not stand in for it."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


flaloop_lifeline = _beside("flaloop_lifeline")
_beside("flaloop_gate_frozen")  # what flaloop_gate_integrity imports: in sys.modules before it
flaloop_gate_integrity = _beside("flaloop_gate_integrity")

_PATH = os.environ.get("FLALOOP_GATE_EVENTS")
_FD = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if _PATH else None
_write, _dumps, _PID = os.write, json.dumps, os.getpid()


def _emit(event: dict) -> None:
    if _FD is None:
        return
    try:
        _write(_FD, (_dumps(event) + "\n").encode())
    except OSError:  # a closed channel: the orchestrator finds the reports missing
        pass


def _integrity() -> flaloop_gate_integrity.Integrity | None:
    tree = os.environ.get("FLALOOP_GATE_TREE")
    if not tree or os.environ.get("FLALOOP_GATE_MARKER_SKIPS") == "1":  # a collect-only baseline runs nothing
        return None
    frozen = [f for f in os.environ.get("FLALOOP_GATE_FROZEN", "").split(os.pathsep) if f]
    guard = flaloop_gate_integrity.Integrity(tree, frozen)
    guard.snapshot_libraries()
    return guard


# Before any conftest or target code: what the frozen test judges with, as it is now.
try:
    _GUARD, _GUARD_ERROR = _integrity(), None
except Exception as _exc:  # noqa: BLE001 - reported as a red reason, never a broken pytest
    _GUARD, _GUARD_ERROR = None, f"{type(_exc).__name__}: {_exc}"[:300]


def _guard_check(stage: str, config=None, items=None, nodeid: str | None = None) -> None:
    if _GUARD is None:
        return
    try:
        changes = _GUARD.check(config or _GUARD.config, items)
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is not a check that passed
        changes = [flaloop_gate_integrity.Change("guard-error", f"{stage}: {type(exc).__name__}: {exc}"[:300], None)]
    event = {"event": f"guard-{stage}", "pid": _PID, "changes": list(changes), "checks": _GUARD.checks,
             "check_s": round(_GUARD.seconds, 4)}
    if nodeid is not None:
        event["id"] = nodeid
    _emit(event)


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
    if _GUARD is not None or _GUARD_ERROR:
        if _GUARD is not None:
            _GUARD.snapshot_hooks(early_config.pluginmanager)
        _emit({"event": "guard-ready", "pid": _PID, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
               "plugin_file": os.path.abspath(__file__),
               "integrity_file": os.path.abspath(flaloop_gate_integrity.__file__), "entries": len(_GUARD.entries) if _GUARD else 0,
               "frozen": len(_GUARD.frozen) if _GUARD else 0, "error": _GUARD_ERROR})
    gpus = [g for g in os.environ.get("FLALOOP_GATE_GPUS", "").split(",") if g]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if gpus and worker.startswith("gw") and worker[2:].isdigit():
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


def pytest_collection_finish(session):
    if _GUARD is not None and not session.config.option.collectonly:
        _GUARD.config = session.config
        _GUARD.remember_items(session.items)
        _guard_check("collected", session.config, session.items)
    event = {"event": "collected", "pid": _PID, "ids": [item.nodeid for item in session.items],
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Right after the test's body: a judge swapped for the call and put back in teardown is
    still in place here."""
    yield
    _guard_check("call", item.config, [item], item.nodeid)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    _guard_check("test", None, None, nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and not report.passed):
        event = {"event": "result", "id": report.nodeid, "outcome": report.outcome, "when": report.when}
        if report.failed:
            event["crash"] = _crash(report)
        _emit(event)


def pytest_sessionfinish(session, exitstatus):
    if not session.config.option.collectonly:
        _guard_check("final", session.config)
    _emit({"event": "finish", "pid": _PID, "exitstatus": int(exitstatus), "env": _weakening_env(),
           "package_file": _package_file()})
