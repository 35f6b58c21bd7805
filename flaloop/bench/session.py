"""The paired benchmark session: spawn a base and a candidate worker, interleave, stop, judge.

The session never times anything itself (workers do) and never imports torch. Order of work:

1. Workers: the candidate imports the op from the working tree, the base from a detached
   worktree of the base commit; each proves it by its op module's `__file__`.
2. Warm-up, for every cell on both sides before any timed sample: build inputs, compile,
   autotune, capture and prove the CUDA graph. The base's outputs and gradients must be finite
   (else the inputs are outside the op's domain and the cell is refused) and the candidate's
   must match the base's (else the cell is blocked).
3. Sampling, cell by cell: pairs in ABBA order, GPU clock read around each pair, pairs taken
   below the clock floor or while throttled dropped and counted; stop when the stopping rule
   says so. Then a few interleaved eager-latency samples per side.
4. Statistics (flaloop.stats) over the kept pairs; a run record with every raw sample.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import queue
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from flaloop import git, stats
from flaloop.errors import MeasurementError, UsageError
from flaloop.evidence import ClockReading, Clocks, fingerprint

WORKER = Path(__file__).parent / "worker" / "__main__.py"
MODES = ("fwd", "fwdbwd")


# -- cells --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    shape_name: str
    shape: dict
    mode: str
    dtype: str = "bfloat16"
    seqlens: tuple[int, ...] | None = None

    @property
    def id(self) -> str:
        return f"{self.shape_name}/{self.mode}"

    def to_wire(self, seed: int, overrides: dict, k: int | None, timer: str, min_sample_ms: float) -> dict:
        return {"id": self.id, "shape": self.shape, "mode": self.mode, "dtype": self.dtype, "seed": seed,
                "overrides": overrides, "seqlens": list(self.seqlens) if self.seqlens else None, "k": k,
                "timer": timer, "min_sample_ms": min_sample_ms}


def varlen_shape(name: str, shape: dict, seed: int = 0) -> tuple[str, dict, tuple[int, ...]]:
    """A packed variable-length variant of a dense shape: B*T tokens in 2*B sequences, B=1."""
    total, n = shape["B"] * shape["T"], max(2, 2 * shape["B"])
    rng = random.Random(f"{name}-{seed}")
    cuts = sorted(rng.sample(range(1, total), n - 1))
    lens = tuple(b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True))
    return f"{name}_varlen{n}", {**shape, "B": 1, "T": total}, lens


def make_cells(shape_configs: dict[str, dict], names: list[str], modes: list[str], dtype: str,
               varlen: bool) -> list[Cell]:
    unknown = [n for n in names if n not in shape_configs]
    if unknown:
        raise UsageError(f"unknown shape(s) {', '.join(unknown)}", f"known: {', '.join(shape_configs)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UsageError(f"unknown mode(s) {', '.join(bad)}", f"choose from {', '.join(MODES)}")
    cells = []
    for name in names:
        for mode in modes:
            cells.append(Cell(name, dict(shape_configs[name]), mode, dtype))
        if varlen:
            vname, vshape, lens = varlen_shape(name, shape_configs[name])
            cells.extend(Cell(vname, vshape, mode, dtype, lens) for mode in modes)
    return cells


# -- workers ------------------------------------------------------------------------------------

class WorkerFailed(MeasurementError):
    """The worker process died or stopped answering; `stderr` has its last words."""

    def __init__(self, side: str, what: str, stderr: str):
        super().__init__(f"the {side} worker {what}", f"its stderr ends with:\n{stderr[-3000:]}")
        self.side, self.stderr = side, stderr


class Worker:
    """One long-lived worker process speaking JSON lines over pipes."""

    def __init__(self, side: str, python: str, tree: Path, registry: Path, op: str, device: str,
                 log_path: Path, env: dict[str, str] | None = None):
        self.side, self.tree, self.log_path = side, tree, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        cmd = [python, "-u", str(WORKER), "--tree", str(tree), "--registry", str(registry), "--op", op,
               "--side", side, "--workdir", str(log_path.parent)]
        if device != "auto":
            cmd += ["--device", device]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, cwd=tree, env=env, start_new_session=True)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.dead = False
        self.hello: dict = {}

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._replies.put(line)
        self._replies.put(None)

    def stderr_tail(self) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def request(self, cmd: str, timeout: float, **payload) -> dict:
        if self.dead:
            raise WorkerFailed(self.side, "is gone", self.stderr_tail())
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **payload}) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            self._die()
            raise WorkerFailed(self.side, f"died before `{cmd}`", self.stderr_tail()) from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._die()
                raise WorkerFailed(self.side, f"hung: no answer to `{cmd}` within {timeout:.0f}s",
                                   self.stderr_tail()) from None
            if line is None:
                self._die()
                code = self.proc.wait()
                raise WorkerFailed(self.side, f"crashed during `{cmd}` (exit {code})", self.stderr_tail())
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue  # not ours: the protocol fd is private, but be forgiving

    def _die(self) -> None:
        self.dead = True
        _kill_group(self.proc)

    def close(self) -> None:
        if not self.dead and self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                self.proc.wait(timeout=3)  # an idle worker quits at once; a busy one is killed
            except (OSError, subprocess.TimeoutExpired):
                pass
        _kill_group(self.proc)
        self._log.close()


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=5)
            return
        except (ProcessLookupError, PermissionError):
            return
        except subprocess.TimeoutExpired:
            continue


# -- configuration and results ------------------------------------------------------------------

@dataclass
class BenchConfig:
    modes: list[str] = field(default_factory=lambda: list(MODES))
    dtype: str = "bfloat16"
    device: str = "auto"
    margin: float = 0.005
    half_width: float = 0.0025
    min_pairs: int = 16
    max_pairs: int = 400
    cell_seconds: float = 60.0
    # One sample = k calls replayed back to back. On the H200, k calibrated for ~1 ms samples
    # (k=1-2 at B8_T1024_H8_D64) gave A/A pairs scattering by 6-7%: samples must be long.
    min_sample_ms: float = 10.0
    diff_tol: float = 0.005
    n_eager: int = 6
    clock_floor: float = 0.75
    seed: int = 0
    setup_timeout: float = 1800.0
    sample_timeout: float = 300.0
    varlen: bool = False
    aa: bool = False
    overrides: dict[str, str] = field(default_factory=dict)
    # Triton's autotuner picks by timing, so two processes running the same kernel can pick
    # different configs: noise that would read as a win or a loss of the candidate. Shared, a
    # kernel whose source is unchanged is tuned once (by whichever side warms it first) and both
    # sides run that pick; a changed kernel has a different source hash and is tuned on its own
    # side. The picks are recorded either way (CellResult.tuning_differs).
    shared_tuning: bool = True
    # Each round starts fresh worker processes, the start and setup order swapped every round,
    # and takes its share of the pairs. On the H200 the side that started and set up first once
    # ran B8_T2048_H32_D256 ~0.5% slower; an even number of equal rounds cancels that in the
    # pooled estimate, and a verdict stands only if every round agrees with its direction (see
    # split_direction). (The larger offset, ~1.1%, came from the process that had compiled the
    # cell: see Session._prime.)
    rounds: int = 2
    # Cells whose rounds still disagree beyond their CIs after `rounds` get two more rounds at a
    # time (one of each order), in fresh processes that set up only those cells, up to this many
    # rounds in all: a per-process offset averages out over more processes.
    max_rounds: int = 4


def tuning_differences(base: dict, cand: dict) -> list[str]:
    """Kernels that both sides tuned for the same key but that chose different configs.

    `base` and `cand` are the workers' {kernel: {key: config}} choices made while warming a cell.
    """
    out = []
    for kernel in sorted(base.keys() & cand.keys()):
        for key in sorted(base[kernel].keys() & cand[kernel].keys()):
            b, c = base[kernel][key], cand[kernel][key]
            if b != c:
                out.append(f"{kernel} {key}: base [{b}] cand [{c}]")
    return out


@dataclass
class Pair:
    order: str  # "AB" (base first) or "BA"
    base_ms: float
    cand_ms: float
    clock_before: dict | None
    clock_after: dict | None
    dropped: str | None = None
    round: int = 0


@dataclass
class CellResult:
    cell: Cell
    status: str = "pending"  # ok | refused | blocked | failed | skipped
    reason: str = ""
    timer: str | None = None
    k: int | None = None
    setup: dict = field(default_factory=dict)
    diff: dict | None = None
    pairs: list[Pair] = field(default_factory=list)
    eager: dict = field(default_factory=dict)
    stop_reason: str = ""
    seconds: float = 0.0
    # filled by analyse()
    estimate: dict | None = None
    verdict: str | None = None
    summary: dict = field(default_factory=dict)
    launch_bound: bool | None = None
    tuning_differs: list[str] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)  # per-round estimates, when rounds > 1
    rounds_disagree: bool = False

    @property
    def kept(self) -> list[Pair]:
        return [p for p in self.pairs if p.dropped is None]

    def log_ratios(self) -> np.ndarray:
        return np.log(np.array([p.cand_ms for p in self.kept]) / np.array([p.base_ms for p in self.kept]))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cell"] = {**asdict(self.cell), "id": self.cell.id}
        d["dropped_pairs"] = sum(p.dropped is not None for p in self.pairs)
        return d


Events = Callable[..., None]


# -- the session --------------------------------------------------------------------------------

@contextmanager
def _trees(root: Path, base_commit: str, aa: bool) -> Iterator[tuple[Path, Path]]:
    with git.worktree(root, base_commit, "base") as base:
        yield base, (base if aa else root)


def _cache_entries(cache: Path) -> int:
    """How many kernel (and autotune) entries a Triton cache directory holds."""
    try:
        return sum(1 for _ in os.scandir(cache))
    except OSError:
        return 0


def _inside(path: str | None, tree: Path) -> bool:
    return bool(path) and os.path.realpath(path).startswith(os.path.realpath(tree) + os.sep)


class Session:
    def __init__(self, *, root: Path, python: str, op: str, registry_rel: str, base_commit: str,
                 cells: list[Cell], config: BenchConfig, run_dir: Path, on_event: Events | None = None):
        self.root, self.python, self.op = root, python, op
        self.registry_rel, self.base_commit = registry_rel, base_commit
        self.cells, self.cfg, self.run_dir = cells, config, run_dir
        self.on_event = on_event or (lambda *a, **k: None)
        self.results = [CellResult(c) for c in cells]
        self.workers: dict[str, Worker] = {}
        self.clocks: Clocks | None = None
        self.env_info: dict = {}
        self.errors: list[str] = []
        self.round = 0
        self.hellos: list[dict] = []  # per round: {side: hello}
        self.primed: dict | None = None  # the warm-up workers, when they were replaced (_prime)
        self.contested: list[str] = []  # cells given extra rounds

    # -- lifecycle --

    def run(self) -> None:
        with ExitStack() as stack:
            base_tree, cand_tree = stack.enter_context(_trees(self.root, self.base_commit, self.cfg.aa))
            registry = base_tree / self.registry_rel
            # The worker puts its tree first on sys.path and proves where the op came from, so
            # the user's PYTHONPATH (which may hold the target's dependencies) can stay.
            env = dict(os.environ)
            # Persistent under the workspace, shared by both sides: a second run recompiles nothing.
            env["TRITON_CACHE_DIR"] = env.get("FLALOOP_TRITON_CACHE_DIR") or str(self.run_dir.parents[1] / "triton-cache")
            # Autotuning results on disk, keyed by kernel source: see BenchConfig.shared_tuning.
            if self.cfg.shared_tuning:
                env["TRITON_CACHE_AUTOTUNING"] = "1"
            else:
                env.pop("TRITON_CACHE_AUTOTUNING", None)
            trees = {"base": base_tree, "cand": cand_tree}
            cache = Path(env["TRITON_CACHE_DIR"])
            planned = max(1, self.cfg.rounds)
            rnd = 0
            while rnd < planned:
                self.round = rnd
                if rnd:
                    todo = self._round_cells(rnd)
                    if not todo:
                        break
                    self.on_event("round", round=rnd + 1, rounds=planned, cells=len(todo))
                with ExitStack() as this_round:  # the round's workers end with it; the worktree stays
                    self._start_workers(this_round, trees, registry, env)
                    if rnd == 0:
                        hello = self.workers["base"].hello
                        self.clocks = Clocks(hello.get("device_uuid"))
                        self.env_info = fingerprint(hello, self.clocks)
                        entries = _cache_entries(cache)
                        self._warm_all()
                        self._prime(this_round, trees, registry, env, _cache_entries(cache) - entries)
                        todo = self._round_cells(0)
                    for res in todo:
                        if not self._measure(res):
                            break  # a worker died: the rest of this round has no one to ask
                rnd += 1
                if rnd == planned and planned < self.cfg.max_rounds:
                    self.contested = [r.cell.id for r in self.results
                                      if r.status == "ok" and round_estimates(r, self.cfg.seed)[1]]
                    if self.contested:
                        planned = min(self.cfg.max_rounds, planned + 2)
            for res in self.results:
                if res.status == "ok" and len(res.kept) < 6:
                    res.status = "failed"
                    res.reason = f"only {len(res.kept)} usable pairs ({len(res.pairs) - len(res.kept)} dropped)"
        self.on_event("done")

    def _round_cells(self, rnd: int) -> list[CellResult]:
        """The cells a round measures: every warmed cell, and in extra rounds the contested ones."""
        if rnd == 0:
            return [r for r in self.results if r.status == "pending"]
        ok = [r for r in self.results if r.status == "ok"]
        if rnd < max(1, self.cfg.rounds):
            return ok
        return [r for r in ok if r.cell.id in self.contested]

    def _prime(self, stack: ExitStack, trees: dict[str, Path], registry: Path, env: dict, new_entries: int) -> None:
        """Measure in processes that compiled and tuned nothing: when the warm-up added to the
        Triton cache, start both workers afresh (they load every kernel and shared autotune pick
        from disk) before the first pair. The first of them to set up a cell calibrates k afresh.

        On the H200 the process that had compiled and autotuned B8_T2048_H32_D256 fwdbwd ran it
        1.1% slower than a process that loaded the same kernels and picks from the cache
        (identical code, same configs), in two runs out of two.
        """
        if new_entries <= 0 or not any(r.status == "pending" for r in self.results):
            return
        self.on_event("prime", new_entries=new_entries)
        self.primed = {"new_cache_entries": new_entries,
                       "discarded": {side: w.hello.get("pid") for side, w in self.workers.items()}}
        for w in self.workers.values():
            w.close()
        self.hellos.pop()
        self._start_workers(stack, trees, registry, env)

    def _order(self) -> tuple[str, str]:
        """Which side starts, and sets up, first in this round: base in even rounds, cand in odd."""
        return ("base", "cand") if self.round % 2 == 0 else ("cand", "base")

    def _start_workers(self, stack: ExitStack, trees: dict[str, Path], registry: Path, env: dict) -> None:
        self.workers = {}
        for side in self._order():
            stderr = self.run_dir / (f"{side}.stderr" if self.round == 0 else f"{side}-round{self.round + 1}.stderr")
            w = Worker(side, self.python, trees[side], registry, self.op, self.cfg.device, stderr, env=env)
            stack.callback(w.close)
            self.workers[side] = w
        self.hellos.append({})
        for side in self._order():
            w = self.workers[side]
            w.hello = self._ask(side, "hello", self.cfg.setup_timeout)
            self.hellos[-1][side] = w.hello
            if not w.hello.get("ok"):
                raise MeasurementError(f"the {side} worker could not import {self.op}: {w.hello.get('error')}",
                                       w.hello.get("traceback", "")[-2000:])
            for key in ("op_module_file", "op_func_file"):
                if not _inside(w.hello.get(key), w.tree):
                    raise MeasurementError(
                        f"the {side} worker imported {self.op} from {w.hello.get(key)}, "
                        f"not from its tree {w.tree}",
                        "an installed copy shadows the tree; uninstall it or fix sys.path: "
                        "refusing to measure the wrong code")

    def _ask(self, side: str, cmd: str, timeout: float, **payload) -> dict:
        return self.workers[side].request(cmd, timeout, **payload)

    # -- phase 1: warm-up and correctness --

    def _setup(self, res: CellResult, side: str, k: int | None, timer: str) -> dict:
        wire = res.cell.to_wire(self.cfg.seed, self.cfg.overrides, k, timer, self.cfg.min_sample_ms)
        return self._ask(side, "setup", self.cfg.setup_timeout, cell=wire)

    def _warm_all(self) -> None:
        for i, res in enumerate(self.results):
            self.on_event("warm", cell=res.cell.id, index=i, total=len(self.results))
            try:
                self._warm(res)
                self._release(res)
            except WorkerFailed as exc:
                self._side_died(exc)
                return

    def _release(self, res: CellResult) -> None:
        """Free a cell's tensors and graphs on both sides (not on the way out of an interrupt:
        a busy worker would keep us waiting, and close() kills it anyway)."""
        for w in self.workers.values():
            if not w.dead:
                try:
                    w.request("release", 120, cell=res.cell.id)
                except WorkerFailed as exc:
                    self._side_died(exc)

    def _warm(self, res: CellResult) -> None:
        base = self._setup(res, "base", None, "auto")
        res.setup["base"] = base
        if not base.get("ok"):
            return self._fail(res, "base", base)
        nonfinite = {n: c for n, c in base.get("nonfinite", {}).items() if c}
        if nonfinite:
            res.status, res.reason = "refused", (
                "inputs outside the op's domain: the BASE gives non-finite values "
                + ", ".join(f"{n}: {c}" for n, c in nonfinite.items())
                + " (override an input transform in the contract, e.g. --input k=l2norm)")
            return None
        cand = self._setup(res, "cand", base["k"], "auto")
        res.setup["cand"] = cand
        if not cand.get("ok"):
            return self._fail(res, "cand", cand)
        res.tuning_differs = tuning_differences(base.get("tuning") or {}, cand.get("tuning") or {})
        if cand["timer"] != base["timer"]:  # both sides must be timed the same way
            why = cand.get("capture_error") or base.get("capture_error")
            base = self._setup(res, "base", base["k"], "eager")
            cand = self._setup(res, "cand", base["k"], "eager")
            res.setup.update(base=base, cand=cand, timer_note=f"one side could not be captured: {why}")
            if not (base.get("ok") and cand.get("ok")):
                return self._fail(res, "base" if not base.get("ok") else "cand", base if not base.get("ok") else cand)
        res.timer, res.k = base["timer"], base["k"]
        dump = self.run_dir / f"dump-{self.results.index(res)}.pt"
        d = self._ask("base", "dump", self.cfg.setup_timeout, cell=res.cell.id, path=str(dump))
        if not d.get("ok"):
            return self._fail(res, "base", d)
        cmp_ = self._ask("cand", "compare", self.cfg.setup_timeout, cell=res.cell.id, ref=str(dump),
                         tol=self.cfg.diff_tol)
        dump.unlink(missing_ok=True)
        if not cmp_.get("ok"):
            return self._fail(res, "cand", cmp_)
        res.diff = cmp_
        if not cmp_.get("match"):
            worst = sorted(cmp_.get("tensors", {}).items(), key=lambda kv: -(kv[1].get("rel_rms") or 0))[:3]
            res.status, res.reason = "blocked", (
                "candidate differs from base: " + ", ".join(
                    f"{n} rel-RMS {t.get('rel_rms')}, non-finite {t.get('nonfinite_self')}" for n, t in worst))
        return None

    def _fail(self, res: CellResult, side: str, reply: dict) -> None:
        error = str(reply.get("error", "unknown error"))
        if error.startswith("skip:"):
            res.status, res.reason = "skipped", error[5:].strip()
        else:
            res.status, res.reason = "failed", f"{side}: {error}"
            res.setup[f"{side}_traceback"] = reply.get("traceback", "")[-4000:]

    def _side_died(self, exc: WorkerFailed) -> None:
        self.errors.append(f"{exc.message}\n{exc.stderr[-3000:]}")
        for res in self.results:
            if res.status in ("pending", "ok") and not res.pairs:
                res.status, res.reason = "failed", f"{exc.side} worker died: {exc.message}"

    # -- phase 2: paired sampling --

    def _clock(self) -> ClockReading | None:
        return self.clocks.read() if self.clocks else None

    def _measure(self, res: CellResult) -> bool:
        """Sample one cell for this round; False when a worker died on the way."""
        t0 = time.monotonic()
        try:
            self._sample_cell(res, t0)
        except WorkerFailed as exc:
            self._side_died(exc)
            if res.status in ("pending", "ok"):
                res.status, res.reason = "failed", f"round {self.round + 1}: {exc.message}"
            return False
        else:
            self._release(res)
            return not any(w.dead for w in self.workers.values())
        finally:
            res.seconds += time.monotonic() - t0

    def _sample_cell(self, res: CellResult, t0: float) -> None:
        # Each round takes its share of the pairs and time; the first round's target half-width
        # is wider by sqrt(rounds), so that the pooled CI lands near the configured one. Later
        # rounds take as many pairs as the first kept, so that every process pair weighs the
        # same in the pooled estimate and a start-order offset cancels.
        n_rounds = max(1, self.cfg.rounds)
        min_r = max(2, math.ceil(self.cfg.min_pairs / n_rounds))
        min_r += min_r % 2  # whole ABBA blocks
        max_r = max(min_r, math.ceil(self.cfg.max_pairs / n_rounds))
        first = sum(p.round == 0 and p.dropped is None for p in res.pairs)
        if self.round and first >= 2:
            min_r = max_r = first
        rule = stats.CIHalfWidthStop(target=self.cfg.half_width * math.sqrt(n_rounds), min_pairs=min_r,
                                     max_pairs=max_r, max_seconds=self.cfg.cell_seconds / n_rounds)
        # After _prime the first side to set up calibrates k afresh: the warm-up process that
        # compiled may have timed the op slower than the processes that measure it.
        k = None if self.round == 0 and self.primed else res.k
        for side in self._order():
            r = self._setup(res, side, k, "eager" if res.timer == "cuda_eager" else "auto")
            if not r.get("ok"):
                return self._fail(res, side, r)
            if k is None:
                res.setup["k_warmup"], res.k = res.k, r["k"]
                k = res.k
        mine: list[Pair] = []
        while True:
            order = "AB" if len(mine) % 2 == 0 else "BA"
            before = self._clock()
            t = {}
            for side in (("base", "cand") if order == "AB" else ("cand", "base")):
                r = self._ask(side, "sample", self.cfg.sample_timeout, cell=res.cell.id, n=1)
                times = r.get("times_ms") or [None]
                if not r.get("ok") or times[0] is None or not times[0] > 0:
                    return self._fail(res, side, r if not r.get("ok") else {"error": f"unusable time {times[0]!r} ms"})
                t[side] = times[0]
            after = self._clock()
            pair = Pair(order, t["base"], t["cand"], before and before.to_dict(),
                        after and after.to_dict(), self._drop_reason(before, after), round=self.round)
            res.pairs.append(pair)
            mine.append(pair)
            r_kept = np.log(np.array([p.cand_ms / p.base_ms for p in mine if p.dropped is None]))
            self.on_event("pair", cell=res.cell.id, n=len(mine), kept=len(r_kept))
            if rule.enough(r_kept, time.monotonic() - t0) or len(mine) >= 3 * max_r:
                why = (f"{len(r_kept)} pairs, as many as round 1" if self.round and first >= 2
                       and rule.reason.startswith("pair cap") else rule.reason)
                res.stop_reason = (res.stop_reason + "; " if res.stop_reason else "") + (
                    f"round {self.round + 1}: {why}" if n_rounds > 1 else why)
                break
        for i in range(max(2, self.cfg.n_eager // n_rounds)):
            for side in (("base", "cand") if i % 2 == 0 else ("cand", "base")):
                r = self._ask(side, "eager", self.cfg.sample_timeout, cell=res.cell.id, n=1)
                if r.get("ok"):
                    e = res.eager.setdefault(side, {"host_ms": [], "wall_ms": []})
                    e["host_ms"] += r["host_ms"]
                    e["wall_ms"] += r["wall_ms"]
        kept = sum(p.dropped is None for p in mine)
        if kept < 2:
            res.status = "failed"
            res.reason = f"round {self.round + 1}: only {kept} usable pairs ({len(mine) - kept} dropped)"
        else:
            res.status = "ok"  # for now: the pooled count is judged after the last round

    def _drop_reason(self, before: ClockReading | None, after: ClockReading | None) -> str | None:
        for r in (before, after):
            if r is None:
                continue
            if r.throttled:
                return f"throttled (reasons 0x{r.throttle_reasons:x})"
            if r.fraction_of_max < self.cfg.clock_floor:
                return f"SM clock {r.sm_mhz} MHz < {self.cfg.clock_floor:.0%} of {r.sm_max_mhz}"
        return None


# -- analysis (pure: from results, never re-measures) -------------------------------------------

def analyse(results: list[CellResult], margin: float, seed: int = 0) -> dict:
    measured = [r for r in results if r.status == "ok"]
    ratios = [r.log_ratios() for r in measured]
    verdicts = stats.holm_verdicts(ratios, margin=margin, seed=seed) if measured else []
    for i, r in enumerate(measured):
        r.rounds, r.rounds_disagree = round_estimates(r, seed)
        if not split_direction(r.rounds, verdicts[i], margin):
            continue
        verdicts[i] = stats.Verdict.UNSURE
        r.reason = (r.reason + "; " if r.reason else "") + (
            "rounds disagree on the direction (" + ", ".join(f"{x['speedup']:.4f}x" for x in r.rounds)
            + "): not a verdict")
    for r, lr, v in zip(measured, ratios, verdicts, strict=True):
        r.estimate = stats.estimate_speedup(lr, seed=seed).to_dict()
        r.verdict = v.value
        r.summary = {side: stats.summarize([getattr(p, f"{side}_ms") for p in r.kept]).to_dict()
                     for side in ("base", "cand")}
        host = r.eager.get("base", {}).get("host_ms")
        if host:
            r.summary["eager"] = {s: stats.summarize(e["wall_ms"]).to_dict() for s, e in r.eager.items()}
            r.summary["host"] = {s: stats.summarize(e["host_ms"]).to_dict() for s, e in r.eager.items()}
            r.launch_bound = float(np.median(host)) > r.summary["base"]["median"]
    for r in results:
        if r.status != "ok":
            r.verdict = r.status.upper()
    geo = stats.geomean(ratios, verdicts=verdicts, seed=seed).to_dict() if measured else None
    if geo is not None and geo.get("worst_cell") is not None:
        geo["worst_cell_id"] = measured[geo["worst_cell"]].cell.id
    return {"geomean": geo, "n_cells": len(results), "n_measured": len(measured),
            "n_blocked": sum(r.status == "blocked" for r in results),
            "n_refused": sum(r.status == "refused" for r in results),
            "n_failed": sum(r.status == "failed" for r in results)}


def round_estimates(res: CellResult, seed: int = 0) -> tuple[list[dict], bool]:
    """Each round's own speedup estimate and CI, and whether two rounds' CIs fail to overlap.

    Rounds run in fresh processes with the start order swapped, so a speedup that belongs to the
    code shows in every round, while one that belongs to a process (where its buffers landed,
    which process started first) moves between rounds.
    """
    by_round: dict[int, list[float]] = {}
    for p in res.kept:
        by_round.setdefault(p.round, []).append(math.log(p.cand_ms / p.base_ms))
    if len(by_round) < 2:
        return [], False
    out = []
    for rnd in sorted(by_round):
        lr = by_round[rnd]
        if len(lr) < 2:
            continue
        est = stats.estimate_speedup(lr, seed=seed)
        out.append({"round": rnd + 1, "n_pairs": len(lr), "speedup": est.speedup,
                    "ci_low": est.ci_low, "ci_high": est.ci_high})
    disagree = any(a["ci_high"] < b["ci_low"] or b["ci_high"] < a["ci_low"]
                   for i, a in enumerate(out) for b in out[i + 1:])
    return out, disagree


def split_direction(rounds: list[dict], verdict: stats.Verdict, margin: float) -> bool:
    """True when a FASTER or SLOWER verdict is not borne out by every round's own estimate.

    On the H200 the process that started and set up first ran a cell ~0.55% slower (A/A of
    chunk_delta_rule B8_T2048_H32_D256 fwd, four rounds: -0.58, +0.56, -0.66, +0.46%). Swapping
    the order each round cancels that in the pooled estimate, so rounds that merely differ do
    not veto a verdict (a planted 3-6% slowdown stays SLOWER); a round whose own estimate does
    not clear the margin in the verdict's direction does.
    """
    if verdict not in (stats.Verdict.FASTER, stats.Verdict.SLOWER) or not rounds:
        return False
    m = math.log1p(margin)
    if verdict is stats.Verdict.FASTER:
        return not all(math.log(r["speedup"]) > m for r in rounds)
    return not all(math.log(r["speedup"]) < -m for r in rounds)


def write_record(run_dir: Path, record: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "record.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    return path


def now_stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def bench(target, contract, *, base_ref: str | None, shapes: list[str] | None, cfg: BenchConfig,
          on_event: Events | None = None, gate: dict | None = None, command: str = "") -> dict:
    """Run one paired session for the contract's op and keep its run record."""
    spec = target.op(contract.op)
    if not target.registry_file.is_file():
        raise UsageError(f"{contract.op} has no registry entry to build bench inputs from",
                         f"the bench reads TensorSpecs from {target.registry_file.relative_to(target.root)}")
    base_commit = git.resolve_ref(target.root, base_ref) if base_ref else contract.base_commit
    if git.file_at(target.root, base_commit, str(target.registry_file.relative_to(target.root))) is None:
        raise UsageError(f"the base {base_commit[:12]} has no {target.registry_file.relative_to(target.root)}",
                         "choose a base that has the registry (--base)")
    cells = make_cells(target.shape_configs(spec), shapes or contract.shapes, cfg.modes, cfg.dtype, cfg.varlen)
    if not cells:
        raise UsageError("no bench cells: no shapes selected", "pass --shapes or set shapes in the contract")
    cfg.overrides = {**contract.input_overrides, **cfg.overrides}
    stamp = now_stamp()
    run_dir = target.workspace(contract.op) / "runs" / f"{stamp}-{'aa' if cfg.aa else 'bench'}"
    session = Session(root=target.root, python=target.python, op=contract.op,
                      registry_rel=str(target.registry_file.relative_to(target.root)), base_commit=base_commit,
                      cells=cells, config=cfg, run_dir=run_dir, on_event=on_event)
    tree = git.tree_state(target.root)
    t0 = time.monotonic()
    interrupted = False
    pending: KeyboardInterrupt | None = None
    try:
        session.run()
    except KeyboardInterrupt as exc:
        interrupted, pending = True, exc
        raise
    finally:
        summary = analyse(session.results, cfg.margin, cfg.seed)
        record = {
            "kind": "bench", "schema": 1, "op": contract.op, "created": stamp, "command": command,
            "aa": cfg.aa, "base": {"ref": base_ref or contract.base_ref, "commit": base_commit},
            "candidate": {"tree": "base worktree (A/A)" if cfg.aa else str(target.root), **tree},
            "config": asdict(cfg), "env": session.env_info,
            "workers": session.hellos[0] if session.hellos else {},
            "rounds": [{s: h.get("pid") for s, h in hs.items()} for hs in session.hellos],
            "primed": session.primed, "contested": session.contested,
            "gate": gate, "unverified": gate is None, "interrupted": interrupted,
            "errors": session.errors, "wall_s": round(time.monotonic() - t0, 2),
            "summary": summary, "cells": [r.to_dict() for r in session.results],
        }
        if session.workers or interrupted:
            record["path"] = str(write_record(run_dir, record))
        if pending is not None:  # so that `--json` can still name the record of a cut-short run
            pending.record_path = record.get("path")
    return record
