"""One pytest subprocess of the gate: the clean environment it runs in (weakening variables
removed), the run with the gate's plugins, its progress, timeout and interrupt, and what it did,
read back from JUnit and the plugin's events (`PytestRun`). No judgement here: task/gate.py decides
what a run means."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flaloop import inside
from flaloop.bench import forkservers
from flaloop.core import fsutil, git, procs
from flaloop.task import gate_integrity

PLUGIN_DIR = inside.SCRIPTS


# Variables that weaken a test run. FLA_CI_ENV turns FLA's assert_close failures into warnings;
# SKIP_TEST_* skips cases; PYTEST_ADDOPTS / PYTEST_PLUGINS can deselect or patch from outside.
WEAKENING_ENV = ("FLA_CI_ENV", "SKIP_TEST_*", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")


Progress = Callable[[int, int, str], None]


@dataclass
class PytestRun:
    """What one pytest subprocess did."""

    exit_code: int | None
    selected: list[str]
    outcomes: dict[str, str]
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    junit_time: float = 0.0
    wall_s: float = 0.0
    package_file: str | None = None
    env_inside: dict[str, str] = field(default_factory=dict)
    junit_ids: list[str] = field(default_factory=list)
    marker_skips: list[str] | None = None
    workers: dict[str, str | None] = field(default_factory=dict)  # xdist worker -> CUDA_VISIBLE_DEVICES
    short_summary: list[str] = field(default_factory=list)  # pytest's `FAILED id - reason` lines
    log_tail: str = ""
    crashes: dict[str, dict] = field(default_factory=dict)  # failed id -> {when, message} (pytest's one line)
    integrity: dict | None = None  # gate_integrity.collect(); None where it was not asked for
    junit_outcomes: dict[str, str] = field(default_factory=dict)
    forked: bool = False  # from a warm fork server (`warm_server`), not a fresh interpreter
    fresh_why: str = ""  # why not forked (empty when it was)

    @property
    def ran(self) -> int:
        return self.passed + self.failed + self.skipped + self.errors


def is_weakening(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


def clean_env(extra: list[str] | None = None) -> tuple[dict[str, str], dict[str, str], tuple[str, ...]]:
    patterns = WEAKENING_ENV + tuple(extra or ())
    env, stripped = {}, {}
    for k, v in os.environ.items():
        (stripped if is_weakening(k, patterns) else env)[k] = v
    return env, stripped, patterns


def parse_junit(path: Path) -> tuple[dict[str, int], float, list[str]]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time, ids = 0.0, []
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
        total_time += float(s.get("time", 0) or 0)
        for case in s.iter("testcase"):
            ids.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return counts, total_time, ids


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return events


# -- a warm interpreter for the test process ------------------------------------------------------

def _provides(d: Path, name: str) -> bool:
    """Whether directory `d`, on sys.path, holds a module or regular package `name`."""
    import importlib.machinery

    if (d / name / "__init__.py").exists() or (d / f"{name}.py").exists() or (d / f"{name}.pyc").exists():
        return True
    return any((d / f"{name}{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def warm_server(python: str, env: dict[str, str], preload: list[str], package: str,
                path_dirs: list[Path], owner: str | None = None,
                start: bool = True) -> tuple[forkservers.ForkServer | None, str]:
    """The warm fork server the test process (or the op query) may be forked from, or None and why not.

    It is the one a bench of the op left for this interpreter, environment and preload list
    (bench/forkservers.py); where none is warm, one is started and waited for, as a bench does: its
    preload costs what a fresh interpreter's imports would, and it stays warm for the op's next
    gate and bench (`start=False`: none is started, the caller runs fresh). A forked process finds the server's
    libraries imported, so it is forked only where a fresh one would have imported the same: the
    server holds nothing of the target package, and no directory that goes before the interpreter's
    own on the test's sys.path (`path_dirs`: the working directory, flaloop's plugin directory, the
    tree) holds a module named like one the server imported (a tree's own `triton/` would shadow
    the installed one in a fresh interpreter)."""
    server = forkservers.ForkServer.connect(python, env, preload, wait=False)
    if server is None and not start:
        return None, "no fork server was warm for this interpreter, environment and preload"
    if server is None:
        if (failed := forkservers.failure(python, env, preload)) is not None:
            return None, f"a fork server cannot run for this interpreter, environment and preload: {failed}"
        forkservers.start(python, env, preload, owner=owner)  # or another run is starting one: wait for that
        server = forkservers.ForkServer.connect(python, env, preload)
        if server is None:
            return None, ("no fork server was warm for this interpreter, environment and preload, and none "
                          f"came up within {forkservers.STARTING_WAIT_S:.0f} s of being started")
    tops = server.ready.get("tops")
    why = ""
    if not isinstance(tops, list):
        why = "the warm fork server does not list the modules it imported"
    elif package in tops:
        why = f"the warm fork server imported {package}, the package under test"
    else:
        shadow = next((f"{d}/{n}" for n in tops if isinstance(n, str) and n.isidentifier()
                       for d in path_dirs if _provides(d, n)), None)
        if shadow is not None:
            why = f"{shadow} would stand in for a module the warm fork server imported from elsewhere"
    if why:
        server.close()
        return None, why
    return server, ""


class _ForkedPytest:
    """The test process forked by a warm server, waited on and killed as a Popen is."""

    def __init__(self, proc: forkservers.ForkedProc):
        self.proc, self.pid, self.returncode = proc, proc.pid, None

    def poll(self) -> int | None:
        self.returncode = self.proc.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.proc.wait(1e9 if timeout is None else timeout)
        if code is None:
            raise subprocess.TimeoutExpired("pytest", timeout or 0.0)
        self.returncode = code
        return code


def run_pytest(python: str, tree: Path, test_rel: str, *, k_expr: str | None, env: dict[str, str],
               package: str, watch: tuple[str, ...], log_path: Path,
               progress: Progress | None = None, timeout: float | None = None,
               collect_only: bool = False, workers: int = 0, gpus: list[str] | None = None,
               cancel: threading.Event | None = None, node_ids: list[str] | None = None,
               callrec: Path | None = None, frozen: list[str] | None = None,
               preload: list[str] | None = None, owner: str | None = None) -> PytestRun:
    """Run the test file of `tree` via a neutral symlink (or, with `node_ids`, those tests of it);
    collect junit, events and the log. With `callrec` (a directory), the test's calls into the
    package are recorded there (inside/scripts/flaloop_callrec.py; only a run at the base is asked to).
    `frozen` (paths relative to the tree) are the files whose code the plugin holds the test
    process to. With `preload` (a fork server's module list) and no xdist workers, pytest is forked
    from a warm server of that list where `warm_server` allows it (one it starts belongs to the
    checkout `owner`), and spawned otherwise."""
    tmp = git.neutral_tempdir("flaloop-gate-")
    try:
        link = tmp / "tree"
        os.symlink(tree, link)
        events, junit = tmp / "events.jsonl", tmp / "junit.xml"
        targets = [str(link / i) for i in node_ids] if node_ids else [str(link / test_rel)]
        cmd = [python, "-m", "pytest", *targets, f"--rootdir={link}", "-p", "flaloop_gate_plugin",
               "-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_family=xunit2", "-rfEs",
               "--color=no"]
        if callrec is not None and not collect_only:
            cmd[cmd.index("no:cacheprovider") + 1:cmd.index("no:cacheprovider") + 1] = ["-p", "flaloop_callrec"]
        if k_expr:
            cmd += ["-k", k_expr]
        if collect_only:
            cmd += ["--collect-only", "-q"]
        elif workers:
            cmd += ["-n", str(workers)]
        # flaloop's plugin first: a module of the same name in the tree must not stand in for it
        pypath = [str(PLUGIN_DIR), str(link)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        # an xdist worker's identity from a pytest that runs flaloop is not this pytest's: its own
        # workers set their own, and a run without workers must not look like one
        outer = {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST_")}
        run_env = {**outer, "PYTHONPATH": os.pathsep.join(pypath), "FLALOOP_GATE_EVENTS": str(events),
                   "FLALOOP_GATE_PACKAGE": package, "FLALOOP_GATE_WATCH_ENV": ",".join(watch),
                   "PYTHONUNBUFFERED": "1", "FLALOOP_GATE_MARKER_SKIPS": "1" if collect_only else "0",
                   "FLALOOP_GATE_GPUS": ",".join(gpus or []),
                   **({"FLALOOP_CALLREC_DIR": str(callrec)} if callrec is not None and not collect_only else {}),
                   "FLALOOP_GATE_TREE": str(link), "FLALOOP_GATE_FROZEN": os.pathsep.join(frozen or []),
                   # pytest cuts its `FAILED id - reason` lines at the terminal width
                   "COLUMNS": "400"}
        server, fresh_why = None, "xdist workers: each starts fresh" if workers else "no preload list was given"
        if preload is not None and not workers:
            server, fresh_why = warm_server(python, env, preload, package, [tmp, PLUGIN_DIR, link], owner)
        how = f"# forked by the warm fork server {server.pid}\n" if server is not None else f"# fresh: {fresh_why}\n"
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = procs.CappedLog(log_path, head=16 << 20, tail=4 << 20, header="$ " + " ".join(cmd) + "\n" + how)
        except OSError as exc:
            if server is not None:
                server.close()
            raise fsutil.storage_error(exc, log_path) from exc
        t0 = time.monotonic()
        try:
            proc = None
            if server is not None:
                try:  # it watches this flaloop through its lifeline (inside/worker/__main__.py)
                    pid, stdin, stdout = server.spawn(["--pytest", *cmd[3:]], tmp, run_env, log)
                    for end in (stdin, stdout):  # its stdin reads nothing, as DEVNULL; it speaks no protocol
                        end.close()
                    proc = _ForkedPytest(forkservers.ForkedProc(server, pid, None, None))
                except RuntimeError as exc:  # the server refused or is gone: a fresh interpreter
                    server.close()
                    server, fresh_why = None, str(exc)
            if proc is None:
                # pytest and its xdist workers die with flaloop, even by SIGKILL (see flaloop.core.procs)
                proc = procs.spawn(cmd, cwd=tmp, env=run_env, stdout=log.fd, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
            log.started()
            try:
                _wait(proc, events, progress, timeout, t0, cancel)
            finally:
                _kill(proc)  # xdist workers may linger after pytest itself exited
        finally:
            log.close()
            if server is not None:
                server.close()
        wall = time.monotonic() - t0
        evs = read_events(events)
        # Under xdist every worker collects and finishes: merge what they saw.
        collected_evs = [e for e in evs if e["event"] == "collected"]
        finish_evs = [e for e in evs if e["event"] == "finish"]
        outcomes = {e["id"]: e["outcome"] for e in evs if e["event"] == "result"}
        crashes = {e["id"]: {"when": e.get("when"), "message": e.get("crash") or ""} for e in evs
                   if e["event"] == "result" and e["outcome"] == "failed"}
        files = [str(tree / f[len(f"{link}/"):]) if f.startswith(f"{link}/") else f
                 for f in (e.get("package_file") for e in finish_evs + collected_evs) if f]
        outside = [f for f in files if not f.startswith(f"{tree}{os.sep}")]
        env_inside: dict[str, str] = {}
        for e in collected_evs + finish_evs:
            env_inside.update(e.get("env", {}))
        first = collected_evs[0] if collected_evs else {}
        run = PytestRun(exit_code=proc.returncode, forked=server is not None, fresh_why="" if server else fresh_why,
                        selected=first.get("ids", []), outcomes=outcomes,
                        crashes=crashes, wall_s=wall, package_file=(outside or files or [None])[0], env_inside=env_inside,
                        marker_skips=first.get("marker_skips"),
                        workers={e["worker"]: e.get("cuda_visible_devices") for e in collected_evs if e.get("worker")})
        if not collect_only:
            run.integrity = gate_integrity.collect(evs, str(PLUGIN_DIR / "flaloop_gate_plugin.py"))
        if junit.exists():
            run.junit_outcomes = gate_integrity.junit_outcomes(junit)
            counts, run.junit_time, run.junit_ids = parse_junit(junit)
            run.failed, run.errors, run.skipped = counts["failures"], counts["errors"], counts["skipped"]
            run.passed = counts["tests"] - run.failed - run.errors - run.skipped
        run.log_tail = log_tail(log_path)
        run.short_summary = short_summary(log_path)
        return run
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _wait(proc: subprocess.Popen | _ForkedPytest, events: Path, progress: Progress | None, timeout: float | None,
          t0: float, cancel: threading.Event | None = None) -> None:
    total, done, seen = 0, 0, 0
    while True:
        try:
            proc.wait(timeout=0.25)
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
        if progress is not None:
            evs = read_events(events)
            if len(evs) != seen:
                seen = len(evs)
                for e in evs:
                    if e["event"] == "collected":
                        total = len(e["ids"])
                results = [e for e in evs if e["event"] == "result"]
                done = len({e["id"] for e in results})
                progress(done, total, results[-1]["id"] if results else "collecting")
        if finished:
            return
        if (timeout is not None and time.monotonic() - t0 > timeout) or (cancel is not None and cancel.is_set()):
            _kill(proc)
            return


def _kill(proc: subprocess.Popen | _ForkedPytest) -> None:
    # SIGINT first: pytest then still writes its summary and JUnit file
    procs.kill_popen(proc, (signal.SIGINT, signal.SIGTERM, signal.SIGKILL))


def short_summary(path: Path) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    _, marker, rest = text.rpartition("short test summary info")
    return [line for line in rest.splitlines() if line.startswith(("FAILED ", "ERROR "))] if marker else []


def log_tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
