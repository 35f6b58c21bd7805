"""A no-go's bound, backed by a number flaloop measured: `stop --no-go --bound KIND[@CELL][: note]`.

A no-go says the target cannot be reached and names what stops it. flaloop only accepts a limit it
measures itself, fills in the number from the records of the best iteration (the best kept one,
else the baseline), and checks that the limit binds: that it leaves less room on that cell than
the target still needs (`need = target / speedup of the best`, 1.0 speedup for the baseline).

| kind         | the number                                             | room it leaves          |
| ---          | ---                                                    | ---                     |
| `roofline`   | the best state's share of the cell's roofline floor    | 100 / share             |
|              | (the bench record's `roofline`, docs/ROOFLINE.md)      |                         |
| `launch`     | host time vs device time of an eager call (the bench's | eager wall / host time  |
|              | eager sample): launch-bound when host > device         | (what a user sees)      |
| `timer`      | the baseline A/A's CI half-width on the cell: what the | needed gain is below it |
|              | bench resolves there                                   |                         |
| `ncu-memory` | Nsight Compute's memory / DRAM throughput, % of peak   | 100 / share             |
| `ncu-sol`    | Nsight Compute's SM throughput (compute SOL), % of peak | 100 / share            |

Without @CELL the cell where the limit binds hardest is taken. A bound that no recorded number
backs is refused, naming the measurement that would back it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from flaloop.bench import record as record_mod
from flaloop.core.workspace import Workspace
from flaloop.loop import rules
from flaloop.loop.store import Iteration

KINDS = {
    "roofline": "`flaloop bench OP` on an op with a roofline model (docs/ROOFLINE.md) and the device's ceilings",
    "launch": "a bench with its eager sample (`--eager`, on by default) where host time exceeds device time",
    "timer": "the baseline's A/A (`flaloop baseline OP`)",
    "ncu-memory": "`flaloop profile OP --ncu` of the best iteration's commit",
    "ncu-sol": "`flaloop profile OP --ncu` of the best iteration's commit",
}
EXAMPLE = 'e.g. --bound "roofline@B8_T2048_H32_D256/fwd: the recurrence streams K and V once"'


@dataclass(frozen=True)
class Bound:
    kind: str
    cell: str | None
    note: str


@dataclass(frozen=True)
class Checked:
    """A bound checked against the records: `text` when it holds (the number filled in), else `why`."""

    ok: bool
    text: str = ""
    why: str = ""
    numbers: dict | None = None


def parse(text: str | None) -> Bound | str:
    """A Bound, or the reason the text is not one."""
    raw = (text or "").strip()
    if not raw:
        return f"name the limit: --bound KIND[@CELL][: note], KIND one of {', '.join(KINDS)}; {EXAMPLE}"
    head, _, note = raw.partition(":")
    kind, _, cell = head.strip().partition("@")
    kind = kind.strip().lower()
    if kind not in KINDS:
        return (f"{kind or raw!r} is not a limit flaloop measures; --bound KIND[@CELL][: note] with KIND one of "
                f"{', '.join(KINDS)} ({EXAMPLE})")
    return Bound(kind, cell.strip() or None, note.strip())


def _record(ws: Workspace, rel: str | None):
    if not rel:
        return None
    p = ws.path_of(rel)
    return record_mod.read(p) if p.is_file() else None  # gone: "no number"; damaged: read() says which file


def _best_record(ws: Workspace, iters: list[Iteration]):
    best = rules.best(iters)
    if best is None:
        return None, None
    rel = (best.vs_base or {}).get("record") if best.status == "keep" else (best.baseline or {}).get("record")
    return best, _record(ws, rel)


def _ncu(ws: Workspace, commit: str) -> dict[str, dict]:
    """Per cell id, the candidate side's Nsight Compute summary of profiles of this commit (clean tree)."""
    out: dict[str, dict] = {}
    for p in ws.profile_docs():
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        cand = d.get("candidate") or {}
        ncu = d.get("ncu") or {}
        if cand.get("head") == commit and not cand.get("dirty") and ncu.get("available"):
            out[(d.get("cell") or {}).get("id")] = (ncu.get("summary") or {}).get("cand") or {}
    return out


def numbers(ws: Workspace, iters: list[Iteration], kind: str) -> dict[str, dict]:
    """Per cell: the limit's reading (`value`, words) and the room it leaves (`room`, a speedup factor)
    on the best iteration's state; cells without a reading are absent."""
    best, rec = _best_record(ws, iters)
    out: dict[str, dict] = {}
    if best is None:
        return out
    if kind in ("ncu-memory", "ncu-sol"):
        for cid, s in _ncu(ws, best.commit).items():
            pct = max(filter(None, [s.get("memory_throughput_pct"), s.get("dram_throughput_pct")]), default=None) \
                if kind == "ncu-memory" else s.get("compute_sol_pct")
            if pct:
                what = "memory throughput" if kind == "ncu-memory" else "SM throughput (compute SOL)"
                out[cid] = {"value": pct, "room": 100.0 / pct, "words": f"{what} at {pct:.1f}% of peak (Nsight Compute)"}
        return out
    if kind == "timer":
        base = rules.baseline_of(iters)
        aa = _record(ws, (base.baseline or {}).get("record")) if base else None
        for c in (aa.cells if aa else []):
            if c.estimate and math.isfinite(c.estimate.half_width):
                hw = c.estimate.half_width
                out[c.id] = {"value": hw, "room": math.exp(hw),
                             "words": f"the bench resolves +-{hw:.2%} there (the baseline A/A's CI half-width)"}
        return out
    for c in (rec.cells if rec else []):
        if kind == "roofline" and c.roofline and c.roofline.pct_of_floor_cand:
            pct = c.roofline.pct_of_floor_cand
            out[c.id] = {"value": pct, "room": 100.0 / pct,
                         "words": f"the best state runs at {pct:.1f}% of its {c.roofline.bound or ''}-bound roofline "
                                  f"floor ({c.roofline.floor_ms:.4g} ms)"}
        if kind == "launch" and c.launch_bound and c.summary.host and c.summary.eager:
            host = (c.summary.host.get("cand") or c.summary.host.get("base"))
            eager = (c.summary.eager.get("cand") or c.summary.eager.get("base"))
            dev = c.summary.cand or c.summary.base
            if host and eager and dev:
                out[c.id] = {"value": host.median, "room": max(1.0, eager.median / host.median),
                             "words": f"launch-bound: host {host.median:.4g} ms > device {dev.median:.4g} ms per call; "
                                      f"a user's eager call takes {eager.median:.4g} ms"}
    return out


def check(ws: Workspace | Path, iters: list[Iteration], text: str | None, target: float) -> Checked:
    """Parse `text`, fill in its number from the records and check that it binds."""
    b = parse(text)
    if isinstance(b, str):
        return Checked(False, why=b)
    best = rules.best(iters)
    speed = rules.speedup_vs_base(best) or 1.0
    need = target / speed
    got = numbers(Workspace.of(ws), iters, b.kind)
    if b.cell is not None:
        got = {k: v for k, v in got.items() if k == b.cell}
    if not got:
        where = f" on {b.cell}" if b.cell else ""
        return Checked(False, why=f"no recorded {b.kind} number{where} for the best iteration's state; "
                                 f"backed by: {KINDS[b.kind]}")
    # where it binds hardest: the least room left, or for the timer the coarsest resolution
    cid, n = (max(got.items(), key=lambda kv: kv[1]["value"]) if b.kind == "timer"
              else min(got.items(), key=lambda kv: kv[1]["room"]))
    if b.kind == "timer":
        binds = math.log(need) < n["value"] if need > 1 else True
        room = f"the target needs {need:.4f}x more, {'inside' if binds else 'outside'} that"
    else:
        binds = n["room"] < need
        room = f"at most {n['room']:.3f}x left there, the target needs {need:.3f}x"
    text_out = f"{b.kind} on {cid}: {n['words']}: {room}" + (f" ({b.note})" if b.note else "")
    nums = {"kind": b.kind, "cell": cid, **n, "need": need}
    if not binds:
        return Checked(False, why=f"the bound does not bind: {text_out}", numbers=nums)
    return Checked(True, text=text_out, numbers=nums)
