"""One bench cell as every place that draws one reads it: the bench's terminal table, the report's
benchmark table and plots, the pull-request comment, sweep.md and the sweep's comment.

`CellView` is built from a measured `CellResult` (`CellView.of`); a stored record's cell dict is read
as a `CellResult` first (`from_record`), so both reach the same view the same way. The view's own dict
(`to_dict`) is the report's row of a cell (`report.json`'s "cells"); `from_dict` reads such a row, or
the part of one a sweep row keeps (id, speedup, interval, verdict, reason), with the rest left empty.
Each place picks its columns from the view and formats them with `report/fmt.py`: how a cell reads
is decided here and there, once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from flaloop.bench.model import CellResult

_UNSET = object()
LAUNCH_BOUND = "launch-bound (host > device)"  # a cell whose host time per call exceeds its device time


def _sides() -> dict:
    return {"base": None, "cand": None}


@dataclass(frozen=True)
class CellView:
    id: str
    shape_name: str | None = None
    shape: dict | None = None
    mode: str | None = None
    dtype: str | None = None
    varlen: bool = False
    seqlens: list[int] | None = None
    l2: str = "rotate"
    status: str | None = None          # ok | refused | blocked | failed | skipped | pending (None: not kept)
    reason: str = ""
    timer: str | None = None
    verdict: str | None = None         # FASTER | SLOWER | SAME | UNSURE | BLOCKED ...
    speedup: float | None = None       # base / candidate device time
    ci_low: float | None = None
    ci_high: float | None = None
    n_pairs: int | None = None         # the pairs the estimate stands on
    device: dict = field(default_factory=_sides)   # {side: the device time's summary (median, mean, ...)}
    eager: dict = field(default_factory=_sides)    # {side: the eager latency's summary}
    launch_bound: bool | None = None
    rounds_disagree: bool = False
    roofline: dict | None = None       # bench/roofline.CellRoofline as a dict
    # what only a measured cell knows (not in the report's row)
    pairs: int = 0                     # pairs taken, kept and dropped
    dropped: int = 0
    round_speedups: tuple[float, ...] = ()
    tuning_differs: int = 0            # kernel keys the two sides' autotuning picked differently for
    findings: tuple[str, ...] = ()     # the rules of the guard's findings on this cell

    # the report row's keys (report.json), in its order
    ROW = ("id", "shape_name", "shape", "mode", "dtype", "varlen", "seqlens", "l2", "status", "reason", "timer",
           "verdict", "speedup", "ci_low", "ci_high", "n_pairs", "device", "eager", "launch_bound",
           "rounds_disagree", "roofline")

    @classmethod
    def of(cls, result: CellResult, roofline=_UNSET) -> CellView:
        """The view of a measured cell; `roofline` (a CellRoofline or None) where it was computed apart."""
        c, est, summ = result.cell, result.estimate, result.summary.to_dict()
        roof = result.roofline if roofline is _UNSET else roofline
        eager = summ.get("eager") or {}
        return cls(
            id=c.id, shape_name=c.shape_name, shape=c.shape, mode=c.mode, dtype=c.dtype, varlen=c.varlen,
            seqlens=list(c.seqlens) if c.seqlens else None, l2=c.l2, status=result.status, reason=result.reason,
            timer=result.timer, verdict=result.verdict, speedup=est.speedup if est else None,
            ci_low=est.ci_low if est else None, ci_high=est.ci_high if est else None,
            n_pairs=est.n_pairs if est else None,
            device={"base": summ.get("base"), "cand": summ.get("cand")},
            eager={"base": eager.get("base"), "cand": eager.get("cand")},
            launch_bound=result.launch_bound, rounds_disagree=result.rounds_disagree,
            roofline=asdict(roof) if roof else None,
            pairs=len(result.pairs), dropped=result.dropped_pairs,
            round_speedups=tuple(r.speedup for r in result.rounds), tuning_differs=len(result.tuning_differs),
            findings=tuple(f.rule for f in result.findings))

    @classmethod
    def from_record(cls, d: dict) -> CellView:
        """The view of a stored run record's cell (`record.json`'s "cells")."""
        return cls.of(CellResult.from_dict(d))

    @classmethod
    def from_dict(cls, d: dict) -> CellView:
        """The view of a report row (`to_dict`), or of a part of one (a sweep row's cells)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        """The report's row of this cell."""
        return {k: getattr(self, k) for k in self.ROW}

    # -- what the places read -------------------------------------------------------------------

    @property
    def measured(self) -> bool:
        return self.speedup is not None

    def ms(self, side: str, eager: bool = False) -> float | None:
        """The median time per call of a side (base | cand), on the device or eager."""
        return ((self.eager if eager else self.device).get(side) or {}).get("median")

    @property
    def mode_label(self) -> str:
        """The mode, with the L2's state where it is not the default."""
        return (self.mode or "") + ("" if self.l2 == "rotate" else f" l2-{self.l2}")

    @property
    def pairs_label(self) -> str:
        """Pairs kept of those taken: `18/20`."""
        return f"{self.pairs - self.dropped}/{self.pairs}"

    @property
    def floor(self) -> dict:
        """The roofline's reading of the cell ({} without a model)."""
        return self.roofline or {}

    @property
    def note(self) -> str:
        """What a person should know beside the numbers: why a cell is not measured, a launch-bound or
        eager-timed cell, rounds that disagree, autotuning that differs between the sides."""
        note = self.reason
        if self.launch_bound:
            note = (note + " " + LAUNCH_BOUND).strip()
        if self.timer == "cuda_eager":
            note = (note + " eager timing (no CUDA graph)").strip()
        if self.rounds_disagree:
            note = (note + " rounds differ beyond their CIs (" + ", ".join(
                f"{s:.4f}x" for s in self.round_speedups) + ")").strip()
        if self.tuning_differs:
            note = (note + f" autotune picked differently for {self.tuning_differs} kernel key(s)").strip()
        return note
