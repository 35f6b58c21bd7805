"""Two stored run records side by side (`flaloop compare A B`), and what `--fail-on slower` counts as slower.

Pure over run records (bench/record.RunRecord): nothing here measures; `resolve` only finds a record
by the name a user gives it. Each record holds per-cell estimates of its candidate against its base,
``theta = ln(t_cand / t_base)`` with a rank interval; comparing B with A:

* **Cells.** A cell is compared when both records measured it (same id, shape, mode, dtype, seqlens
  and timer); every other cell is listed with the reason (only in one record, not measured in one,
  its shape or timer differs).
* **Machine.** The records must come from the same device (its UUID, else its name and host), driver,
  CUDA, PyTorch, Triton and dtype; each difference is listed. Across machines the numbers are shown
  but no interval and no verdict is given: a speedup is a property of the machine it was taken on.
* **Paired (same base commit).** B's change relative to A is the ratio of the speedups,
  ``speedup_B / speedup_A = exp(theta_A - theta_B)`` (above 1: B is faster than A). The two estimates
  come from independent runs, so the interval of ``theta_B - theta_A`` is built from the two intervals
  the way the geomean's is (``stats.combined_interval``: each side read back as a standard error,
  added in quadrature, Welch-Satterthwaite degrees of freedom), and the verdict is the single-cell CI
  rule (``stats.verdict``) with A's margin, per cell, without a multiplicity correction. The geomean
  of the ratios takes all paired cells' intervals at once.
* **Unpaired (different bases).** The candidates' median device times, ``A_cand / B_cand``, with no
  interval: the two runs share no pairs, and medians of separate runs have no paired interval.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from flaloop import stats
from flaloop.bench import record as record_mod
from flaloop.bench.model import CellResult
from flaloop.bench.record import RunRecord
from flaloop.core.errors import UsageError
from flaloop.core.workspace import Workspace, record_file
from flaloop.report import fmt
from flaloop.report.cells import CellView

# (record env key, what a person calls it); the device is compared on its own (see _device)
ENV_KEYS = (("driver", "driver"), ("cuda", "CUDA"), ("torch", "PyTorch"), ("triton", "Triton"))


# -- finding a record ------------------------------------------------------------------------------

def resolve(spec: str, root: Path | None, op: str | None = None) -> RunRecord:
    """A record named by its path, its run directory, or its run id (or a unique prefix of one) under
    `profile/<op>-opt/runs/` of `root` (every op's, without `op`). UsageError saying what was looked at."""
    p = Path(spec)
    if p.is_file():
        return record_mod.read(p)
    if p.is_dir():
        if record_file(p).is_file():
            return record_mod.read(record_file(p))
        raise UsageError(f"{spec} is a directory without a record.json",
                         "name a run directory under profile/<op>-opt/runs/, or its record.json")
    if root is None or "/" in spec:
        raise UsageError(f"no run record at {spec}", "name a record.json, a run directory or a run id")
    runs = [w.runs for w in ([Workspace.at(root, op)] if op else Workspace.every(root)) if w.runs.exists()]
    hits = sorted({d for r in runs for d in r.glob(f"{spec}*") if record_file(d).is_file()})
    exact = [d for d in hits if d.name == spec]
    if len(exact) == 1 or len(hits) == 1:
        return record_mod.read(record_file((exact or hits)[0]))
    where = ", ".join(str(r.relative_to(root)) for r in runs) or f"no profile/{op or '*'}-opt/runs/ in {root}"
    if hits:
        raise UsageError(f"run id {spec!r} is ambiguous: {', '.join(d.name for d in hits[:6])}",
                         "give more of it, or --op OP")
    newest = sorted((d.name for r in runs for d in r.iterdir() if record_file(d).is_file()), reverse=True)[:5]
    hint = f"looked in {where}" + (f"; newest: {', '.join(newest)}" if newest else "; run `flaloop bench OP` first")
    raise UsageError(f"no run record {spec!r}" + (f" of {op}" if op else ""), hint)


# -- what counts as slower (--fail-on slower) --------------------------------------------------------

def is_slower(est, margin: float) -> bool:
    """An interval (anything with ci_low and ci_high) wholly below 1 / (1 + margin)."""
    return est is not None and stats.verdict(est, margin) is stats.Verdict.SLOWER


def slower_in(record: RunRecord) -> list[str]:
    """The record's cells whose verdict is SLOWER, and "geomean" when its interval is below the margin."""
    out = [c.id for c in record.cells if c.verdict == "SLOWER"]
    if is_slower(record.summary.geomean, record.config.margin):
        out.append("geomean")
    return out


def slower_in_sweep(rows) -> list[str]:
    """`<candidate>: <cells>` for each sweep row with a SLOWER cell or geomean."""
    out = []
    for r in rows:
        what = list(r.slower) + (["geomean"] if r.verdict == "SLOWER" else [])
        if what:
            out.append(f"{r.ref if r.kind != 'head' else r.op}: {', '.join(dict.fromkeys(what))}")
    return out


# -- the comparison ------------------------------------------------------------------------------------

@dataclass
class Side:
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: str | None = None
    n_pairs: int | None = None
    base_ms: float | None = None
    cand_ms: float | None = None


@dataclass
class CellComparison:
    id: str
    a: Side
    b: Side
    ratio: float | None = None        # B relative to A: > 1, B is faster
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: str | None = None        # of B against A: FASTER | SLOWER | SAME | UNSURE
    basis: str = "paired"             # paired (ratio of speedups) | medians (candidate device medians)
    note: str = ""                    # why there is no interval, where there is none


@dataclass
class Comparison:
    a: dict
    b: dict
    paired: bool                      # both measured against the same base commit
    same_machine: bool
    margin: float
    cells: list[CellComparison] = field(default_factory=list)
    not_comparable: list[dict] = field(default_factory=list)   # {what, a, b, why}: the records'
    cells_not_comparable: list[dict] = field(default_factory=list)  # {id, why}
    geomean: dict | None = None       # {ratio, ci_low, ci_high, verdict, n_cells} of B against A
    notes: list[str] = field(default_factory=list)

    @property
    def slower(self) -> list[str]:
        out = [c.id for c in self.cells if c.verdict == "SLOWER"]
        return out + (["geomean"] if (self.geomean or {}).get("verdict") == "SLOWER" else [])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slower"] = self.slower
        return d


def _about(r: RunRecord) -> dict:
    return {"path": r.path, "op": r.op, "created": r.created, "kind": "aa" if r.aa else r.kind,
            "base": r.base.commit, "base_ref": r.base.ref, "candidate": r.candidate.commit,
            "candidate_ref": r.candidate.ref, "dirty": r.candidate.dirty, "signal": r.signal,
            "device": (r.env or {}).get("device_name"), "margin": r.config.margin}


def _device(env: dict) -> str | None:
    if env.get("device_uuid"):
        return f"{env.get('device_name') or '?'} ({env['device_uuid']})"
    if env.get("device_name") or env.get("host"):
        return f"{env.get('device_name') or '?'} on {env.get('host') or '?'}"
    return None


def machine_differences(a: RunRecord, b: RunRecord) -> list[dict]:
    """What about the two runs' machines and settings keeps their numbers apart, each named."""
    ea, eb = a.env or {}, b.env or {}
    out = []
    da, db = _device(ea), _device(eb)
    if da != db:
        out.append({"what": "device", "a": da, "b": db, "why": "measured on different devices"})
    for key, name in ENV_KEYS:
        if ea.get(key) != eb.get(key):
            out.append({"what": key, "a": ea.get(key), "b": eb.get(key), "why": f"different {name}"})
    if a.config.dtype != b.config.dtype:
        out.append({"what": "dtype", "a": a.config.dtype, "b": b.config.dtype, "why": "different input dtype"})
    return out


def _side(c: CellResult) -> Side:
    v = CellView.of(c)
    return Side(speedup=v.speedup, ci_low=v.ci_low, ci_high=v.ci_high, verdict=v.verdict, n_pairs=v.n_pairs,
                base_ms=v.ms("base"), cand_ms=v.ms("cand"))


def _cell_mismatch(ca: CellResult, cb: CellResult) -> str | None:
    x, y = ca.cell, cb.cell
    for name in ("shape", "mode", "dtype", "seqlens"):
        if getattr(x, name) != getattr(y, name):
            return f"its {name} differs (A: {getattr(x, name)}, B: {getattr(y, name)})"
    if ca.timer != cb.timer:
        return f"timed differently (A: {ca.timer}, B: {cb.timer})"
    for side, c in (("A", ca), ("B", cb)):
        if c.status != "ok" or c.estimate is None:
            return f"not measured in {side} ({c.status}{': ' + c.reason if c.reason else ''})"
    return None


def _theta_bounds(e) -> tuple[float, float]:
    """The interval of theta = ln(cand/base) behind a speedup interval (speedup = exp(-theta))."""
    lo = -math.log(e.ci_high) if e.ci_high and math.isfinite(e.ci_high) else -math.inf
    hi = -math.log(e.ci_low) if e.ci_low and e.ci_low > 0 else math.inf
    return lo, hi


def _difference(pairs: list[tuple], confidence: float = 0.95) -> tuple[float, float, float]:
    """(point, low, high) of mean_i(theta_B_i - theta_A_i) over pairs of (A estimate, B estimate),
    from their own intervals (stats.combined_interval over the 2m terms theta_B_i and -theta_A_i,
    whose mean is half the mean difference)."""
    thetas, bounds, ns = [], [], []
    for ea, eb in pairs:
        lo_a, hi_a = _theta_bounds(ea)
        thetas += [eb.log_ratio, -ea.log_ratio]
        bounds += [_theta_bounds(eb), (-hi_a, -lo_a)]
        ns += [max(2, eb.n_pairs), max(2, ea.n_pairs)]
    lo, hi, _ = stats.combined_interval(np.array(thetas), bounds, ns, confidence)
    return 2 * float(np.mean(thetas)), 2 * lo, 2 * hi


def _ratio_estimate(d: float, lo: float, hi: float, n: int) -> stats.SpeedupEstimate:
    """B against A as a speedup estimate: exp(-(theta_B - theta_A))."""
    return stats.SpeedupEstimate(speedup=math.exp(-d), ci_low=math.exp(-hi), ci_high=math.exp(-lo), log_ratio=d,
                                 half_width=(hi - lo) / 2, n_pairs=n, method="difference of two rank intervals")


def compare(a: RunRecord, b: RunRecord) -> Comparison:
    """B against A, cell by cell; see the module docstring."""
    machine = machine_differences(a, b)
    paired = a.base.commit == b.base.commit
    out = Comparison(a=_about(a), b=_about(b), paired=paired, same_machine=not machine, margin=a.config.margin,
                     not_comparable=machine)
    if a.op != b.op:
        out.not_comparable.append({"what": "op", "a": a.op, "b": b.op, "why": "records of different ops"})
    if b.config.margin != a.config.margin:
        out.notes.append(f"the margins differ (A ±{a.config.margin:.1%}, B ±{b.config.margin:.1%}): A's is used")
    if a.signal or b.signal:
        out.notes.append("a --quick record (SIGNAL) is compared: its verdicts are a signal only")
    if not paired:
        out.notes.append(f"different bases (A {a.base.commit[:12]}, B {b.base.commit[:12]}): the candidates' median "
                         "device times are compared, without an interval (the runs share no pairs)")
    ids_b = {c.id for c in b.cells}
    for c in a.cells:
        if c.id not in ids_b:
            out.cells_not_comparable.append({"id": c.id, "why": "only in A"})
    for c in b.cells:
        if a.cell(c.id) is None:
            out.cells_not_comparable.append({"id": c.id, "why": "only in B"})
    no_interval = "; ".join(f"{m['why']} (A: {m['a']}, B: {m['b']})" for m in out.not_comparable)
    paired_estimates = []
    for ca in a.cells:
        cb = b.cell(ca.id)
        if cb is None:
            continue
        why = _cell_mismatch(ca, cb)
        if why:
            out.cells_not_comparable.append({"id": ca.id, "why": why})
            continue
        cc = CellComparison(id=ca.id, a=_side(ca), b=_side(cb), basis="paired" if paired else "medians")
        if paired:
            d, lo, hi = _difference([(ca.estimate, cb.estimate)])
            cc.ratio = math.exp(-d)
            if no_interval:
                cc.note = f"no interval: {no_interval}"
            else:
                est = _ratio_estimate(d, lo, hi, min(ca.estimate.n_pairs, cb.estimate.n_pairs))
                cc.ci_low, cc.ci_high = est.ci_low, est.ci_high
                cc.verdict = stats.verdict(est, out.margin).value
                paired_estimates.append((ca.estimate, cb.estimate))
        else:
            if cc.a.cand_ms and cc.b.cand_ms:
                cc.ratio = cc.a.cand_ms / cc.b.cand_ms
            cc.note = "no interval: different bases, candidates' medians only" + (f"; {no_interval}" if no_interval else "")
        out.cells.append(cc)
    if paired_estimates:
        d, lo, hi = _difference(paired_estimates)
        est = _ratio_estimate(d, lo, hi, min(min(x.n_pairs, y.n_pairs) for x, y in paired_estimates))
        out.geomean = {"ratio": est.speedup, "ci_low": est.ci_low, "ci_high": est.ci_high,
                       "verdict": stats.verdict(est, out.margin).value, "n_cells": len(paired_estimates)}
    return out


def render_markdown(cmp: Comparison) -> str:
    """The comparison as a markdown table (what `compare` prints, and a pull request can take)."""
    a, b = cmp.a, cmp.b
    L = [f"A: `{a['path']}` ({a['op']}, candidate {str(a['candidate'])[:12]} vs base {str(a['base'])[:12]}, {a['created']})",
         f"B: `{b['path']}` ({b['op']}, candidate {str(b['candidate'])[:12]} vs base {str(b['base'])[:12]}, {b['created']})",
         ""]
    L += fmt.table(["cell", "A speedup", "A 95% CI", "A cand ms", "B speedup", "B 95% CI", "B cand ms", "B vs A",
                    "95% CI", "verdict"],
                   [[c.id, fmt.speedup(c.a.speedup), fmt.interval(c.a.ci_low, c.a.ci_high), fmt.ms(c.a.cand_ms),
                     fmt.speedup(c.b.speedup), fmt.interval(c.b.ci_low, c.b.ci_high), fmt.ms(c.b.cand_ms),
                     fmt.speedup(c.ratio), fmt.interval(c.ci_low, c.ci_high), c.verdict or "-"] for c in cmp.cells])
    L.append("")
    g = cmp.geomean
    if g:
        L.append(f"Geomean of B vs A over {g['n_cells']} paired cell(s): {fmt.speedup(g['ratio'])}, 95% CI "
                 f"{fmt.interval(g['ci_low'], g['ci_high'])}, {g['verdict']} (margin ±{cmp.margin:.1%}; above 1: B is faster).")
    else:
        L.append("No interval for B vs A: " + (", ".join(sorted({c.note for c in cmp.cells if c.note})) or "no cell in common"))
    for n in cmp.notes:
        L.append(f"- {n}")
    if cmp.not_comparable:
        L += ["", "Not comparable:"] + [f"- {m['what']}: {m['why']} (A: {m['a']}, B: {m['b']})" for m in cmp.not_comparable]
    if cmp.cells_not_comparable:
        L += ["", "Cells not compared:"] + [f"- {c['id']}: {c['why']}" for c in cmp.cells_not_comparable]
    return "\n".join(L) + "\n"
