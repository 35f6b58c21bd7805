"""One candidate of a sweep on one device: its full gate, then its paired bench against the base.

A `Job` is plain data (it travels to a Ray node as a dict); `run_job` runs it on this machine,
given a repository that holds the two commits (the user's, or a clone of a git bundle on a node),
a home for the gate's workspace files, a run directory, a Triton cache and a device. The static
audit ran on the orchestrator before the job was made (a blocked candidate never gets one).

Statuses: `ok` (measured), `blocked` (the gate is red, or the guard blocked a cell), `failed` (it
could not be judged: it does not import or collect, a worker crashed, the measurement failed).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flaloop.bench import evidence
from flaloop.bench.measure import measure
from flaloop.bench.plan import MeasurePlan
from flaloop.bench.session import Cancelled
from flaloop.core import fsutil, git
from flaloop.core.errors import FlaloopError
from flaloop.core.workspace import Workspace
from flaloop.task import gate as gate_mod
from flaloop.task.contract import Contract
from flaloop.task.target import Target

# pytest exit codes that say the tests could not even be collected or run: the candidate is broken
# (does not import, fails collection), not wrong; see gate.judge
CANNOT_TEST = {2, 3, 4, 5}
CANNOT_TEST_KINDS = {"no-test-ran", "package-not-imported", "pytest-died"}


@dataclass
class Job:
    key: str
    ref: str
    plan: dict                   # bench.plan.MeasurePlan.to_dict()
    contract: dict               # the op's contract (contract.Contract.to_dict())
    config: dict                 # the target's flaloop.toml (target.Target.config)
    regate: bool = False
    gate_workers: int | None = 0  # None: the machine that runs it decides
    # workspace files to put in the job's home before the gate, so that a node need not redo what
    # the orchestrator has: the base's collected test ids, green gates of this exact tree {rel: doc}
    seed: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Job:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class JobResult:
    key: str
    status: str                  # ok | blocked | failed
    reason: str = ""
    gate: dict | None = None     # gate.GateResult.to_dict()
    measurement: dict | None = None  # bench.session.Measurement.to_dict()
    host: str = field(default_factory=socket.gethostname)
    gpu: str | None = None
    wall_s: float = 0.0
    gate_s: float = 0.0
    attempts: list[dict] = field(default_factory=list)  # earlier attempts that died (Ray): {host, why}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> JobResult:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class JobContext:
    """Where a job runs: all of it belongs to the machine of the device."""

    repo: Path                   # a repository holding the base and candidate commits
    home: Path                   # the gate's workspace lives under home/profile/<op>-opt
    run_dir: Path                # the session's logs and dumps
    triton_cache: Path
    gpu: str | None = None       # CUDA_VISIBLE_DEVICES for the workers (None: as this process has it)
    on_event: Callable[..., None] = lambda *a, **k: None
    cancel: threading.Event | None = None


_ERROR_LINE = re.compile(r"^(?:E\s+)?([A-Za-z_.]*(?:Error|Exception)\b.*)$")


def _gate_verdict(result: gate_mod.GateResult) -> tuple[str, str]:
    """(status, reason) of a red gate: `failed` when the candidate could not even be tested (it does
    not import, its tests do not collect), `blocked` when it was tested and is wrong."""
    code = result.run.exit_code if result.run else None
    kinds = {f.kind for f in result.findings}
    if code in CANNOT_TEST or kinds & CANNOT_TEST_KINDS:
        lines = (result.run.log_tail if result.run else "").splitlines()
        error = next((m.group(1).strip() for line in reversed(lines) if (m := _ERROR_LINE.match(line.strip()))), "")
        why = f"pytest exited {code}" if code is not None else "; ".join(sorted(kinds))
        return "failed", f"the gate could not test it ({why})" + (f": {error[:300]}" if error else "")
    reasons = "; ".join(f"{f.kind}: {f.message}" for f in result.findings[:3])
    return "blocked", f"gate red: {reasons}"


def seed_workspace(home: Path, op: str, seed: dict) -> None:
    """Put the orchestrator's cached gate files in a job's workspace (never over a newer one)."""
    ws = Workspace.at(home, op)
    for rel, doc in seed.items():
        path = ws.path_of(rel)
        if not path.exists():
            with contextlib.suppress(OSError):
                fsutil.atomic_write_json(path, doc)


def run_job(job: Job, ctx: JobContext) -> JobResult:
    t0 = time.monotonic()
    plan = MeasurePlan.from_dict(job.plan)
    out = JobResult(key=job.key, status="failed", gpu=ctx.gpu)
    contract = Contract.from_dict(job.contract)
    try:
        # every candidate gets the full gate first
        seed_workspace(ctx.home, contract.op, job.seed)
        ctx.on_event("gate", key=job.key)
        g0 = time.monotonic()
        workers = job.gate_workers
        if workers is None:  # this machine decides (a Ray node: its one GPU, or its CPU)
            workers = gate_mod.xdist_workers(min(1, len(evidence.visible_gpus())))
        with git.worktree(ctx.repo, plan.candidate.commit, "cand") as tree:
            target = Target(root=ctx.repo, python=plan.python, config=job.config).tree(tree, home=ctx.home)
            result = gate_mod.run_gate(target, contract, workers=workers,
                                       gpus=[ctx.gpu] if ctx.gpu is not None else None, regate=job.regate,
                                       cancel=ctx.cancel, record_last=False)
        out.gate_s = round(time.monotonic() - g0, 2)
        if ctx.cancel is not None and ctx.cancel.is_set():
            raise Cancelled("the sweep was withdrawn")
        out.gate = result.to_dict()
        if not result.green:
            out.status, out.reason = _gate_verdict(result)
            return out
        ctx.on_event("bench", key=job.key)
        m = measure(plan, repo=ctx.repo, run_dir=ctx.run_dir, triton_cache=ctx.triton_cache, gpu=ctx.gpu,
                    on_event=lambda kind, **info: ctx.on_event(kind, key=job.key, **info), cancel=ctx.cancel)
        out.measurement = m.to_dict()
        out.status = "ok"
    except FlaloopError as exc:
        m = getattr(exc, "measurement", None)
        out.measurement = m.to_dict() if m is not None else None
        out.status, out.reason = "failed", exc.message
    finally:
        out.wall_s = round(time.monotonic() - t0, 2)
    return out
