"""The paired benchmark session: base and candidate workers, interleaved, stopped, judged.

The session never times anything itself (workers do) and never imports torch. Order of work:

1. Processes: every pair the run will need is started at once (bench/pool.py): the warm-up pair
   and one pair per later round, forked from a server that imported the target's libraries once
   where it can. The candidate imports the op from the working tree, the base from a detached
   worktree of the base commit; each proves it by its op module's `__file__`.
2. Warm-up (bench/warmup.py), for every cell on both sides before any timed sample: set up,
   compile, autotune, check the candidate's results against the base's, the guard's probes.
3. The warm-up pair is closed: it measures nothing (`_fresh_pair`).
4. Rounds (bench/sampling.py): pairs in each round's own fresh processes (round 1's too), each
   round the mirror of the one before (start order, and which side samples first: ABBA, BAAB). A cell stops when the stopping rule says so,
   or once settled beyond the margin; it still takes every planned round (as many pairs as
   round 1 kept): a per-process effect would show in round 1 alone as confidently as a real
   speedup.
5. Analysis (bench/analysis.py) and the run record (bench/record.py).

A worker that crashes or hangs fails the cell it was on; a fresh pair takes over the rest.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

from flaloop import git
from flaloop.bench import forkservers
from flaloop.bench.analysis import round_estimates
from flaloop.bench.model import BenchConfig, Cell, CellResult
from flaloop.bench.pool import WorkerPool
from flaloop.bench.sampling import Sampling
from flaloop.bench.warmup import WarmUp
from flaloop.bench.workers import WorkerClient, WorkerFailed
from flaloop.errors import MeasurementError
from flaloop.evidence import Clocks, fingerprint, idle_evidence
from flaloop.guard import dynamic
from flaloop.guard.findings import apply_allowances

Events = Callable[..., None]
MAX_RESTARTS = 4  # fresh pairs after crashes or hangs, per run
# CUDA errors after which the process's context is unusable: the worker answers, but every later
# call would fail too, so the pair is replaced before the next cell.
STICKY_CUDA = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address",
               "illegal instruction", "an illegal address", "CUDA error: unknown error", "uncorrectable ECC")


class Cancelled(Exception):
    """The caller withdrew the run (verify: the gate running beside the bench went red)."""


def _cache_entries(cache: Path) -> int:
    """How many kernel (and autotune) entries a Triton cache directory holds."""
    try:
        return sum(1 for _ in os.scandir(cache))
    except OSError:
        return 0


class Session(WarmUp, Sampling):
    def __init__(self, *, root: Path, python: str, op: str, registry_rel: str, base_commit: str,
                 cells: list[Cell], config: BenchConfig, run_dir: Path, on_event: Events | None = None,
                 allowed: list[dict] | None = None, gpu: str | None = None,
                 cancel: threading.Event | None = None):
        self.root, self.python, self.op = root, python, op
        self.registry_rel, self.base_commit = registry_rel, base_commit
        self.cells, self.cfg, self.run_dir = cells, config, run_dir
        self.on_event = on_event or (lambda *a, **k: None)
        self.allowed = allowed or []
        self.gpu = gpu
        self.results = [CellResult(c) for c in cells]
        self.workers: dict[str, WorkerClient] = {}
        self.pool: WorkerPool | None = None
        self.clocks: Clocks | None = None
        self.env_info: dict = {}
        self.errors: list[str] = []
        self.round = 0
        self.hellos: list[dict] = []  # per round: {side: hello}
        self.warmup: dict = {}  # {side: pid} of the pair that warmed the cells up (it measures nothing)
        self.warmup_hellos: dict = {}
        self.primed: dict | None = None  # when the warm-up compiled or tuned: k is calibrated afresh
        self.contested: list[str] = []  # cells given extra rounds
        self.integrity: dict[str, list[str]] = {"base": [], "cand": []}
        self.run_findings: list[dict] = []  # guard findings about the whole run (timer patches)
        self.restarts = 0
        self.broken: str | None = None  # why the current pair must be replaced (a sticky CUDA error)
        self.probe_seconds = 0.0
        self.cancel = cancel
        self.lean_check: dict | None = None  # --import lean: the real import's verdict on it
        self.t0 = time.monotonic()
        self.timeline: list[list] = []  # [what, seconds since the session began]: where a run's time went
        self.waited: dict[str, float] = {}  # seconds the session waited on each command (both sides at once: once)
        # how the base's results reach the candidate: CUDA IPC handles, or a file where they cannot
        # (no GPU, an allocator without IPC, handles the candidate cannot map): bench/warmup.py
        self.transfer = {"how": "cuda-ipc", "why": None}

    def _mark(self, what: str) -> None:
        self.timeline.append([what, round(time.monotonic() - self.t0, 2)])

    # -- lifecycle --

    def _order(self, rnd: int | None = None) -> tuple[str, str]:
        """Which side starts, and sets up, first in a round: base in even rounds, cand in odd."""
        return ("base", "cand") if (self.round if rnd is None else rnd) % 2 == 0 else ("cand", "base")

    def run(self) -> None:
        self.t0 = time.monotonic()
        with ExitStack() as stack:
            base_tree = stack.enter_context(git.worktree(self.root, self.base_commit, "base"))
            self._mark("base worktree")
            trees = {"base": base_tree, "cand": base_tree if self.cfg.aa else self.root}
            ws = self.run_dir.parents[1]
            env = dict(os.environ)
            # Persistent under the workspace, shared by both sides: a second run recompiles nothing.
            env["TRITON_CACHE_DIR"] = env.get("FLALOOP_TRITON_CACHE_DIR") or str(ws / "triton-cache")
            # Autotuning results on disk, keyed by kernel source: see BenchConfig.shared_tuning.
            if self.cfg.shared_tuning:
                env["TRITON_CACHE_AUTOTUNING"] = "1"
            else:
                env.pop("TRITON_CACHE_AUTOTUNING", None)
            cache = Path(env["TRITON_CACHE_DIR"])
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.cancel is not None:
                stack.enter_context(self._killed_on_cancel())
            self.pool = stack.enter_context(WorkerPool(
                python=self.python, op=self.op, device=self.cfg.device, trees=trees,
                registry=base_tree / self.registry_rel, run_dir=self.run_dir, env=env,
                setup_timeout=self.cfg.setup_timeout, use_forkserver=self.cfg.forkserver,
                preload_file=forkservers.preload_file(self.python, self.op, self.cfg.import_mode), gpu=self.gpu,
                import_mode=self.cfg.import_mode))
            # Every pair the run is known to need, started now: the imports overlap. Importing
            # compiles nothing, so the measuring pairs stay processes that did nothing but import.
            self.pool.prestart("warmup", self._order(0))
            for rnd in range(max(1, self.cfg.rounds)):
                self.pool.prestart(f"round{rnd + 1}", self._order(rnd))
            if self.cfg.import_mode == "lean":
                # the real import of both trees, beside the run: its numeric settings must be the
                # lean processes' (checked after round 1, when it has long finished importing)
                self.pool.prestart("reference", self._order(0), import_mode="full")
            self._mark("workers started")
            planned, rnd = max(1, self.cfg.rounds), 0
            while rnd < planned:
                self.round = rnd
                todo = self._round_cells(rnd) if rnd else None
                if rnd and not todo:
                    break
                if rnd:
                    self.on_event("round", round=rnd + 1, rounds=planned, cells=len(todo))
                    self._take(f"round{rnd + 1}")
                    self._mark(f"round {rnd + 1}: workers ready")
                else:
                    self._take("warmup")
                    self._mark("warm-up: workers ready")
                    hello = self.workers["base"].hello
                    self.clocks = Clocks(hello.get("device_uuid"))
                    self.env_info = fingerprint(hello, self.clocks)
                    self.env_info["forkserver"] = self.pool.forkserver
                    if hello.get("device") != "cuda":
                        self.transfer = {"how": "file", "why": "no GPU: CUDA IPC needs one"}
                    self.env_info["idle"] = idle_evidence(self.clocks, own_pids=self.pool.pids())
                    entries = _cache_entries(cache)
                    self._warm_all()
                    self._mark("warm-up done")
                    self._fresh_pair(_cache_entries(cache) - entries)
                    todo = self._round_cells(0)
                for res in todo:
                    if self._blocked_run():
                        break
                    self._measure(res)
                    self._mark(f"round {rnd + 1}: {res.cell.id} measured")
                self._close_workers()
                if rnd == 0 and self.cfg.import_mode == "lean":
                    self._check_lean_import()
                rnd += 1
                if rnd == planned and planned < self.cfg.max_rounds and not self._blocked_run():
                    self.contested = [r.cell.id for r in self.results
                                      if r.status == "ok" and round_estimates(r, self.cfg.seed)[1]]
                    if self.contested:
                        planned = min(self.cfg.max_rounds, planned + 2)
            blocked = self._blocked_run()
            for res in self.results:
                if blocked and res.status in ("pending", "ok") and not res.kept:
                    rules = sorted({f["rule"] for f in self.run_findings if f.get("blocking")})
                    res.status, res.reason = "blocked", f"guard: {', '.join(rules)} (run stopped)"
                elif res.status == "ok" and len(res.kept) < 6:
                    res.status = "failed"
                    res.reason = f"only {len(res.kept)} usable pairs ({len(res.pairs) - len(res.kept)} dropped)"
        if self.pool is not None and self.env_info:
            self.env_info["forkserver"] = self.pool.forkserver  # as it stands after the pool closed
        self._mark("done")
        self.on_event("done")

    @contextmanager
    def _killed_on_cancel(self):
        """While the run lasts, a cancel kills every worker at once (a setup may take minutes)."""
        done = threading.Event()

        def watch():
            while not done.wait(0.2):
                if self.cancel.is_set():
                    if self.pool is not None:
                        for w in list(self.pool.started):
                            w.proc.kill()
                    return

        t = threading.Thread(target=watch, name="flaloop-cancel-watch", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join(timeout=5)

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("the run was withdrawn")

    def _take(self, label: str) -> None:
        self.workers, hellos = self.pool.take(label, self._order())
        self.hellos.append({side: hellos[side] for side in self._order()})
        for side, h in hellos.items():
            self._note_integrity(side, h)

    def _close_workers(self) -> None:
        for w in self.workers.values():
            w.close()

    def _check_lean_import(self) -> None:
        """Hold the lean processes against a real import of the same trees: their numeric settings
        at import, and the kernels the first probed cell launches (a dispatch table that a skipped
        __init__ fills would change those without any setting). Runs between rounds: nothing is
        being timed while the reference processes use the GPU."""
        compared = None
        try:
            pair, hellos = self.pool.take("reference", self._order(0))
            try:
                measured = self.hellos[0] if self.hellos else self.warmup_hellos  # none measured: the warm-up's
                lean = {side: h.get("numeric_at_import") or {} for side, h in measured.items()}
                full = {side: h.get("numeric_at_import") or {} for side, h in hellos.items()}
                found = dynamic.lean_import(lean, full)
                res = next((r for r in self.results if r.status == "ok" and r.probes), None)
                if res is not None:
                    compared = res.cell.id
                    wire = res.cell.to_wire(self.cfg.seed, self.cfg.overrides, res.k,
                                            "eager" if res.timer == "cuda_eager" else "auto", self.cfg.min_sample_ms)
                    for side, w in pair.items():
                        if not w.request("setup", self.cfg.setup_timeout, cell=wire).get("ok"):
                            raise WorkerFailed(side, f"could not set up {res.cell.id} with the real import", "")
                        real = w.request("probe", self.cfg.setup_timeout, cell=res.cell.id)
                        found += dynamic.lean_kernels(side, res.cell.id, (res.probes.get(side) or {}).get("census"),
                                                           ((real.get("probes") or {}).get("census")))
            finally:
                WorkerPool.close_pair(pair)
        except (MeasurementError, WorkerFailed) as exc:  # the real import is broken: nothing to vouch for lean
            found = [dynamic.finding("lean-import-differs", f"the real import failed: {exc.message}", side=None)]
            hellos = {}
        self.lean_check = {"reference_pids": {s: h.get("pid") for s, h in hellos.items()},
                           "kernels_compared_on": compared, "differs": [f.message for f in found]}
        known = {f["message"] for f in self.run_findings}
        for f in apply_allowances(found, self.allowed):
            if f.message not in known:
                self.run_findings.append(f.to_dict())
        self._mark("lean import checked against the real one")

    def _restart(self, why: str) -> bool:
        """A fresh pair for this round after a crash, a hang or a broken CUDA context; False when
        the budget is spent."""
        self.broken = None
        self._close_workers()
        if self.restarts >= MAX_RESTARTS:
            self.errors.append(f"no fresh workers after {self.restarts} restarts: {why}")
            return False
        self.restarts += 1
        self._take(f"round{self.round + 1}-restart{self.restarts}")
        return True

    def _round_cells(self, rnd: int) -> list[CellResult]:
        """The cells a round measures: every warmed cell, and in extra rounds the contested ones."""
        if rnd == 0:
            return [r for r in self.results if r.status == "pending"]
        ok = [r for r in self.results if r.status == "ok"]
        if rnd < max(1, self.cfg.rounds):
            return ok
        return [r for r in ok if r.cell.id in self.contested]

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
        self.warmup = {side: w.hello.get("pid") for side, w in self.workers.items()}
        self.warmup_hellos = self.hellos.pop()
        self._close_workers()
        if self._blocked_run() or not any(r.status == "pending" for r in self.results):
            self.pool.drop("round1")
            self.workers = {}
            return
        if new_entries > 0:
            self.on_event("prime", new_entries=new_entries)
            self.primed = {"new_cache_entries": new_entries, "discarded": dict(self.warmup)}
        self._take("round1")
        self._mark("round 1: workers ready")

    def _ask(self, side: str, cmd: str, timeout: float, **payload) -> dict:
        return self._ask_both(cmd, timeout, {side: payload})[side]

    def _ask_both(self, cmd: str, timeout: float, payloads: dict[str, dict]) -> dict[str, dict]:
        """The same command to each side named, all at once; every answer is awaited (so that no
        reply is left behind in a pipe) before the first failure is raised."""
        self._check_cancel()
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
        self.waited[cmd] = self.waited.get(cmd, 0.0) + time.monotonic() - t0
        if failed is not None:
            self._check_cancel()  # killed because the run was withdrawn: not a crash
            raise failed
        for side, reply in replies.items():
            self._note_integrity(side, reply)
        return replies

    def _note_integrity(self, side: str, reply: dict) -> None:
        """Violations of the timing-path watch ride on every reply; a candidate-only one blocks the run."""
        new = [v for v in reply.get("integrity") or [] if v not in self.integrity[side]]
        if not new:
            return
        self.integrity[side].extend(new)
        found = dynamic.integrity(self.integrity["base"], self.integrity["cand"], aa=self.cfg.aa)
        known = {f["message"] for f in self.run_findings}
        for f in apply_allowances(found, self.allowed):
            if f.message not in known:
                self.run_findings.append(f.to_dict())

    def _blocked_run(self) -> bool:
        return any(f.get("blocking") for f in self.run_findings)

    # -- helpers of both phases (the warm-up: bench/warmup.py; the sampling: bench/sampling.py) --

    def _setup(self, res: CellResult, side: str, k: int | None, timer: str, placements: int = 1) -> dict:
        wire = res.cell.to_wire(self.cfg.seed, self.cfg.overrides, k, timer, self.cfg.min_sample_ms, placements)
        return self._ask(side, "setup", self.cfg.setup_timeout, cell=wire)

    def _cell_failed(self, res: CellResult, exc: WorkerFailed) -> None:
        self.errors.append(f"{res.cell.id}: {exc.message}\n{exc.stderr[-3000:]}")
        res.status, res.reason = "failed", f"{exc.side} worker: {exc.message}"
        res.setup[f"{exc.side}_stderr"] = exc.stderr[-3000:]

    def _release(self, res: CellResult) -> None:
        """Free a cell's tensors and graphs on both sides (not on the way out of an interrupt:
        a busy worker would keep us waiting, and close() kills it anyway)."""
        live = {side: {"cell": res.cell.id} for side, w in self.workers.items() if not w.dead}
        if live:
            self._ask_both("release", 120, live)

    def _fail(self, res: CellResult, side: str, reply: dict) -> None:
        error = str(reply.get("error", "unknown error"))
        if error.startswith("skip:"):
            res.status, res.reason = "skipped", error[5:].strip()
        else:
            res.status, res.reason = "failed", f"{side}: {error}"
            res.setup[f"{side}_traceback"] = reply.get("traceback", "")[-4000:]
            if any(s in error for s in STICKY_CUDA):
                self.broken = f"the {side} worker's CUDA context is broken ({error[:200]})"
                self.errors.append(f"{res.cell.id}: {self.broken}")


__all__ = ["BenchConfig", "MeasurementError", "Session"]
