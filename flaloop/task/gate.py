"""The frozen correctness gate: the op's test file, unmodified, as a black box.

The gate runs `python -m pytest <test file>` in a subprocess of the target's interpreter and
turns red when
  - a frozen file differs from the contract (the file is named and its diff shown),
  - the collected test ids differ from those at the base commit,
  - more cases are skipped than at the base,
  - fewer cases ran than were selected,
  - pytest exits non-zero, or no test ran,
  - a weakening variable (FLA_CI_ENV, SKIP_TEST_*, ...) is set inside the test process,
  - the target package was imported from somewhere other than the tree under test,
  - the test process was tampered with in memory: a judge, pytest's reporting path or the gate
    plugin changed, or the plugin's integrity reports are missing (`gate_integrity`).
Weakening variables in the caller's environment are removed before the run, and said so.
Where several xdist workers shared the GPUs, a test whose failure is the GPU running out of
memory runs again alone and counts by that answer (`_retry_out_of_memory`; the result's
`oom_retry` says which and how they fared).

The tree is run through a symlink in a neutral temp dir: FLA's conftest stops NaN-poisoning
for any frame whose file path contains `tests/` or `test_`, so a checkout living under such a
path would silently switch the poisoning off.

The baseline (ids and skip count at the base commit) comes from a collect-only run of the same
test file in a worktree of the base, its skip markers evaluated as pytest would; only when the
candidate skips more than that, or its test process shows in-memory changes the base's collection
did not make, does the gate also run the whole file at the base (whose own changes while its tests
run are then inherited, never blamed on the candidate). Both are cached per base commit, selection
and interpreter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flaloop.bench import forkservers
from flaloop.core import clock, fsutil, git
from flaloop.core.errors import UsageError
from flaloop.core.workspace import Workspace
from flaloop.task import gate_integrity, testcalls
from flaloop.task.contract import Contract, changed_frozen
from flaloop.task.pytest_run import (
    Progress,
    PytestRun,
    clean_env,
    is_weakening,
    run_pytest,
)
from flaloop.task.target import Target


@dataclass
class RedReason:
    """One reason the gate is red."""

    kind: str
    message: str
    detail: str = ""


@dataclass
class GateResult:
    op: str
    test_file: str
    k_expr: str | None
    green: bool
    findings: list[RedReason]
    stripped_env: dict[str, str]
    tree: dict
    base_commit: str
    run: PytestRun | None
    baseline: dict | None
    log_path: str | None
    started: str
    wall_s: float
    key: str | None = None           # what a later identical gate would have to match (reuse_key)
    reused_from: str | None = None   # `started` of the recorded green gate this result reuses
    oom_retry: dict | None = None    # tests out of GPU memory beside other workers, run again alone

    @property
    def signal_only(self) -> bool:
        """A `-k` subset never counts as a promotion gate."""
        return self.k_expr is not None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["signal_only"] = self.signal_only
        d["counts"] = None if self.run is None else {
            "passed": self.run.passed, "failed": self.run.failed, "skipped": self.run.skipped,
            "errors": self.run.errors, "selected": len(self.run.selected), "ran": self.run.ran,
            "time_s": round(self.run.junit_time, 3), "pytest_exit": self.run.exit_code,
        }
        if d["run"]:
            d["run"].pop("outcomes", None)
            d["run"].pop("junit_ids", None)
            d["run"].pop("junit_outcomes", None)
            if d["run"].get("integrity"):
                d["run"]["integrity"].pop("tested", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> GateResult:
        run = d.get("run")
        known_run = set(PytestRun.__dataclass_fields__)
        return cls(
            op=d["op"], test_file=d["test_file"], k_expr=d.get("k_expr"), green=d["green"],
            findings=[RedReason(**f) for f in d.get("findings") or []], stripped_env=d.get("stripped_env") or {},
            tree=d["tree"], base_commit=d["base_commit"],
            run=PytestRun(**{"outcomes": {}, **{k: v for k, v in run.items() if k in known_run}}) if run else None,
            baseline=d.get("baseline"), log_path=d.get("log_path"), started=d["started"], wall_s=d.get("wall_s", 0.0),
            key=d.get("key"), reused_from=d.get("reused_from"), oom_retry=d.get("oom_retry"))


# -- the test process's warm interpreter -----------------------------------------------------------

def warm_preload(target: Target, contract: Contract) -> list[str]:
    """The module list of the fork server a bench of this op leaves warm: a test process without
    xdist workers is forked from it when it runs (pytest_run.warm_server), saving the import of
    torch and the op's libraries that a fresh interpreter pays at every gate. The list of
    the bench's `--import full` workers: the test imports the op as users do."""
    return forkservers.op_preload(target.python, contract.op)


# -- baseline at the base commit ----------------------------------------------------------------

def _baseline_key(contract: Contract, k_expr: str | None, python: str, kind: str) -> str:
    h = hashlib.sha256(json.dumps([contract.base_commit, contract.test_file, k_expr, python, kind]).encode())
    return f"{contract.base_commit[:12]}-{kind}-{h.hexdigest()[:10]}"


def _baseline_cache(target: Target, contract: Contract, k_expr: str | None, kind: str) -> Path:
    key = _baseline_key(contract, k_expr, target.python, kind)
    return target.workspace(contract.op).gate_baseline(key)


def _cached_baseline(target: Target, contract: Contract, k_expr: str | None, kind: str) -> dict | None:
    cached = fsutil.read_json_cache(_baseline_cache(target, contract, k_expr, kind))
    # a baseline from before the base's own in-memory changes were recorded is taken again (seconds)
    if isinstance(cached, dict) and isinstance(cached.get("selected"), list) and "integrity_changes" in cached:
        return {**cached, "cached": True}
    return None


def baseline(target: Target, contract: Contract, k_expr: str | None, *, env: dict[str, str],
             watch: tuple[str, ...], progress: Progress | None = None,
             timeout: float | None = None, kind: str = "collect", cancel: threading.Event | None = None) -> dict:
    """Selected ids and skip count of the test file at the base commit (cached per base commit).

    kind "collect": a collect-only run; skips are those its skip/skipif markers declare. Seconds,
    even where running the file takes many minutes (FLA on a cold GPU).
    kind "full": the whole file run at the base; every skip counted, also those a test body or
    fixture decides at run time. The gate asks for it only when the candidate skipped more than
    the markers explain.
    """
    cached = _cached_baseline(target, contract, k_expr, kind)
    if cached is not None:
        return cached
    cache = _baseline_cache(target, contract, k_expr, kind)
    package = contract.import_path.split(".")[0]
    with git.worktree(target.root, contract.base_commit, "base") as wt:
        run = run_pytest(target.python, wt, contract.test_file, k_expr=k_expr, env=env, package=package,
                         watch=watch, log_path=cache.with_suffix(".log"), progress=progress, timeout=timeout,
                         collect_only=kind == "collect", cancel=cancel, frozen=[f.path for f in contract.frozen],
                         preload=warm_preload(target, contract), owner=str(target.checkout()))
        # what the base's own process changed (installed plugins, the base's modules): never the candidate's
        base_changes = gate_integrity.keys(run.integrity, (str(wt),))
    ok_codes = (0,) if kind == "collect" else (0, 1)
    if run.exit_code not in ok_codes or not run.selected or (kind == "collect" and run.marker_skips is None):
        raise UsageError(
            f"the base {contract.base_commit[:12]} could not {'collect' if kind == 'collect' else 'run'} "
            f"{contract.test_file} (pytest exit {run.exit_code}, {len(run.selected)} selected): "
            "no baseline to compare with",
            f"read {cache.with_suffix('.log')}\n{run.log_tail[-1500:]}",
        )
    skipped = len(run.marker_skips or []) if kind == "collect" else run.skipped
    data = {"kind": kind, "base_commit": contract.base_commit, "k_expr": k_expr, "python": target.python,
            "selected": run.selected, "skipped": skipped, "failed": run.failed, "errors": run.errors,
            "passed": run.passed, "wall_s": round(run.wall_s, 2), "integrity_changes": base_changes}
    fsutil.atomic_write_json(cache, data)
    return {**data, "cached": False}


# -- reuse of a recorded green gate -------------------------------------------------------------

# Variables that describe the shell, not the test run: they never make two gates differ.
VOLATILE_ENV = ("PWD", "OLDPWD", "SHLVL", "_", "TERM", "TERM_PROGRAM", "COLUMNS", "LINES", "PS1", "PS2",
                "HISTFILE", "LS_COLORS", "DISPLAY", "SSH_*", "TMUX*", "STY", "WINDOW", "COLORTERM", "FLALOOP_*",
                "OUT", "LESS*", "PAGER", "EDITOR", "VISUAL", "MAIL", "LOGNAME", "USER", "HOSTNAME")


def reuse_key(target: Target, contract: Contract, k_expr: str | None, env: dict[str, str], tree: dict) -> str:
    """What a gate depends on: the tree state (HEAD and a hash of every uncommitted change), the
    contract (base commit, test file, frozen hashes), the environment of the test process and the
    interpreter (its path, size and modification time), and the -k selection."""
    try:
        st = os.stat(os.path.realpath(shutil.which(target.python) or target.python))
        interp = [os.path.realpath(shutil.which(target.python) or target.python), st.st_size, st.st_mtime_ns]
    except OSError:
        interp = [target.python]
    relevant = {k: v for k, v in env.items() if not is_weakening(k, VOLATILE_ENV)}
    doc = {"tree": [tree.get("head"), tree.get("dirty"), tree.get("diff_hash")],
           "contract": [contract.base_commit, contract.test_file, [[f.path, f.sha256] for f in contract.frozen]],
           "env": sorted(relevant.items()), "python": interp, "k": k_expr}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def _green_cache(target: Target, op: str, key: str) -> Path:
    return target.workspace(op).gate_green(key)


def recorded_green(target: Target, op: str, key: str) -> GateResult | None:
    p = _green_cache(target, op, key)
    try:
        result = GateResult.from_dict(json.loads(p.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result if result.green and result.key == key else None


# -- the gate -----------------------------------------------------------------------------------

def _failure_summary(run: PytestRun) -> str:
    """pytest's short summary (`FAILED id - reason` lines, from -rfE); else the log's tail."""
    return "\n".join(run.short_summary) if run.short_summary else run.log_tail


def judge(run: PytestRun, base: dict, package_root: str, tree: Path) -> list[RedReason]:
    """Every reason this run does not count as green."""
    out: list[RedReason] = []
    if run.exit_code is None or run.exit_code < 0:
        out.append(RedReason("pytest-died", f"pytest was killed (signal {-(run.exit_code or 0)}) or timed out",
                           run.log_tail))
    elif run.exit_code != 0:
        what = {1: "tests failed", 2: "interrupted or collection errors", 3: "internal error",
                4: "usage error", 5: "no tests collected"}.get(run.exit_code, "error")
        out.append(RedReason("pytest-exit", f"pytest exited {run.exit_code} ({what})", _failure_summary(run)))
    if run.ran == 0:
        out.append(RedReason("no-test-ran", "no test ran: a gate that runs nothing proves nothing"))
    base_ids, ids = set(base["selected"]), set(run.selected)
    if base_ids != ids:
        added, removed = sorted(ids - base_ids), sorted(base_ids - ids)
        detail = "\n".join([*(f"+ {i}" for i in added[:30]), *(f"- {i}" for i in removed[:30])])
        out.append(RedReason("ids-changed", f"the collected test ids differ from the base's: "
                                          f"{len(added)} new, {len(removed)} missing", detail))
    if run.skipped > base["skipped"]:
        skipped = sorted(i for i, o in run.outcomes.items() if o == "skipped")
        out.append(RedReason("more-skips", f"{run.skipped} cases skipped, the base skips {base['skipped']}",
                           "\n".join(skipped[:30])))
    not_run = [i for i in run.selected if i not in run.outcomes]
    if run.selected and (not_run or run.ran < len(run.selected)):
        out.append(RedReason("not-run", f"{len(run.selected)} cases were selected but only {run.ran} ran",
                           "\n".join(not_run[:30])))
    if run.env_inside:
        names = ", ".join(f"{k}={v}" for k, v in run.env_inside.items())
        out.append(RedReason("weakening-env", f"weakening variable(s) set inside the test process: {names}",
                           "something in the tree sets them at import time; they turn failures into passes"))
    if run.package_file is None:
        out.append(RedReason("package-not-imported", f"the tests never imported the target package {package_root!r}"))
    elif not os.path.abspath(run.package_file).startswith(str(tree).rstrip(os.sep) + os.sep):
        out.append(RedReason("wrong-tree", f"{package_root} was imported from {run.package_file}, "
                                         f"not from the tree under test",
                           "an installed copy shadows the checkout: the gate would test the wrong code"))
    if run.integrity is not None:
        out += [RedReason("gate-tampered", message, detail) for message, detail in
                gate_integrity.reasons(run.integrity, run.outcomes, run.junit_outcomes, run.exit_code,
                                       base.get("integrity_changes"), (str(tree),))]
    return out


def xdist_workers(n_gpus: int, sharing: int = 1) -> int:
    """The gate's pytest-xdist workers by default: none without a GPU; else up to 8 a GPU and one for
    every two CPU cores among the `sharing` gates that run at once (a cold FLA gate is compile-bound)."""
    if n_gpus < 1:
        return 0
    return min(8 * n_gpus, max(2, (os.cpu_count() or 2) // (2 * max(1, sharing))))


def _base_and_candidate(target: Target, contract: Contract, k_expr: str | None, env: dict[str, str],
                        watch: tuple[str, ...], log_path: Path, progress, baseline_progress,
                        timeout: float | None, workers: int, gpus: list[str] | None,
                        cancel: threading.Event | None = None, callrec: Path | None = None) -> tuple[dict, PytestRun]:
    """The base's collected ids and the candidate's run. A baseline cached for this base commit is
    read first, and no more xdist workers start than it has tests; an uncached one (a collect-only
    run at the base: a torch import and a collection, 20 s for FLA on the H200) runs beside the
    candidate's pytest instead of before it, and stops that run if the base cannot collect."""
    package = contract.import_path.split(".")[0]

    def candidate(n: int, cancel: threading.Event | None = None) -> PytestRun:
        return run_pytest(target.python, target.root, contract.test_file, k_expr=k_expr, env=env, package=package,
                          watch=watch, log_path=log_path, progress=progress, timeout=timeout, workers=n, gpus=gpus,
                          cancel=cancel, callrec=callrec, frozen=[f.path for f in contract.frozen],
                          preload=warm_preload(target, contract), owner=str(target.checkout()))

    base = _cached_baseline(target, contract, k_expr, "collect")
    if base is not None:
        return base, candidate(min(workers, max(1, len(base["selected"]))) if workers else 0, cancel)
    stop = threading.Event()  # the base failed, or the caller was interrupted or withdrew: both runs end
    box: dict = {}
    done = threading.Event()

    def watch_cancel() -> None:
        while not done.wait(0.2):
            if cancel is not None and cancel.is_set():
                stop.set()
                return

    def base_side() -> None:
        try:
            box["base"] = baseline(target, contract, k_expr, env=env, watch=watch, progress=baseline_progress,
                                   timeout=timeout, cancel=stop)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc
            stop.set()

    t = threading.Thread(target=base_side, name="flaloop-gate-baseline", daemon=True)
    t.start()
    if cancel is not None:
        threading.Thread(target=watch_cancel, name="flaloop-gate-cancel", daemon=True).start()
    try:
        run = candidate(workers, stop)
        t.join()
    except BaseException:  # an interrupt, also one that lands while waiting for the base
        stop.set()
        t.join(timeout=30)  # its pytest is stopped within a second or so; its worktree goes with it
        raise
    finally:
        done.set()
    if "error" in box:
        raise box["error"]
    return box["base"], run


def run_gate(target: Target, contract: Contract, *, k_expr: str | None = None,
             progress: Progress | None = None, baseline_progress: Progress | None = None,
             timeout: float | None = None, workers: int = 0, gpus: list[str] | None = None,
             regate: bool = False, cancel: threading.Event | None = None, record_last: bool = True) -> GateResult:
    """Run the gate. `workers` > 0 spreads the candidate's run over pytest-xdist workers (Triton
    compiles in parallel: a cold FLA gate is compile-bound); `gpus` pins worker i to gpus[i % n].

    A recorded green gate whose `reuse_key` equals this one's (same tree state, contract, frozen
    hashes, environment and interpreter) is returned instead of running pytest again, marked
    `reused_from`; `regate` always runs it. `cancel` stops pytest (a sweep withdrawn); a gate of a
    tree other than the user's (a sweep's candidate) passes `record_last=False`: `gate/last.json`
    speaks of the user's tree."""
    started = clock.now_iso()
    t0 = time.monotonic()
    env, stripped, watch = clean_env(target.extra_strip_env())
    ws = target.workspace(contract.op)
    stamp = clock.stamp_of(started)
    tree = git.tree_state(target.root)
    key = reuse_key(target, contract, k_expr, env, tree)
    if not regate:
        prior = recorded_green(target, contract.op, key)
        if prior is not None and not changed_frozen(target, contract):
            prior.reused_from, prior.stripped_env, prior.wall_s = prior.started, stripped, time.monotonic() - t0
            if record_last:
                record(target, prior)
            return prior
    findings: list[RedReason] = []
    for f, diff in changed_frozen(target, contract):
        findings.append(RedReason("frozen-changed", f"frozen file {f.path} ({f.reason}) differs from the contract",
                                diff))
    run = base = oom_retry = None
    log_path = None
    if not findings:  # a frozen edit is red already; don't spend minutes of GPU on it
        target.require_test_file(contract.op, contract.test_file)
        log_path = _claim_log(ws, stamp)
        # the tree is the base itself: the test's own calls are recorded for the bench to replay
        at_base = tree.get("head") == contract.base_commit and not tree.get("dirty") and not k_expr
        callrec = Path(git.neutral_tempdir("flaloop-callrec-")) if at_base else None
        try:
            base, run = _base_and_candidate(target, contract, k_expr, env, watch, log_path, progress,
                                            baseline_progress, timeout, workers, gpus, cancel, callrec)
            if callrec is not None and run.exit_code == 0:
                # stored even when empty: the bench then says the test made no call it could replay
                doc = testcalls.collect(callrec, contract.import_path.split(".")[0]) or \
                    testcalls.merge([], contract.import_path.split(".")[0])
                testcalls.store(ws, doc, base_commit=contract.base_commit, test_file=contract.test_file)
        finally:
            if callrec is not None:
                shutil.rmtree(callrec, ignore_errors=True)
        if workers and run.exit_code == 4 and "-n" in run.log_tail and "unrecognized" in run.log_tail:
            raise UsageError(f"--workers needs pytest-xdist in the target's Python ({target.python})",
                             "install pytest-xdist there, or drop --workers")
        run, oom_retry = _retry_out_of_memory(target, contract, env, watch, log_path, run, progress, timeout, gpus,
                                              cancel)
        # More skips than the base's markers declare, or changes in the test process that the base's
        # collection did not make: only a full run at the base can say whether the base skipped them
        # too (a test body may call pytest.skip itself), or makes the same changes while its own tests
        # run (a module that deletes a helper after first use, a wrapper installed at the op's first call).
        more_skips = run.skipped > base["skipped"]
        new_changes = gate_integrity.unexplained(run.integrity, base.get("integrity_changes"), (str(target.root),))
        if base.get("kind") != "full" and (more_skips or new_changes) and run.exit_code is not None \
                and run.exit_code >= 0:
            base = baseline(target, contract, k_expr, env=env, watch=watch, progress=baseline_progress,
                            timeout=timeout, kind="full", cancel=cancel)
        findings += judge(run, base, contract.import_path.split(".")[0], target.root)
        if tree.get("head") == contract.base_commit and not tree.get("dirty"):
            findings = [_at_base(f) for f in findings]
    result = GateResult(op=contract.op, test_file=contract.test_file, k_expr=k_expr, green=not findings,
                        findings=findings, stripped_env=stripped, tree=tree, base_commit=contract.base_commit,
                        run=run, baseline=base, log_path=str(log_path) if run else None, started=started,
                        wall_s=time.monotonic() - t0, key=key, oom_retry=oom_retry)
    if record_last:
        record(target, result)
    if result.green:
        fsutil.atomic_write_json(_green_cache(target, contract.op, key), result.to_dict())
    return result


def _at_base(reason: RedReason) -> RedReason:
    """A failing run of the base commit itself, unchanged, says so: no candidate made it red, so the
    loop cannot start here until the environment (a backend package's version, the GPU) or the base
    is fixed (seen: FLA's TileLang tests at bc3b101d against tilelang 0.1.15 from PyPI, while FLA's CI
    installs tilelang's nightly)."""
    if reason.kind not in ("pytest-exit", "pytest-died", "not-run"):
        return reason
    return dataclasses.replace(reason, message=reason.message + " at the base commit itself, unchanged: the op's "
                               "own tests fail in this environment (a package's version, the GPU), not a change's")


# the GPU's out-of-memory error as torch, the CUDA driver and the runtime word it
OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation")


def _retry_out_of_memory(target: Target, contract: Contract, env: dict[str, str], watch: tuple[str, ...],
                         log_path: Path, run: PytestRun, progress, timeout: float | None, gpus: list[str] | None,
                         cancel: threading.Event | None) -> tuple[PytestRun, dict | None]:
    """The run as it counts, and what was run again (or None).

    The gate's xdist workers share each GPU's memory, and a test that needs much of it can run out
    beside the others (FLA's test_attnres on one H200 while 16 workers of two gates shared it: 2 of
    16 failed so, and all passed with the GPU to one gate). Every test whose failure is the GPU's
    out-of-memory error runs again, one at a time with no worker beside it, and counts by that
    answer; one that fails alone too stays failed, with its own message. Only where several workers
    ran: a test alone already had what memory there was."""
    ids = sorted(i for i, c in run.crashes.items() if OUT_OF_MEMORY.search(c.get("message") or ""))
    if len(run.workers) < 2 or not ids or (cancel is not None and cancel.is_set()):
        return run, None
    alone_log = log_path.with_name(log_path.stem + "-oom-alone.log")
    again = run_pytest(target.python, target.root, contract.test_file, k_expr=None, env=env,
                       package=contract.import_path.split(".")[0], watch=watch, log_path=alone_log,
                       progress=progress, timeout=timeout, workers=0, gpus=gpus, cancel=cancel, node_ids=ids,
                       frozen=[f.path for f in contract.frozen], preload=warm_preload(target, contract),
                       owner=str(target.checkout()))
    passed = [i for i in ids if again.outcomes.get(i) == "passed"]
    retry = {"ids": ids, "workers": len(run.workers), "passed_alone": passed,
             "still_failing": {i: (again.crashes.get(i) or {}).get("message") or again.outcomes.get(i, "did not run")
                               for i in ids if i not in passed},
             "wall_s": round(again.wall_s, 3), "log": str(alone_log)}
    if not passed:
        return run, retry
    in_setup = sum(1 for i in passed if run.crashes[i].get("when") == "setup")  # pytest counts those as errors
    failed, errors = run.failed - (len(passed) - in_setup), run.errors - in_setup
    fixed = dataclasses.replace(
        run, outcomes={**run.outcomes, **{i: "passed" for i in passed}},
        crashes={i: c for i, c in run.crashes.items() if i not in passed},
        passed=run.passed + len(passed), failed=failed, errors=errors,
        exit_code=0 if run.exit_code == 1 and failed == errors == 0 else run.exit_code,
        short_summary=[line for line in run.short_summary if not any(i in line for i in passed)])
    return fixed, retry


def _claim_log(ws: Workspace, stamp: str) -> Path:
    """A log path no other gate has: two gates within one second (a sweep runs several at once) keep both."""
    gate_dir = ws.gate
    try:
        gate_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise fsutil.storage_error(exc, gate_dir) from exc
    for i in range(1, 10000):
        path = ws.gate_log(stamp, i)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise fsutil.storage_error(exc, path) from exc
    raise UsageError(f"{gate_dir} holds 10000 gate logs of the second {stamp}", "run `flaloop clean OP`")


def record(target: Target, result: GateResult) -> Path:
    """Keep the result for later commands (verify, iter, report)."""
    return fsutil.atomic_write_json(target.workspace(result.op).gate_last, result.to_dict())


def last_result(target: Target, op: str) -> dict | None:
    last = fsutil.read_json_cache(target.workspace(op).gate_last)
    return last if isinstance(last, dict) and isinstance(last.get("tree"), dict) else None


def last_gate_for(target: Target, op: str, tree: dict) -> dict | None:
    """The recorded gate result, when it was taken of exactly this tree state (HEAD + diff)."""
    last = last_result(target, op)
    if not last or {k: last["tree"].get(k) for k in ("head", "dirty", "diff_hash")} != \
            {k: tree.get(k) for k in ("head", "dirty", "diff_hash")}:
        return None
    return {k: last.get(k) for k in ("green", "signal_only", "started", "counts", "k_expr", "reused_from")}
