"""The bench's data model: what to measure (`BenchConfig`, `Cell`) and what was measured (`Pair`,
`CellResult`). Plain dataclasses that serialise into the run record."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import numpy as np

from flaloop.errors import UsageError

MODES = ("fwd", "fwdbwd")


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
    # analysis.split_direction). (The larger offset, ~1.1%, came from the process that had
    # compiled the cell: see Session._prime.)
    rounds: int = 2
    # Cells whose rounds still disagree beyond their CIs after `rounds` get two more rounds at a
    # time (one of each order), in fresh processes that set up only those cells, up to this many
    # rounds in all: a per-process offset averages out over more processes.
    max_rounds: int = 4
    # Every measuring worker builds each cell this many times (own inputs, same values; own proven
    # CUDA graph and memory pool), and the pairs rotate over them a block of two pairs at a time. Where a cell's
    # memory lands moves its time: on the H200 the four placements of one cell in one process
    # differed by up to 0.85%, the same in six processes (benchmarks/placement.py). One placement
    # per process makes that a per-process offset (an A/A read up to 0.28% with 2 rounds), and a
    # candidate that merely allocates differently could draw a luckier one. Extra placements take
    # at most a quarter of the free GPU memory; 1 turns this off (the CPU always has 1).
    placements: int = 4
    # A cell is settled, and stops taking pairs, once its CI lies beyond the margin by more than
    # this band (FASTER/SLOWER) or inside the margin shrunk by it (SAME): twice the largest
    # start-order offset seen on the H200 (~0.5%). Only round 1 stops early; the later rounds
    # still run (with as many pairs as round 1 kept): they are the check on per-process effects.
    settle_band: float = 0.01
    # The guard's probes on every cell (docs/GUARD.md); --no-probes is for measuring their cost.
    probes: bool = True
    # Fork workers from a warm server that imported the target's third-party libraries once
    # (bench/forkservers.py): on the H200 FLA's import took 1.9 s in a forked worker, 10-17 s in a spawned one.
    forkserver: bool = True
    # "lean": the op module's parent packages run their __init__ only when asked for a name (FLA's
    # fla/__init__.py imports fla.layers, fla.models and transformers, which the op never needs).
    # Opt-in: a package __init__ with side effects the op depends on is then skipped on both sides.
    import_mode: str = "full"
    # A quick signal: labelled signal everywhere, never promotes (cli: --quick).
    signal: bool = False


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

    def to_wire(self, seed: int, overrides: dict, k: int | None, timer: str, min_sample_ms: float,
                placements: int = 1) -> dict:
        return {"id": self.id, "shape": self.shape, "mode": self.mode, "dtype": self.dtype, "seed": seed,
                "overrides": overrides, "seqlens": list(self.seqlens) if self.seqlens else None, "k": k,
                "timer": timer, "min_sample_ms": min_sample_ms, "placements": placements}


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
    findings: list[dict] = field(default_factory=list)  # guard findings (Finding.to_dict) on this cell
    settled: bool = False
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
