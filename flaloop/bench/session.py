"""The paired benchmark session: one candidate against the base, on one device.

A session is given everything it works with, and makes none of it: the two trees (checked out by
the caller: bench/measure.py), the launcher that starts its workers (bench/launcher.py: spawn,
or fork from a warm server), the Triton cache it may watch, the run directory. It never times
anything itself (workers do), never imports torch, and returns a `Measurement`: the raw cell
results and what happened on the way, for bench/finish.py to analyse. Order of work:

1. Processes: every pair the run will need is started at once (bench/pool.py): the warm-up pair
   and one pair per later round. Each side imports the op from its own tree and proves it by its
   op module's `__file__`.
2. Warm-up (bench/warmup.py), for every cell on both sides before any timed sample: set up,
   compile, autotune, check the candidate's results against the base's, the guard's probes;
   then, once, the candidate against the base on the plan's shapes nobody times (bench/unseen.py).
3. The warm-up pair is closed: it measures nothing (`_fresh_pair`).
4. Rounds (bench/sampling.py): pairs in each round's own fresh processes (round 1's too), each
   round the mirror of the one before (start order, and which side samples first: ABBA, BAAB). A
   cell stops when the stopping rule says so, or once settled beyond the margin; it still takes
   every planned round (as many pairs as round 1 kept): a per-process effect would show in round
   1 alone as confidently as a real speedup.

A worker that crashes or hangs fails the cell it was on; a fresh pair takes over the rest.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

from flaloop.bench import replay, sampling, timed, warmup
from flaloop.bench.analysis import round_estimates
from flaloop.bench.evidence import (
    BLIND,
    UTIL_WINDOW_S,
    ClockReading,
    Clocks,
    busy_while_ours_idle,
    fingerprint,
    idle_evidence,
    occupancy,
    sample_readings,
)
from flaloop.bench.launcher import Launcher
from flaloop.bench.measurement import Measurement
from flaloop.bench.model import MIN_PAIRS_JUDGED, BenchConfig, Cell, CellResult
from flaloop.bench.pool import WorkerPool
from flaloop.bench.port import sticky_cuda
from flaloop.bench.workers import WorkerClient, WorkerFailed
from flaloop.core.errors import MeasurementError
from flaloop.guard import dynamic
from flaloop.guard.findings import Finding, apply_allowances
from flaloop.stats.stopping import CIHalfWidthStop, RuleFactory

Events = Callable[..., None]
MAX_RESTARTS = 4  # fresh pairs after crashes or hangs, per run


class Cancelled(Exception):
    """The caller withdrew the run (verify: the gate running beside the bench went red; a sweep: Ctrl-C)."""


def cache_entries(cache: Path | None) -> int:
    """How many kernel (and autotune) entries a Triton cache directory holds."""
    if cache is None:
        return 0
    try:
        return sum(1 for _ in os.scandir(cache))
    except OSError:
        return 0


class Session:
    """The run's orchestration; its phases are functions of it through `bench/port.SessionPort`,
    which it implements. `stopping` makes each cell's stopping rule for a round (any
    `stats.stopping.RuleFactory`); this is the one place the default is picked: the CI half-width
    rule, `stats.CIHalfWidthStop`."""

    def __init__(self, *, op: str, cells: list[Cell], config: BenchConfig, trees: dict[str, Path],
                 launcher: Launcher, run_dir: Path, triton_cache: Path | None = None,
                 allowed: list[dict] | None = None, on_event: Events | None = None,
                 cancel: threading.Event | None = None, t0: float | None = None, unseen: dict | None = None,
                 test_calls: dict | None = None, stopping: RuleFactory = CIHalfWidthStop):
        self.op, self.cfg, self.trees, self.launcher = op, config, trees, launcher
        self.run_dir, self.triton_cache = run_dir, triton_cache
        self.allowed = allowed or []
        self.on_event = on_event or (lambda *a, **k: None)
        self.cancel = cancel
        self.unseen = unseen  # the plan's draw (bench/unseen.plan); None: no check asked for
        self.test_calls = test_calls  # the plan's sample of the test's calls (bench/plan.test_calls_plan)
        self.stopping = stopping
        self.out = Measurement(results=[CellResult(c) for c in cells],
                               transfer={"how": "cuda-ipc", "why": None},
                               timed_calls={"draw": timed.run_salt(), "checked": 0, "differ": 0, "seconds": 0.0})
        self.results = self.out.results
        self.workers: dict[str, WorkerClient] = {}
        self.pool: WorkerPool | None = None
        self.clocks: Clocks | None = None
        self.round = 0
        self.broken: str | None = None  # why the current pair must be replaced (a sticky CUDA error)
        self.t0 = time.monotonic() if t0 is None else t0  # the timeline counts from here (the caller's start)

    def mark(self, what: str) -> None:
        self.out.timeline.append([what, round(time.monotonic() - self.t0, 2)])

    # -- lifecycle --

    def order(self, rnd: int | None = None) -> tuple[str, str]:
        """Which side starts, and sets up, first in a round: base in even rounds, cand in odd."""
        return ("base", "cand") if (self.round if rnd is None else rnd) % 2 == 0 else ("cand", "base")

    def run(self) -> Measurement:
        try:
            self._run()
        except (KeyboardInterrupt, Cancelled):
            self.out.interrupted = True
            raise
        finally:
            self.out.wall_s = round(time.monotonic() - self.t0, 2)
            if self.out.env:
                self.out.env["forkserver"] = self.launcher.describe()  # as it stands after the run
        return self.out

    def _run(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with ExitStack() as stack:
            self.pool = WorkerPool(launcher=self.launcher, op=self.op, trees=self.trees, run_dir=self.run_dir,
                                   hello_timeout=self.cfg.worker_timeout, import_mode=self.cfg.import_mode)
            stack.callback(self.pool.close)
            if self.cancel is not None:
                stack.enter_context(self._killed_on_cancel())
            # Every pair the run is known to need, started now: the imports overlap. Importing
            # compiles nothing, so the measuring pairs stay processes that did nothing but import.
            self.pool.prestart("warmup", self.order(0))
            for rnd in range(max(1, self.cfg.rounds)):
                self.pool.prestart(f"round{rnd + 1}", self.order(rnd))
            if self.cfg.import_mode == "lean":
                # the real import of both trees, beside the run: its numeric settings must be the
                # lean processes' (checked after round 1, when it has long finished importing)
                self.pool.prestart("reference", self.order(0), import_mode="full")
            self.mark("workers started")
            planned, rnd = max(1, self.cfg.rounds), 0
            while rnd < planned:
                self.round = rnd
                todo = self._round_cells(rnd) if rnd else None
                if rnd and not todo:
                    break
                if rnd:
                    self.on_event("round", round=rnd + 1, rounds=planned, cells=len(todo))
                    self._take(f"round{rnd + 1}")
                    self.mark(f"round {rnd + 1}: workers ready")
                else:
                    self._take("warmup")
                    self.mark("warm-up: workers ready")
                    self._fingerprint(self.workers["base"].hello)
                    self._fresh_pair(self.warm())
                    todo = self._round_cells(0)
                for res in todo:
                    if self.blocked_run():
                        break
                    self.wait_exclusive(f"measuring {res.cell.id} (round {rnd + 1})")
                    sampling.measure_cell(self, res)
                    self.mark(f"round {rnd + 1}: {res.cell.id} measured")
                self.close_workers()
                if rnd == 0 and self.cfg.import_mode == "lean":
                    self._check_lean_import()
                rnd += 1
                if rnd == planned and planned < self.cfg.max_rounds and not self.blocked_run():
                    self.out.contested = [r.cell.id for r in self.results
                                          if r.status == "ok" and round_estimates(r, self.cfg.seed)[1]]
                    if self.out.contested:
                        planned = min(self.cfg.max_rounds, planned + 2)
            blocked = self.blocked_run()
            for res in self.results:
                if blocked and res.status in ("pending", "ok") and not res.kept:
                    rules = sorted({f.rule for f in self.out.run_findings if f.blocking})
                    res.status, res.reason = "blocked", f"guard: {', '.join(rules)} (run stopped)"
                elif res.status == "ok" and len(res.kept) < MIN_PAIRS_JUDGED:
                    res.status = "failed"
                    res.reason = sampling.too_few_pairs(res.pairs)
        self.mark("done")
        self.on_event("done")

    def warm(self) -> int:
        """The warm-up pair's work (every cell, then the unseen shapes); how many Triton cache
        entries the cells' warm-up added. A session of another kind of cell (modelcheck/session.py)
        does its own warm-up here and measures with the same rounds."""
        entries = cache_entries(self.triton_cache)
        warmup.warm_all(self)
        # what the cells compiled (the unseen shapes' compiles are not the cells')
        new_entries = cache_entries(self.triton_cache) - entries
        self.mark("warm-up done")
        if self.unseen is not None:
            warmup.check_unseen(self)
            replay.check_options(self)
            if not self.out.unseen.get("off"):
                self.mark("unseen shapes checked")
        if self.test_calls is not None:
            replay.check_test_calls(self)
            if not self.out.test_calls.get("off"):
                self.mark("test calls replayed")
        return new_entries

    def _fingerprint(self, hello: dict) -> None:
        self.clocks = Clocks(hello.get("device_uuid"))
        self.out.env = fingerprint(hello, self.clocks)
        self.out.env["forkserver"] = self.launcher.describe()
        if hello.get("device") != "cuda":
            self.out.transfer = {"how": "file", "why": "no GPU: CUDA IPC needs one"}
        self.out.env["idle"] = idle_evidence(self.clocks, own_pids=self.pool.pids())

    @contextmanager
    def _killed_on_cancel(self):
        """While the run lasts, a cancel kills every worker at once (a setup may take minutes)."""
        done = threading.Event()

        def watch():
            while not done.wait(0.2):
                if self.cancel.is_set():
                    if self.pool is not None:
                        self.pool.kill_all()
                    return

        t = threading.Thread(target=watch, name="flaloop-cancel-watch", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join(timeout=5)

    def check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("the run was withdrawn")

    def _take(self, label: str) -> None:
        self.workers, hellos = self.pool.take(label, self.order())
        self.out.hellos.append({side: hellos[side] for side in self.order()})
        for side, h in hellos.items():
            self._note_integrity(side, h)

    def close_workers(self) -> None:
        for w in self.workers.values():
            w.close()

    def _check_lean_import(self) -> None:
        """Hold the lean processes against a real import of the same trees: their numeric settings
        at import, and the kernels the first probed cell launches (a dispatch table that a skipped
        __init__ fills would change those without any setting). Runs between rounds: nothing is
        being timed while the reference processes use the GPU."""
        compared = None
        try:
            pair, hellos = self.pool.take("reference", self.order(0))
            try:
                measured = self.out.hellos[0] if self.out.hellos else self.out.warmup_hellos
                lean = {side: h.get("numeric_at_import") or {} for side, h in measured.items()}
                full = {side: h.get("numeric_at_import") or {} for side, h in hellos.items()}
                found = dynamic.lean_import(lean, full)
                res = next((r for r in self.results if r.status == "ok" and r.probes), None)
                if res is not None:
                    compared = res.cell.id
                    wire = res.cell.to_wire(self.cfg, res.k, "eager" if res.timer == "cuda_eager" else "auto")
                    for side, w in pair.items():
                        if not w.request("setup", self.cfg.worker_timeout, cell=wire).get("ok"):
                            raise WorkerFailed(side, f"could not set up {res.cell.id} with the real import", "")
                        real = w.request("probe", self.cfg.worker_timeout, cell=res.cell.id)
                        found += dynamic.lean_kernels(side, res.cell.id, (res.probes.get(side) or {}).get("census"),
                                                      ((real.get("probes") or {}).get("census")))
            finally:
                WorkerPool.close_pair(pair)
        except (MeasurementError, WorkerFailed) as exc:  # the real import is broken: nothing to vouch for lean
            found = [dynamic.finding("lean-import-differs", f"the real import failed: {exc.message}", side=None)]
            hellos = {}
        self.out.lean_check = {"reference_pids": {s: h.get("pid") for s, h in hellos.items()},
                               "kernels_compared_on": compared, "differs": [f.message for f in found]}
        self.add_run_findings(apply_allowances(found, self.allowed))
        self.mark("lean import checked against the real one")

    def restart(self, why: str) -> bool:
        """A fresh pair for this round after a crash, a hang or a broken CUDA context; False when
        the budget is spent."""
        self.broken = None
        self.close_workers()
        if self.out.restarts >= MAX_RESTARTS:
            self.out.errors.append(f"no fresh workers after {self.out.restarts} restarts: {why}")
            return False
        self.out.restarts += 1
        self._take(f"round{self.round + 1}-restart{self.out.restarts}")
        return True

    def _round_cells(self, rnd: int) -> list[CellResult]:
        """The cells a round measures: every warmed cell, and in extra rounds the contested ones."""
        if rnd == 0:
            return [r for r in self.results if r.status == "pending"]
        ok = [r for r in self.results if r.status == "ok"]
        if rnd < max(1, self.cfg.rounds):
            return ok
        return [r for r in ok if r.cell.id in self.out.contested]

    def _fresh_pair(self, new_entries: int) -> None:
        """Round 1 is measured by a fresh pair, like every later round: the warm-up pair is closed.

        Every measuring process then has the same history (it imported, then set up the cells it
        measures), so the start-order offset is the same in every round and cancels over rounds of
        swapped order. On the H200 (2026-11-30) round 1 measured in the warm-up pair scattered
        more than round 2 (mean |round estimate| 0.11-0.28% against 0.10-0.15% over six 12-cell
        A/As) and took two A/As to 0.28%; and a process that had compiled and autotuned
        B8_T2048_H32_D256 fwdbwd ran it 1.1% slower than one that loaded the same kernels and picks
        from the cache. When the warm-up compiled or tuned (`new_entries`), the first side of the
        fresh pair to set up a cell also calibrates k afresh.
        """
        self.out.warmup = {side: w.hello.get("pid") for side, w in self.workers.items()}
        self.out.warmup_hellos = self.out.hellos.pop()
        self.close_workers()
        if self.blocked_run() or not any(r.status == "pending" for r in self.results):
            self.pool.drop("round1")
            self.workers = {}
            return
        if new_entries > 0:
            self.on_event("prime", new_entries=new_entries)
            self.out.primed = {"new_cache_entries": new_entries, "discarded": dict(self.out.warmup)}
        self._take("round1")
        self.mark("round 1: workers ready")

    # -- talking to the pair --

    def ask(self, side: str, cmd: str, timeout: float, **payload) -> dict:
        return self.ask_both(cmd, timeout, {side: payload})[side]

    def ask_both(self, cmd: str, timeout: float, payloads: dict[str, dict]) -> dict[str, dict]:
        """The same command to each side named, all at once; every answer is awaited (so that no
        reply is left behind in a pipe) before the first failure is raised."""
        self.check_cancel()
        t0 = time.monotonic()
        replies, failed = {}, None
        sent = []
        for side, payload in payloads.items():
            try:
                self.workers[side].send(cmd, **payload)
                sent.append(side)
            except WorkerFailed as exc:
                failed = failed or exc
        for side in sent:
            try:
                replies[side] = self.workers[side].receive(cmd, timeout)
            except WorkerFailed as exc:
                failed = failed or exc
        self.out.waited[cmd] = self.out.waited.get(cmd, 0.0) + time.monotonic() - t0
        if failed is not None:
            self.check_cancel()  # killed because the run was withdrawn: not a crash
            failed.replies = replies  # what the other side answered meanwhile
            raise failed
        for side, reply in replies.items():
            self._note_integrity(side, reply)
        return replies

    def _note_integrity(self, side: str, reply: dict) -> None:
        """Violations of the timing-path watch ride on every reply; a candidate-only one blocks the run."""
        seen = self.out.integrity
        new = [v for v in reply.get("integrity") or [] if v not in seen[side]]
        if not new:
            return
        seen[side].extend(new)
        found = dynamic.integrity(seen["base"], seen["cand"], aa=self.cfg.aa)
        self.add_run_findings(apply_allowances(found, self.allowed))

    def add_run_findings(self, found: list[Finding]) -> None:
        known = {f.message for f in self.out.run_findings}
        self.out.run_findings += [f for f in found if f.message not in known]

    def blocked_run(self) -> bool:
        return any(f.blocking for f in self.out.run_findings)

    def clock(self) -> ClockReading | None:
        return self.clocks.read() if self.clocks else None

    def own_pids(self) -> set[int]:
        """Processes of ours that may hold the GPU: the workers (and their server), and this one."""
        return set(self.pool.pids() if self.pool is not None else []) | {os.getpid()}

    def occupancy(self) -> dict | None:
        """Who else is on the GPU now (evidence.occupancy); None without NVML."""
        return occupancy(self.clocks, self.own_pids()) if self.clocks else None

    def wait_exclusive(self, stage: str) -> None:
        """--exclusive: before `stage`, wait until no other process is on the GPU (a line every
        30 s says who is there), at most cfg.exclusive_wait seconds; then refuse (exit 3). Where
        the process list is blind, "another process" is the device busy while flaloop's workers
        launch nothing (evidence.busy_while_ours_idle, read once NVML's window has passed over
        our own last kernels); where NVML gives no utilization either, it is refused at once:
        exclusivity cannot be shown."""
        if not self.cfg.exclusive or not self.clocks or not self.clocks.available:
            return
        t0 = time.monotonic()
        said = -1e9
        while True:
            occ = self.occupancy()
            if occ is None:
                raise MeasurementError("--exclusive: " + BLIND, "run without --exclusive (pairs are then marked, not refused)")
            if occ["visible"]:
                who = ", ".join(f"pid {o['pid']}" + (f" ({o['name']})" if o.get("name") else "")
                                + (f" {o['used_mib']} MiB" if o.get("used_mib") else "") for o in occ["foreign"])
            else:
                who = self._unseen_activity()
            if not who:
                return
            waited = time.monotonic() - t0
            if waited >= self.cfg.exclusive_wait:
                raise MeasurementError(f"--exclusive: the GPU was not free for {waited:.0f}s before {stage}: {who}",
                                       "wait for it, or run without --exclusive (pairs are then marked contended)")
            if waited - said >= 30:
                self.on_event("exclusive-wait", stage=stage, who=who, waited=waited, limit=self.cfg.exclusive_wait)
                said = waited
            self.check_cancel()
            time.sleep(min(1.0, max(0.1, self.cfg.exclusive_wait - waited)))

    def _unseen_activity(self) -> str:
        """With a blind process list: what the device does while our workers launch nothing (''
        when it is quiet); refuses when NVML gives no utilization."""
        time.sleep(UTIL_WINDOW_S)  # NVML's window must not cover our own last kernels
        readings = sample_readings(self.clocks, 3, 0.1)
        if not readings or any(r.get("util_pct") is None for r in readings):
            raise MeasurementError("--exclusive: " + BLIND + ", and NVML gives no utilization either",
                                   "run without --exclusive (pairs are then marked, not refused)")
        return busy_while_ours_idle(readings) or ""

    # -- what the phases use (bench/port.SessionPort) --

    def setup(self, res: CellResult, side: str, k: int | None, timer: str, placements: int = 1,
              reference: bool = False, draw: str | None = None) -> dict:
        """Set the cell up on one side; with `reference` (a measuring pair, probes on) the worker
        keeps the results the self-check after the samples compares with (bench/sampling.py); with
        `draw`, its inputs are that round's values (bench/timed.draw), not the warm-up's."""
        cell = res.cell.to_wire(self.cfg, k, timer, placements)
        if reference:
            cell["reference"] = True
        if draw:
            cell["draw"] = draw
        return self.ask(side, "setup", self.cfg.worker_timeout, cell=cell)

    def cell_failed(self, res: CellResult, exc: WorkerFailed) -> None:
        self.out.errors.append(f"{res.cell.id}: {exc.message}\n{exc.stderr[-3000:]}")
        res.status, res.reason = "failed", f"{exc.side} worker: {exc.message}"
        res.setup[f"{exc.side}_stderr"] = exc.stderr[-3000:]

    def release(self, res: CellResult) -> None:
        """Free a cell's tensors and graphs on both sides (not on the way out of an interrupt:
        a busy worker would keep us waiting, and close() kills it anyway)."""
        live = {side: {"cell": res.cell.id} for side, w in self.workers.items() if not w.dead}
        if live:
            self.ask_both("release", 120, live)

    def fail(self, res: CellResult, side: str, reply: dict) -> None:
        error = str(reply.get("error", "unknown error"))
        # the backends whose verifiers declined calls in that process up to the error (FLA logs each
        # once a process, so not only this call's): an op that says "install X" where X is installed
        # (FLA's TileLang declines simple GLA's fp32 state) reads otherwise with it
        declined = dynamic.backend_keys(reply.get("backends"), "rejected")
        also = f" (the target's backends had declined: {', '.join(declined)})" if declined else ""
        if reply.get("backends"):
            res.setup[f"{side}_backends"] = reply["backends"]
        if error.startswith("skip:"):
            res.status, res.reason = "skipped", error[5:].strip()
        elif reply.get("refused") and side == "base":  # the op itself, before any candidate ran
            res.status, res.reason = "refused", (
                f"the op refuses this cell here: its own code raised {error} (at {reply.get('where')}) on the "
                f"base{also}, so there is nothing to compare; leave the cell out (--modes, --shapes) or give it what "
                "it needs")
            res.setup["base_traceback"] = reply.get("traceback", "")[-4000:]
        else:
            res.status, res.reason = "failed", f"{side}: {error}{also}"
            res.setup[f"{side}_traceback"] = reply.get("traceback", "")[-4000:]
            if sticky_cuda(error):
                self.broken = f"the {side} worker's CUDA context is broken ({error[:200]})"
                self.out.errors.append(f"{res.cell.id}: {self.broken}")


