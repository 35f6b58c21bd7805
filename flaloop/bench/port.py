"""What the session's phases may use of it: the port between `bench/session.Session` and the
functions that do its work (the warm-up: bench/warmup.py; the test's calls and the options:
bench/replay.py; the rounds: bench/sampling.py; the timed-call check: bench/timed.py).

The phases are plain functions of a `SessionPort`, not methods: each reads like the story of its
phase, and a test drives one over a small fake that has only what that phase uses
(tests/unit/test_testcalls.py, tests/redteam/test_timed_calls.py) or over the real Session with
scripted workers (tests/unit/test_session.py). `Session` is the one implementation; anything a phase
needs of the session is declared here first, so none of them imports bench/session.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from flaloop.bench.evidence import ClockReading
    from flaloop.bench.measurement import Measurement
    from flaloop.bench.model import BenchConfig, CellResult
    from flaloop.bench.workers import WorkerClient, WorkerFailed
    from flaloop.guard.findings import Finding
    from flaloop.stats.stopping import RuleFactory

# CUDA errors after which the process's context is unusable: the worker answers, but every later
# call would fail too, so the pair is replaced before the next cell.
STICKY_CUDA = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address",
               "illegal instruction", "an illegal address", "CUDA error: unknown error", "uncorrectable ECC")


def sticky_cuda(error: str) -> bool:
    """Whether a worker's error leaves its CUDA context unusable (`STICKY_CUDA`)."""
    return any(s in error for s in STICKY_CUDA)


class SessionPort(Protocol):
    """The session as its phases see it: the run's plan and state, the pair of workers, and what
    to do when a side fails."""

    cfg: BenchConfig
    out: Measurement              # what the run has measured so far, and its story
    results: list[CellResult]     # one per cell, in the plan's order (also `out.results`)
    workers: dict[str, WorkerClient]  # the current pair: {"base": ..., "cand": ...}
    run_dir: Path                 # where dumps that cross between the sides are written
    round: int                    # the round being measured (0-based; the warm-up is round 0's)
    broken: str | None            # why the current pair must be replaced (a sticky CUDA error)
    allowed: list[dict]           # the contract's allowances for guard findings
    unseen: dict | None           # the plan's shapes nobody times (bench/unseen.py); None: no check
    test_calls: dict | None       # the plan's sample of the test's recorded calls; None: none
    stopping: RuleFactory         # makes each cell's stopping rule for a round (stats/stopping.py)

    def on_event(self, what: str, **info) -> None:
        """Progress for the caller (a bar, a line, an MCP notification)."""

    def order(self, rnd: int | None = None) -> tuple[str, str]:
        """Which side starts, sets up and samples first in a round (this one by default)."""

    def setup(self, res: CellResult, side: str, k: int | None, timer: str, placements: int = 1,
              reference: bool = False, draw: str | None = None) -> dict:
        """One side sets a cell up; the worker's reply."""

    def ask(self, side: str, cmd: str, timeout: float, **payload) -> dict:
        """One command to one side; its reply (a dead or hung worker raises `WorkerFailed`)."""

    def ask_both(self, cmd: str, timeout: float, payloads: dict[str, dict]) -> dict[str, dict]:
        """One command to each side named, at once; every reply awaited before a failure is raised."""

    def fail(self, res: CellResult, side: str, reply: dict) -> None:
        """A side answered with an error: the cell is failed, skipped or refused, and said why."""

    def cell_failed(self, res: CellResult, exc: WorkerFailed) -> None:
        """A side's worker died or hung on the cell: the cell is failed."""

    def release(self, res: CellResult) -> None:
        """Both sides free the cell's tensors and graphs."""

    def restart(self, why: str) -> bool:
        """A fresh pair for this round; False when the run's restarts are spent."""

    def blocked_run(self) -> bool:
        """Whether a blocking finding about the whole run stops it."""

    def add_run_findings(self, found: list[Finding]) -> None:
        """Findings about the whole run, each message once."""

    def clock(self) -> ClockReading | None:
        """The GPU's clock now; None without NVML."""

    def occupancy(self) -> dict | None:
        """Who else is on the GPU now; None without NVML."""
