"""Measure: run a plan's session on one device of this machine, given a repository to check the
two commits out of. Called by `flaloop bench` (the user's repository), by a sweep's local
executor (one thread per GPU) and inside a Ray task (a clone of a git bundle on the node).

Everything that belongs to the device's machine happens here: the worktrees, the Triton cache,
the launcher and its fork server, the NVML evidence (in the session) and the device's roofline
ceilings. The result is a `Measurement` (raw cell results), for bench/finish.py.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from flaloop.bench import roofline
from flaloop.bench.launcher import Launcher, make_launcher
from flaloop.bench.measurement import Measurement
from flaloop.bench.plan import MeasurePlan
from flaloop.bench.session import Cancelled, Events, Session
from flaloop.core import fsutil, git
from flaloop.core.errors import MeasurementError


def session_env(plan: MeasurePlan, triton_cache: Path, base_env: dict | None = None) -> dict:
    """The workers' environment: this process's, the Triton cache shared by both sides (a second run
    recompiles nothing) and, unless each side tunes on its own, autotune results kept on disk."""
    env = dict(os.environ if base_env is None else base_env)
    env["TRITON_CACHE_DIR"] = str(triton_cache)
    if plan.config.independent_tuning:
        env.pop("TRITON_CACHE_AUTOTUNING", None)
    else:  # keyed by kernel source: see BenchConfig.independent_tuning
        env["TRITON_CACHE_AUTOTUNING"] = "1"
    return env


def registry_path(plan: MeasurePlan, base_tree: Path, run_dir: Path) -> Path:
    """What the workers read the op's inputs from: the base's registry, or the op's declaration
    written beside the run (a `.json` file: inside/worker/declared.py)."""
    if plan.declared is None:
        return base_tree / plan.registry_rel
    path = Path(run_dir) / "op-declared.json"
    fsutil.atomic_write_json(path, plan.declared)
    return path


def measure(plan: MeasurePlan, *, repo: Path, run_dir: Path, triton_cache: Path, gpu: str | None = None,
            on_event: Events | None = None, cancel: threading.Event | None = None,
            launcher: Launcher | None = None, base_env: dict | None = None) -> Measurement:
    """One session of `plan` on this machine (on GPU `gpu` when given). An interrupt or a cancel is
    re-raised with the partial measurement attached (`exc.measurement`), so a record can still be kept."""
    session = None
    t0 = time.monotonic()
    own_launcher = launcher is None
    interrupted = False
    with ExitStack() as stack:
        try:
            base_tree = stack.enter_context(git.worktree(repo, plan.base.commit, "base"))
            cand_tree = base_tree if plan.same_tree else stack.enter_context(
                git.worktree(repo, plan.candidate.commit, "cand"))
            env = session_env(plan, triton_cache, base_env)
            if launcher is None:
                launcher = make_launcher(forkserver=plan.config.forkserver, python=plan.python, op=plan.op,
                                         registry=registry_path(plan, base_tree, run_dir), device=plan.config.device, env=env,
                                         import_mode=plan.config.import_mode, gpu=gpu, cand_env=plan.config.cand_env,
                                         owner=str(repo))
            if own_launcher:
                stack.callback(lambda: launcher.close(leave_warm=not interrupted))
            session = Session(op=plan.op, cells=plan.cells, config=plan.config,
                              trees={"base": base_tree, "cand": cand_tree}, launcher=launcher, run_dir=run_dir,
                              triton_cache=triton_cache, allowed=plan.allowed, on_event=on_event, cancel=cancel,
                              t0=t0, unseen=plan.unseen, test_calls=plan.test_calls)
            session.mark("base worktree")  # (and the candidate's)
            m = session.run()
        except BaseException as exc:
            # an interrupted or failed run leaves no new fork server behind (it could not start its workers)
            interrupted = True
            if isinstance(exc, (KeyboardInterrupt, Cancelled, MeasurementError)):
                exc.measurement = session.out if session is not None else None  # type: ignore[attr-defined]
            raise
    if m.env:
        m.env["forkserver"] = launcher.describe()  # as it stands after the launcher closed (left warm?)
        try:
            m.ceilings = roofline.ceilings_for(plan.python, m.env.get("device_uuid")).to_dict()
        except MeasurementError as exc:
            m.ceilings_error = exc.message
    return m
