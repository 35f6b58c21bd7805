"""The bench's data model: what to measure (`BenchConfig`, `Cell`) and what was measured (`Pair`,
`CellResult` and its parts). Plain dataclasses; each reads back from its JSON with `from_dict`.

`BenchConfig` is the one place a bench option is declared: its default, its help text and how the
command line spells it (`opt`). The CLI's options are generated from these fields (cli/app.config_options)
and the worker receives the same names, so an option has one name and one default everywhere.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import numpy as np

from flaloop.core.errors import UsageError
from flaloop.guard.findings import Finding
from flaloop.stats import SpeedupEstimate, Summary

MODES = ("fwd", "fwdbwd")
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DEVICES = ("auto", "cuda", "cpu")
# What the L2 holds when a timed call starts (the worker's BuiltCell.sample; README, "Cold and hot
# L2"). rotate: calls rotate over input sets that together exceed twice the L2 (the default, and
# the only state before --l2 existed). hot: every call on the same inputs, none flushed, so they come
# from the L2 when they fit. cold: the L2 flushed before every call, the flush outside the time.
# both: a hot cell and a cold cell for each shape and mode.
L2_STATES = ("rotate", "hot", "cold")
L2_MODES = (*L2_STATES, "both")
L2_WORDS = {"rotate": "rotate (input sets rotated, together over twice the L2)",
            "hot": "hot (the same inputs every call, never flushed)",
            "cold": "cold (flushed before every call, the flush not timed)",
            "both": "both (a hot and a cold cell per shape and mode)"}
L2_HELP = f"What the L2 holds as each timed call starts: {', '.join(L2_WORDS[m] for m in L2_MODES[:-1])} or {L2_WORDS['both']}."
IMPORT_MODES = ("full", "lean")
MAX_UNSEEN = 64  # unseen shapes (each costs a setup and two calls a side and mode)
# the kept pairs a cell needs, pooled over its rounds, for an estimate and a verdict (fewer: failed)
MIN_PAIRS_JUDGED = 6
# what flaloop sets for both sides' workers, which --cand-env may not change
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "PYTHONPATH",
                          "TRITON_INTERPRET"})


def opt(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, cli: bool = True,  # noqa: A002
        flags: tuple[str, ...] = (), unit: str = "", choices: tuple[str, ...] = (),
        from_contract: bool = False, kind: str = "") -> Any:
    """A BenchConfig field with what the CLI needs to offer it.

    `flags`: the spellings on the command line (default: the field's name, dashed); `unit`
    "percent": typed in percent, kept as a fraction; `from_contract`: the option's default is the
    contract's value (shapes' modes, varlen); `kind` "csv" (a comma list) or "assign" (repeated
    NAME=VALUE); `cli` False: set by flaloop itself, not an option."""
    meta = {"help": help, "cli": cli, "flags": flags, "unit": unit, "choices": choices,
            "from_contract": from_contract, "kind": kind}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class BenchConfig:
    modes: list[str] = opt(factory=lambda: list(MODES), help="fwd,fwdbwd (default: the contract's).",
                           from_contract=True, kind="csv", choices=MODES)
    varlen: bool = opt(False, "Add packed cu_seqlens cells (default: the contract's).", from_contract=True)
    l2: str = opt("rotate", L2_HELP + " Default: the contract's (`init --l2`).", from_contract=True, choices=L2_MODES)
    dtype: str = opt("bfloat16", "Input dtype (bf16, fp16 and fp32 say the same).", choices=DTYPES)
    device: str = opt("auto", "Where the workers run.", choices=DEVICES)
    margin: float = opt(0.005, "SAME margin, percent.", unit="percent")
    half_width: float = opt(0.0025, "Stop at this CI half-width, percent.", unit="percent")
    min_pairs: int = opt(16, "Pairs before the stopping rule may stop.")
    max_pairs: int = opt(400, "Most pairs per cell.")
    cell_seconds: float = opt(60.0, "Time cap per cell.")
    # One sample = k calls replayed back to back. On the H200, k calibrated for ~1 ms samples
    # (k=1-2 at B8_T1024_H8_D64) gave A/A pairs scattering by 6-7%: samples must be long.
    sample_ms: float = opt(10.0, "Calibrate k so one timed sample lasts this long.")
    diff_tol: float = opt(0.005, "Relative RMS error allowed between base and candidate.")
    inputs: dict[str, str] = opt(factory=dict, help="Override an input's transform: k=l2norm, or b=neg:a "
                                 "(minus input a; repeatable; the contract's overrides apply too).", flags=("--input",), kind="assign")
    # Backend against backend: the same code, the candidate's workers with a variable set (FLA's
    # FLA_TILELANG=1, say). Both sides are then spawned (a fork server's preloaded libraries read
    # their environment at import), and the numeric-settings probe expects exactly these differences.
    cand_env: dict[str, str] = opt(factory=dict, help="Set an environment variable for the candidate's workers "
                                   "only: FLA_TILELANG=1 (repeatable); with an unchanged tree, one backend "
                                   "against another.", flags=("--cand-env",), kind="assign")
    worker_timeout: float = opt(1800.0, "Seconds a worker may take to answer (compile included).")
    # Triton's autotuner picks by timing, so two processes running the same kernel can pick
    # different configs: noise that would read as a win or a loss of the candidate. Shared (the
    # default), a kernel whose source is unchanged is tuned once (by whichever side warms it
    # first) and both sides run that pick; a changed kernel has a different source hash and is
    # tuned on its own side. The picks are recorded either way (CellResult.tuning_differs).
    independent_tuning: bool = opt(False, "Let each side autotune on its own, even kernels whose source is "
                                          "unchanged (default: tuned once, shared).")
    # Each round starts fresh worker processes, the start and setup order swapped every round,
    # and takes its share of the pairs. On the H200 the side that started and set up first once
    # ran B8_T2048_H32_D256 ~0.5% slower; an even number of equal rounds cancels that in the
    # pooled estimate, and a verdict stands only if every round agrees with its direction (see
    # analysis.split_direction). (The larger offset, ~1.1%, came from the process that had
    # compiled the cell: see Session._fresh_pair.)
    rounds: int = opt(2, "Fresh worker processes this many times, start order swapped each round; a "
                         "FASTER/SLOWER verdict needs every round's estimate on its side of the margin.")
    # Cells whose rounds still disagree beyond their CIs after `rounds` get two more rounds at a
    # time (one of each order), in fresh processes that set up only those cells, up to this many
    # rounds in all: a per-process offset averages out over more processes.
    max_rounds: int = opt(4, "Cells whose rounds still disagree get two more rounds at a time, up to this "
                             "many in all (at most --rounds: none).")
    # Every measuring worker builds each cell this many times (own inputs, same values; own proven
    # CUDA graph and memory pool), and the pairs rotate over them a block of two pairs at a time.
    # Where a cell's memory lands moves its time: on the H200 the four placements of one cell in
    # one process differed by up to 0.85%, the same in six processes (benchmarks/placement.py). One
    # placement per process makes that a per-process offset (an A/A read up to 0.28% with 2
    # rounds), and a candidate that merely allocates differently could draw a luckier one. Extra
    # placements take at most a quarter of the free GPU memory; 1 turns this off (the CPU always has 1).
    placements: int = opt(4, "Build each cell this many times in every measuring worker (own inputs and "
                             "graph memory) and rotate the pairs over them (1: off).")
    # Another process on the GPU moves both sides' times (the H200: 8-pair intervals of [0.93, 1.41]
    # on an A/A estimate of 1.0004 beside a foreign pytest). Every pair is marked by who else was on
    # the GPU (evidence.occupancy); --exclusive waits for the GPU to be ours alone, or refuses.
    exclusive: bool = opt(False, "Measure only while no other process is on the GPU: wait up to "
                                 "--exclusive-wait seconds for it to leave, else exit 3.")
    exclusive_wait: float = opt(300.0, "Seconds --exclusive waits for another process to leave the GPU.")
    # The guard's probes on every cell (docs/GUARD.md); --no-probes is for measuring their cost.
    probes: bool = opt(True, "The guard's dynamic probes on every cell (--no-probes: to measure their cost; "
                             "the result is then unguarded).")
    # Shapes nobody times (bench/unseen.py): undoing FLA's fix #988 read FASTER 1.10x on
    # B8_T1024_H8_D64, its check passing there, while it was wrong on B1-T64-H2-D32, a shape only
    # FLA's tests run. Once per run, in the warm-up pair, after the cells: a few small seeded
    # shapes, fwd and fwdbwd, base against candidate (docs/GUARD.md, unseen-shape-differs).
    unseen_shapes: int = opt(4, "Compare base and candidate, fwd and fwdbwd, on this many small seeded shapes that "
                                "no bench cell or shape config uses (T of 1 and off chunk multiples, small and "
                                "non-power-of-two head dims, tiny varlen), once in the warm-up; 0: off (the record "
                                "says so).")
    unseen_seed: int = opt(0, "Seed of the unseen shapes' draw (the record holds it and the shapes drawn).")
    # A kernel wrong only behind a keyword option the registry's call never sets (an initial state, the
    # final state's gradient) read SAME on FLA with the unseen shapes alone: the draw also varies the
    # op's options (bench/options.py, unseen-option-differs).
    unseen_options: int = opt(4, "Also call the op with this many combinations of its keyword options the registry "
                                 "never sets (bools, enums, optional tensors such as an initial state), each on an "
                                 "unseen shape, fwd and bwd through every output; 0: off.")
    # The frozen test's own calls, recorded when the gate ran at the base (flaloop/task/testcalls.py),
    # replayed base against candidate in separate workers: a judge loosened inside the test process
    # cannot carry a wrong kernel past the bench (bench/replay.py, test-call-differs).
    test_calls: int = opt(8, "Replay this many of the test's own calls recorded at the base (a seeded sample, "
                             "fwd and bwd through every output), base against candidate; 0: off.")
    # Fork workers from a warm server that imported the target's third-party libraries once
    # (bench/forkservers.py): on the H200 FLA's import took 1.9 s in a forked worker, 10-17 s in a spawned one.
    forkserver: bool = opt(True, "Fork the workers from a warm server that imported the target's third-party "
                                 "libraries once (idle exit after FLALOOP_FORKSERVER_IDLE_S, default 300 s; "
                                 "`flaloop clean` stops it).")
    # "lean": the op module's parent packages run their __init__ only when asked for a name (FLA's
    # fla/__init__.py imports fla.layers, fla.models and transformers, which the op never needs).
    # Opt-in: a package __init__ with side effects the op depends on is then skipped on both sides.
    import_mode: str = opt("full", "full: import the op as users do; lean: the tree's packages run their "
                                   "__init__ only when asked for a name (a real import beside the run must "
                                   "show the same numeric settings).", flags=("--import-mode", "--import"),
                           choices=IMPORT_MODES)
    # Not options: set by the command (bench --aa, --quick) or fixed by the method.
    aa: bool = opt(False, cli=False)
    signal: bool = opt(False, cli=False)  # a quick signal: labelled everywhere, never promotes
    n_eager: int = opt(6, cli=False)
    clock_floor: float = opt(0.75, cli=False)
    seed: int = opt(0, cli=False)
    # A cell is settled, and stops taking pairs, once its CI lies beyond the margin by more than
    # this band (FASTER/SLOWER) or inside the margin shrunk by it (SAME): twice the largest
    # start-order offset seen on the H200 (~0.5%). Only round 1 stops early; the later rounds
    # still run (with as many pairs as round 1 kept): they are the check on per-process effects.
    settle_band: float = opt(0.01, cli=False)

    @property
    def sample_timeout(self) -> float:
        """A timed sample is short: a worker that takes longer than this to give one is hung."""
        return min(self.worker_timeout, 300.0)

    def check(self) -> BenchConfig:
        """UsageError naming the first option that cannot work; the config itself otherwise."""
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)  # the names the test ids use: fp16, bf16
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            bad = [v for v in (value if isinstance(value, list) else [value]) if choices and v not in choices]
            if bad:
                raise UsageError(f"{flag_of(f.name)} {', '.join(map(str, bad))}: not one of {', '.join(choices)}")
        if not self.modes:
            raise UsageError("--modes is empty", f"choose from {', '.join(MODES)}")
        if self.rounds < 1:
            raise UsageError(f"--rounds {self.rounds}: need at least 1 (2 or more let a per-process effect show)")
        if self.max_rounds < 0:
            raise UsageError(f"--max-rounds {self.max_rounds}: need 0 or more (at most --rounds: no extra rounds)")
        for name in self.cand_env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise UsageError(f"--cand-env {name}: not an environment variable's name", "e.g. --cand-env FLA_TILELANG=1")
            if name in RESERVED_ENV or name.startswith("FLALOOP_"):
                raise UsageError(f"--cand-env {name}: flaloop sets it for both sides (the device, the caches, "
                                 "its own settings)", "switch a backend or a library setting instead")
        if not 0 <= self.unseen_shapes <= MAX_UNSEEN:
            raise UsageError(f"--unseen-shapes {self.unseen_shapes}: need 0 (off) to {MAX_UNSEEN}")
        for name in ("unseen_options", "test_calls"):
            if not 0 <= getattr(self, name) <= MAX_UNSEEN:
                raise UsageError(f"{flag_of(name)} {getattr(self, name)}: need 0 (off) to {MAX_UNSEEN}")
        if self.placements < 1:
            raise UsageError(f"--placements {self.placements}: need at least 1 (1 builds each cell once)")
        if self.min_pairs < 2 or self.max_pairs < max(self.min_pairs, MIN_PAIRS_JUDGED):
            raise UsageError(f"--min-pairs {self.min_pairs} / --max-pairs {self.max_pairs}: need 2 <= min-pairs <= "
                             f"max-pairs, and max-pairs >= {MIN_PAIRS_JUDGED} (the pairs a cell needs for a verdict)")
        for name in ("margin", "half_width", "cell_seconds", "sample_ms", "diff_tol", "worker_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UsageError(f"{flag_of(name)} {value}: need a positive number")
        self.max_rounds = max(self.rounds, self.max_rounds)
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BenchConfig:
        d = dict(d or {})
        # schema 2 records spelled some options otherwise
        renamed = {"min_sample_ms": "sample_ms", "setup_timeout": "worker_timeout", "overrides": "inputs"}
        for old, new in renamed.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
        if "shared_tuning" in d and "independent_tuning" not in d:
            d["independent_tuning"] = not d.pop("shared_tuning")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# --quick: the contract's shapes, one round, a wide stopping rule; labelled SIGNAL everywhere.
QUICK = {"rounds": 1, "max_rounds": 1, "min_pairs": 6, "max_pairs": 40, "half_width": 0.01, "cell_seconds": 10.0,
         "signal": True}


def flag_of(name: str) -> str:
    """How the command line spells a BenchConfig field."""
    f = next((f for f in fields(BenchConfig) if f.name == name), None)
    flags = f.metadata.get("flags") if f is not None else ()
    return flags[0] if flags else "--" + name.replace("_", "-")


def cli_args(cfg: BenchConfig, contract=None) -> list[str]:
    """The command-line options that ask for `cfg` (those off their default; `from_contract` ones
    where they differ from the contract's, an input override where the contract lacks it): what
    reproduces a measurement (a report's Reproduce block)."""
    out: list[str] = ["--quick"] if cfg.signal else []
    default = BenchConfig(**({k: v for k, v in QUICK.items() if k != "signal"} if cfg.signal else {}))
    for f in fields(BenchConfig):
        meta = f.metadata
        if not meta.get("cli"):
            continue
        value, flag = getattr(cfg, f.name), flag_of(f.name)
        base = getattr(contract, f.name, getattr(default, f.name)) if meta.get("from_contract") else getattr(default, f.name)
        if meta.get("kind") == "assign":
            known = dict(getattr(contract, "input_overrides", None) or {})
            for name, transform in value.items():
                if known.get(name) != transform:
                    out += [flag, f"{name}={transform}"]
            continue
        if value == base:
            continue
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif meta.get("kind") == "csv":
            out += [flag, ",".join(value)]
        elif meta.get("unit") == "percent":
            out += [flag, f"{value * 100:g}"]
        else:
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def _known(cls, d: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in (d or {}).items() if k in names}


@dataclass(frozen=True)
class Cell:
    shape_name: str
    shape: dict
    mode: str
    dtype: str = "bfloat16"
    seqlens: tuple[int, ...] | None = None
    l2: str = "rotate"  # L2_STATES: what the L2 holds as each timed call starts

    @property
    def id(self) -> str:
        return f"{self.shape_name}/{self.mode}" + ("" if self.l2 == "rotate" else f"/l2-{self.l2}")

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    def to_wire(self, cfg: BenchConfig, k: int | None, timer: str, placements: int = 1) -> dict:
        """The cell as a worker's `setup` takes it: the config's own names for its options."""
        return {"id": self.id, "shape": self.shape, "mode": self.mode, "dtype": self.dtype, "seed": cfg.seed,
                "inputs": cfg.inputs, "seqlens": list(self.seqlens) if self.seqlens else None, "k": k,
                "timer": timer, "sample_ms": cfg.sample_ms, "placements": placements, "l2": self.l2}

    def to_dict(self) -> dict:
        return {**asdict(self), "id": self.id}

    @classmethod
    def from_dict(cls, d: dict) -> Cell:
        d = _known(cls, d)
        if d.get("seqlens") is not None:
            d["seqlens"] = tuple(d["seqlens"])
        return cls(**d)


def varlen_shape(name: str, shape: dict, seed: int = 0) -> tuple[str, dict, tuple[int, ...]]:
    """A packed variable-length variant of a dense shape: B*T tokens in 2*B sequences, B=1."""
    total, n = shape["B"] * shape["T"], max(2, 2 * shape["B"])
    rng = random.Random(f"{name}-{seed}")
    cuts = sorted(rng.sample(range(1, total), n - 1))
    lens = tuple(b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True))
    return f"{name}_varlen{n}", {**shape, "B": 1, "T": total}, lens


def l2_states(mode: str) -> list[str]:
    """The L2 states whose cells an --l2 mode (L2_MODES) asks for."""
    return ["hot", "cold"] if mode == "both" else [mode]


def make_cells(shape_configs: dict[str, dict], names: list[str], modes: list[str], dtype: str,
               varlen: bool, l2: str = "rotate") -> list[Cell]:
    """The cells of these shapes and modes (a packed variant of each shape with `varlen`), one per
    L2 state that the --l2 mode `l2` asks for."""
    unknown = [n for n in names if n not in shape_configs]
    if unknown:
        raise UsageError(f"unknown shape(s) {', '.join(unknown)}", f"known: {', '.join(shape_configs)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UsageError(f"unknown mode(s) {', '.join(bad)}", f"choose from {', '.join(MODES)}")
    if l2 not in L2_MODES:
        raise UsageError(f"--l2 {l2}: not one of {', '.join(L2_MODES)}")
    states = l2_states(l2)
    cells = []
    for name in names:
        shape = dict(shape_configs[name])
        if "seqlens" in shape:  # a packed shape of its own (a flaloop.toml shape): B = 1, T = their sum
            lens = tuple(shape.pop("seqlens"))
            shape = {**shape, "B": 1, "T": sum(lens)}
            cells.extend(Cell(name, shape, mode, dtype, lens, l2=s) for mode in modes for s in states)
            continue
        cells.extend(Cell(name, shape, mode, dtype, l2=s) for mode in modes for s in states)
        if varlen and not {"B", "T"} <= set(shape):
            raise UsageError(f"--varlen packs B*T tokens, and the shape {name} has no B or T: {shape}",
                             "declare a packed shape instead, e.g. T96_packed = { H = 2, D = 16, seqlens = [32, 64] }")
        if varlen:
            vname, vshape, lens = varlen_shape(name, shape_configs[name])
            cells.extend(Cell(vname, vshape, mode, dtype, lens, l2=s) for mode in modes for s in states)
    return cells


@dataclass
class Pair:
    order: str  # "AB" (base first) or "BA"
    base_ms: float
    cand_ms: float
    clock_before: dict | None
    clock_after: dict | None
    dropped: str | None = None
    round: int = 0
    # host wall time of the same synchronized batch, per call (timer cross-check)
    base_wall_ms: float | None = None
    cand_wall_ms: float | None = None
    placement: int = 0  # which of the cell's placements both sides timed (BenchConfig.placements)
    # pids of processes not ours on the GPU right after the pair (None: NVML could not tell)
    foreign: list[int] | None = None
    # each side's sample as the orchestrator's own clock saw it: the request's round trip, and the
    # time the worker reported for its work in it (per-call ms times k), in ms per sample
    # (guard/timing.timer_host_gap; None: a worker client that keeps no round trip)
    base_rtt_ms: float | None = None
    cand_rtt_ms: float | None = None
    base_reported_ms: float | None = None
    cand_reported_ms: float | None = None

    @classmethod
    def from_dict(cls, d: dict) -> Pair:
        return cls(**_known(cls, d))


@dataclass
class RoundEstimate:
    """One round's own estimate of a cell's speedup (bench/analysis.round_estimates)."""

    round: int
    n_pairs: int
    speedup: float
    ci_low: float
    ci_high: float

    @classmethod
    def from_dict(cls, d: dict) -> RoundEstimate:
        return cls(**_known(cls, d))


@dataclass
class CellSummary:
    """The final-claim block of a cell: device time per side; eager wall and host time per side."""

    base: Summary | None = None
    cand: Summary | None = None
    eager: dict[str, Summary] = field(default_factory=dict)
    host: dict[str, Summary] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d: dict = {}
        for side in ("base", "cand"):
            if getattr(self, side) is not None:
                d[side] = getattr(self, side).to_dict()
        for part in ("eager", "host"):
            if getattr(self, part):
                d[part] = {s: v.to_dict() for s, v in getattr(self, part).items()}
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> CellSummary:
        d = d or {}

        def summ(x):
            return Summary(**_known(Summary, x)) if x else None

        return cls(base=summ(d.get("base")), cand=summ(d.get("cand")),
                   eager={s: summ(v) for s, v in (d.get("eager") or {}).items()},
                   host={s: summ(v) for s, v in (d.get("host") or {}).items()})


@dataclass
class CellRoofline:
    """A cell against the device's limits (bench/roofline.py): its floor and each side's share of it."""

    bytes: int
    flops: int
    floor_ms: float | None = None
    pct_of_floor_base: float | None = None
    pct_of_floor_cand: float | None = None
    bound: str | None = None
    above_100: bool = False

    @classmethod
    def from_dict(cls, d: dict | None) -> CellRoofline | None:
        return cls(**_known(cls, d)) if d else None


def _estimate(d: dict | None) -> SpeedupEstimate | None:
    return SpeedupEstimate(**_known(SpeedupEstimate, d)) if d else None


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
    probes: dict = field(default_factory=dict)    # {side: the worker's probe report}
    findings: list[Finding] = field(default_factory=list)  # guard findings on this cell
    settled: bool = False
    # filled by analyse()
    estimate: SpeedupEstimate | None = None
    verdict: str | None = None
    summary: CellSummary = field(default_factory=CellSummary)
    launch_bound: bool | None = None
    tuning_differs: list[str] = field(default_factory=list)
    rounds: list[RoundEstimate] = field(default_factory=list)  # per-round estimates, when rounds > 1
    rounds_disagree: bool = False
    roofline: CellRoofline | None = None  # filled by finish (roofline.annotate)

    @property
    def id(self) -> str:
        return self.cell.id

    @property
    def kept(self) -> list[Pair]:
        return [p for p in self.pairs if p.dropped is None]

    @property
    def dropped_pairs(self) -> int:
        return sum(p.dropped is not None for p in self.pairs)

    def log_ratios(self) -> np.ndarray:
        return np.log(np.array([p.cand_ms for p in self.kept]) / np.array([p.base_ms for p in self.kept]))

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["cell"] = self.cell.to_dict()
        d["pairs"] = [asdict(p) for p in self.pairs]
        d["findings"] = [f.to_dict() for f in self.findings]
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        d["summary"] = self.summary.to_dict()
        d["rounds"] = [asdict(r) for r in self.rounds]
        d["roofline"] = asdict(self.roofline) if self.roofline else None
        d["dropped_pairs"] = self.dropped_pairs
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CellResult:
        d = dict(d)
        out = cls(**{k: v for k, v in _known(cls, d).items()
                     if k not in ("cell", "pairs", "findings", "estimate", "summary", "rounds", "roofline")},
                  cell=Cell.from_dict(d["cell"]))
        out.pairs = [Pair.from_dict(p) for p in d.get("pairs") or []]
        out.findings = [Finding.from_dict(f) for f in d.get("findings") or []]
        out.estimate = _estimate(d.get("estimate"))
        out.summary = CellSummary.from_dict(d.get("summary"))
        out.rounds = [RoundEstimate.from_dict(r) for r in d.get("rounds") or []]
        out.roofline = CellRoofline.from_dict(d.get("roofline"))
        return out
