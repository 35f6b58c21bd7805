"""Pure: the base's band around its own training run, and where a candidate's run leaves it.

Two runs of the base on the same seed were bitwise equal on the H200 (issue 40), so the base's
repeats alone give a band of zero: any candidate that rounds one operation differently would leave
it. The band is therefore made of what the op's tolerance allows: the base run again with every
call of the op moved by seeded noise of relative RMS `perturb` (the bench's `--diff-tol`, the
differential check's own limit), once per noise seed. At step t the half-width is

    band(t) = scale * max over s <= t, over perturbed runs j, of |x_j(s) - x_0(s)|

for the loss and, apart, the gradient norm (x_0: the base's unperturbed run). The running maximum
keeps the band from pinching to zero at a step where the perturbed runs happened to cross the
base's; `scale` leaves room for a change whose error, within the tolerance, is not shaped like
noise. A candidate leaves the band at the first step where |x_c(t) - x_0(t)| > band(t), or where
its value is not finite.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from flaloop.guard import dynamic
from flaloop.guard.findings import Finding

SERIES = ("losses", "grad_norms")
# a band of zero (perturbed runs equal to the base's, an op the model barely depends on) still
# allows the last bits of a float32 loss: an unchanged tree re-run reads inside
FLOOR_REL = 1e-6


@dataclass
class Departure:
    series: str          # "losses" or "grad_norms"
    step: int            # 0-based step where the candidate first left the band
    deviation: float     # |cand - base| there (inf: not finite)
    band: float          # the band's half-width there

    @property
    def times(self) -> float:
        return self.deviation / self.band if self.band > 0 else math.inf


@dataclass
class TrajectoryJudgement:
    band: dict[str, list[float]] = field(default_factory=dict)       # per series, per step
    deviation: dict[str, list[float]] = field(default_factory=dict)  # the candidate's, per step
    departures: list[Departure] = field(default_factory=list)
    worst: dict[str, float] = field(default_factory=dict)  # per series: max deviation / band

    @property
    def inside(self) -> bool:
        return not self.departures

    def to_dict(self) -> dict:
        return {"band": self.band, "deviation": self.deviation, "inside": self.inside, "worst": self.worst,
                "departures": [{**asdict(d), "times": d.times} for d in self.departures]}


def band(base: list[float], perturbed: list[list[float]], scale: float) -> list[float]:
    out, widest = [], 0.0
    for t, x0 in enumerate(base):
        here = max((abs(run[t] - x0) for run in perturbed if t < len(run) and math.isfinite(run[t])), default=0.0)
        widest = max(widest, here)
        out.append(max(scale * widest, FLOOR_REL * abs(x0)))
    return out


def judge(base: dict, perturbed: list[dict], cand: dict, scale: float) -> TrajectoryJudgement:
    """The candidate's run (`cand`, a worker's trajectory reply) against the base's band."""
    out = TrajectoryJudgement()
    for series in SERIES:
        x0 = list(base.get(series) or [])
        b = band(x0, [list(p.get(series) or []) for p in perturbed], scale)
        xc = list(cand.get(series) or [])
        dev = [abs(c - x) if c is not None and math.isfinite(c) else math.inf for c, x in zip(xc, x0, strict=False)]
        out.band[series], out.deviation[series] = b, dev
        out.worst[series] = max((d / w if w > 0 else (0.0 if d == 0 else math.inf) for d, w in zip(dev, b, strict=False)),
                                default=0.0)
        left = next((t for t, (d, w) in enumerate(zip(dev, b, strict=False)) if d > w), None)
        if left is not None:
            out.departures.append(Departure(series, left, dev[left], b[left]))
    return out


def findings(j: TrajectoryJudgement, cell: str, perturb: float, seeds: int, scale: float) -> list[Finding]:
    """One blocking finding per series that left the band, naming the step and by how much."""
    out = []
    for d in j.departures:
        what = "loss" if d.series == "losses" else "gradient norm"
        by = "a non-finite value" if math.isinf(d.deviation) else f"|Δ| {d.deviation:.3g}, {d.times:.1f}x the band's {d.band:.3g}"
        out.append(dynamic.finding(
            "model-trajectory-left-band",
            f"the candidate's {what} left the base's band at step {d.step + 1}: {by} (band: {scale:g}x the widest "
            f"of {seeds} base run(s) with the op's outputs moved by {perturb:g} relative RMS)", cell))
    return out
