"""What explains a win: the kernels of the claimed tree state against the base's, cell by cell, and
how much of the measured device-time change they account for.

`flaloop explain OP` (and `flaloop stop OP --go`, which takes one itself when none is recorded)
profiles every cell of the best iteration's vs-base measurement with torch.profiler, on the base
commit and on the iteration's commit (`inside/scripts/profile_step.py --cells`: one process a side, each
cell set up, warmed, profiled over `steps` steps and released). Each kernel's device time and
launches per step, on both sides, give the table of the report's "What explains the win".

The accounting of one cell (`account`), in ms per call:

    saved (measured)  = base_ms - cand_ms                  the bench's medians, paired and timed
    saved (kernels)   = sum over kernels of (base - cand)  the profiler's kernel durations
    saved (launches)  = (launches_base - launches_cand) * gap
                        gap = (base_ms - kernel_base_ms) / launches_base, the time per launch the
                        bench sees beyond the kernels (launch gaps), never below 0
    share             = (saved kernels + saved launches) / saved (measured)

The share is checked on every cell the measurement calls a win (its CI above 1 + margin) and over
all of them together (over every cell that got faster, when no single one is resolved). Its interval is the
profile's own noise (the spread of the per-step kernel totals, `NOISE_Z` standard errors); it blocks
the go, as the finding `unexplained-speedup`, when the whole interval lies outside `SHARE_BOUNDS`:

- below 0.5: more than half of the measured win is nowhere in the kernels the profiler sees. Work
  that escapes the timed stream, is skipped only when timed (a graph replay that drops a kernel,
  a path keyed on the call count), or a timer fooled by the candidate looks exactly like this.
- above 1.5: the kernels got cheaper by half again more than the bench measured. The profiled step
  is not what the bench timed (a different path, inputs cached between calls), or one of the two
  readings is broken; either way the claimed number is not the one the kernels support.

And, whatever the shares, a kernel that ran in the base for at least `VANISHED_SHARE` of its step,
no longer runs at all, while no new kernel and no growth elsewhere takes on at least `TAKEN_OVER` of
its time: work that disappeared with nothing doing it is the silent skip the promotion rule names.
Fewer launches of a kernel that still runs (intermediates kept instead of recomputed) is not this.

Without a GPU the "kernels" are the host's (see profile_step.py), with the step's host time outside
any op as a row of its own, since the host's time is then the device's: the accounting still runs,
but it cannot tell a kernel from Python, and the document says so. The profile then sees the whole
step, so nothing lies beyond it (no gap), and a bench base time unlike the profiled base step is the
host's load at one time or the other: each round's saving is scaled by bench / profiled base step
both ways (`whole_step`). With a GPU the time beyond the kernels is launch gaps or work the profiler
cannot see, so only a profile slower than the bench is scaled down.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flaloop import inside
from flaloop.bench import model as model_mod
from flaloop.bench import record as record_mod
from flaloop.core import clock, fsutil, git
from flaloop.core.errors import UsageError
from flaloop.core.workspace import EXPLAIN_FILE, Workspace
from flaloop.diagnose import profile as profiling
from flaloop.guard import catalogue
from flaloop.guard.findings import BLOCK, Finding

SCRIPT = inside.script("profile_step.py")
RULE = catalogue.UNEXPLAINED.id
SHARE_BOUNDS = (0.5, 1.5)
VANISHED_SHARE = 0.05
TAKEN_OVER = 0.10
NOISE_Z = 2.0
DEFAULT_STEPS = 10
ROUNDS = 2  # paired rounds of the profile, ABBA: what load does during one round moves both sides
HOST_ROW = "(host time outside any op)"  # profile_step.py's row of the same name
WHY, FIX = catalogue.UNEXPLAINED.why, catalogue.UNEXPLAINED.fix


@dataclass
class KernelDelta:
    name: str
    base_ms: float
    cand_ms: float
    base_launches: float
    cand_launches: float

    @property
    def delta_ms(self) -> float:
        return self.cand_ms - self.base_ms

    @property
    def change(self) -> str:
        if not self.base_launches and self.cand_launches:
            return "added"
        if self.base_launches and not self.cand_launches:
            return "removed"
        return "kept"

    def to_dict(self) -> dict:
        return {**asdict(self), "delta_ms": self.delta_ms, "change": self.change}


@dataclass
class CellAccount:
    id: str
    verdict: str | None
    base_ms: float | None            # the bench's medians
    cand_ms: float | None
    kernel_base_ms: float            # the profiler's, per step
    kernel_cand_ms: float
    launches_base: float
    launches_cand: float
    gap_ms: float                    # per launch, beyond the kernels (see the module's doc)
    noise_ms: float                  # standard error of the kernel saving
    kernels: list[KernelDelta] = field(default_factory=list)
    checked: bool = False            # a cell that won (CI above 1 + margin): its share is held to the bounds
    finding: str | None = None
    paired: list[float] = field(default_factory=list)  # each round's explained saving, at the bench's scale
    unsure: str | None = None        # the share's interval is out of bounds but the rounds disagree

    @property
    def saved_ms(self) -> float | None:
        return None if self.base_ms is None or self.cand_ms is None else self.base_ms - self.cand_ms

    @property
    def explained_ms(self) -> float:
        if self.paired:
            return statistics.fmean(self.paired)
        return (self.kernel_base_ms - self.kernel_cand_ms) + (self.launches_base - self.launches_cand) * self.gap_ms

    def round_shares(self) -> list[float]:
        s = self.saved_ms
        return [x / s for x in self.paired] if s and s > 0 else []

    def share(self, z: float = 0.0) -> float | None:
        s = self.saved_ms
        if not s or s <= 0:
            return None
        return (self.explained_ms + z * self.noise_ms) / s

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "kernels"},
                "saved_ms": self.saved_ms, "explained_ms": self.explained_ms, "share": self.share(),
                "share_low": self.share(-NOISE_Z), "share_high": self.share(NOISE_Z),
                "round_shares": self.round_shares(), "kernels": [k.to_dict() for k in self.kernels]}


def _sd(xs: list[float]) -> float | None:
    return statistics.stdev(xs) if len(xs) >= 2 else None


def _noise(side: dict) -> float:
    """Variance of one side's mean kernel total per step: the steps' spread, else 1 % of it."""
    steps = side.get("step_ms") or []
    sd = _sd(steps)
    if sd is None or not any(steps):
        sd = 0.01 * float(side.get("device_ms") or 0.0)
    return sd * sd / max(1, int(side.get("steps") or 1))


def _merge(rounds: list[dict]) -> dict:
    """One side's kernel table over its rounds: each kernel's time and launches per step averaged."""
    if len(rounds) == 1:
        return rounds[0]
    n = len(rounds)
    by: dict[str, dict] = {}
    for t in rounds:
        for k in t["kernels"]:
            acc = by.setdefault(k["name"], {"name": k["name"], "ms": 0.0, "launches": 0.0})
            acc["ms"] += float(k.get("ms", 0.0)) / n
            acc["launches"] += float(k.get("launches", 0.0)) / n
    return {"kernels": sorted(by.values(), key=lambda k: -k["ms"]),
            "steps": sum(int(t.get("steps") or 1) for t in rounds),
            "step_ms": [x for t in rounds for x in t.get("step_ms") or []],
            "device_ms": statistics.fmean(float(t["device_ms"]) for t in rounds),
            "launches": statistics.fmean(float(t["launches"]) for t in rounds)}


def _gap(bms: float | None, kb: float, lb: float, whole_step: bool) -> float:
    """The time per launch the bench sees beyond the kernels; none where the profile sees the whole step."""
    return max(0.0, (bms - kb) / lb) if bms is not None and lb and not whole_step else 0.0


def _round_saving(base: dict, cand: dict, bms: float | None, whole_step: bool = False) -> tuple[float, float]:
    """One round's explained saving and its noise, both sides profiled back to back, at the bench's
    scale: a step that load stretched beyond the bench's base time (a loaded host) stretches its
    savings alike, so they are scaled by bench / profiled base step (which is 1 whenever the profile
    ran no slower than the bench). Where the profile sees the whole step (`whole_step`: the host, no
    GPU) a bench that load stretched beyond the profile is scaled the same way, upwards."""
    kb, kc = float(base["device_ms"]), float(cand["device_ms"])
    lb, lc = float(base["launches"]), float(cand["launches"])
    gap = _gap(bms, kb, lb, whole_step)
    if not (bms and bms > 0 and kb > 0):
        scale = 1.0
    else:
        scale = bms / kb if whole_step else bms / max(kb, bms)
    return ((kb - kc) + (lb - lc) * gap) * scale, math.sqrt(_noise(base) + _noise(cand)) * scale


def account_cell(cid: str, base: dict | list[dict], cand: dict | list[dict], measured: dict,
                 whole_step: bool = False) -> CellAccount:
    """One cell's accounting from both sides' kernel tables (profile_step's `cells[id]`; a list: one
    per round, round i of each side profiled back to back) and the bench's row for it
    (rules.compare's cell: base_ms, cand_ms, verdict). `whole_step`: the profile saw the whole step
    (the host's time is the device's), so a bench and a profile of different lengths differ by load."""
    rb, rc = (base if isinstance(base, list) else [base]), (cand if isinstance(cand, list) else [cand])
    bms, cms = measured.get("base_ms"), measured.get("cand_ms")
    rounds = [_round_saving(b, c, bms, whole_step) for b, c in zip(rb, rc, strict=True)]
    base, cand = _merge(rb), _merge(rc)
    names = list(dict.fromkeys([k["name"] for k in base["kernels"]] + [k["name"] for k in cand["kernels"]]))
    b = {k["name"]: k for k in base["kernels"]}
    c = {k["name"]: k for k in cand["kernels"]}
    kernels = [KernelDelta(n, float(b.get(n, {}).get("ms", 0.0)), float(c.get(n, {}).get("ms", 0.0)),
                           float(b.get(n, {}).get("launches", 0.0)), float(c.get(n, {}).get("launches", 0.0)))
               for n in names]
    kernels.sort(key=lambda k: -abs(k.delta_ms))
    kb, kc = float(base["device_ms"]), float(cand["device_ms"])
    lb, lc = float(base["launches"]), float(cand["launches"])
    gap = _gap(bms, kb, lb, whole_step)
    # the noise of the mean paired saving: each round's own (its steps' spread), and the rounds'
    # spread about each other (what load left after the pairing)
    within = sum(n * n for _, n in rounds) / len(rounds) ** 2
    between = statistics.variance([x for x, _ in rounds]) / len(rounds) if len(rounds) >= 2 else 0.0
    return CellAccount(id=cid, verdict=measured.get("verdict"), base_ms=bms, cand_ms=cms, kernel_base_ms=kb,
                       kernel_cand_ms=kc, launches_base=lb, launches_cand=lc, gap_ms=gap,
                       noise_ms=math.sqrt(within + between), kernels=kernels,
                       paired=[x for x, _ in rounds] if len(rounds) >= 2 else [])


def _vanished(a: CellAccount) -> str | None:
    gone = [k for k in a.kernels if k.change == "removed" and k.name != HOST_ROW
            and k.base_ms >= VANISHED_SHARE * a.kernel_base_ms]
    if not gone:
        return None
    took = sum(k.cand_ms for k in a.kernels if k.change == "added") + sum(
        max(0.0, k.delta_ms) for k in a.kernels if k.change == "kept" and k.name != HOST_ROW)
    lost = sum(k.base_ms for k in gone)
    if took >= TAKEN_OVER * lost:
        return None
    names = ", ".join(f"{k.name} ({k.base_ms:.4g} ms, {k.base_ms / a.kernel_base_ms:.0%} of the base step)" for k in gone)
    return (f"{names} no longer run{'s' if len(gone) == 1 else ''}, and nothing took over the work "
            f"(new or grown kernels: {took:.4g} ms, under {TAKEN_OVER:.0%} of it)")


def _out_of_bounds(label: str, low: float | None, high: float | None, point: float | None,
                   rounds: list[float] | None = None) -> str | None:
    lo_b, hi_b = SHARE_BOUNDS
    if point is None or low is None or high is None:
        return None
    if rounds and (high < lo_b or low > hi_b) and not all(r < lo_b for r in rounds) \
            and not all(r > hi_b for r in rounds):
        return None  # the rounds disagree: `_unsure` says so
    if high < lo_b:
        return (f"{label}: the kernels account for {point:.0%} [{low:.0%}, {high:.0%}] of the measured saving, "
                f"below {lo_b:.0%}: most of the win is nowhere in the kernels the profiler sees")
    if low > hi_b:
        return (f"{label}: the kernels account for {point:.0%} [{low:.0%}, {high:.0%}] of the measured saving, "
                f"above {hi_b:.0%}: the profiled step is not what the bench timed")
    return None


def _unsure(label: str, low: float | None, high: float | None, point: float | None,
            rounds: list[float]) -> str | None:
    """Where the profile cannot decide: the share's interval reaches past a bound while its point or a
    round lies inside (or the rounds fall on both sides of one)."""
    lo_b, hi_b = SHARE_BOUNDS
    if point is None or low is None or high is None or (lo_b <= low and high <= hi_b):
        return None
    each = f" (rounds: {', '.join(f'{r:.0%}' for r in rounds)})" if rounds else ""
    return (f"{label}: unsure, not refused: the kernels account for {point:.0%} [{low:.0%}, {high:.0%}] of the measured "
            f"saving{each}; the profile is too noisy to decide; `flaloop explain OP --steps 50` on a quieter machine")


def _won(m: dict, margin: float) -> bool:
    """A cell the measurement calls a win: its whole CI above 1 + margin (the verdict may still be
    UNSURE after Holm's correction over the family; the interval is what a keep rests on)."""
    return bool(m.get("ci_low") and m["ci_low"] > 1 + margin and m.get("base_ms") and m.get("cand_ms")
                and m["base_ms"] > m["cand_ms"])


def account(profiled: dict, vs_cells: list[dict], margin: float = 0.005, whole_step: bool = False) -> dict:
    """The whole accounting: per cell, over the cells that won, and the findings that block a go.

    `profiled`: {"base": {cell id: table}, "cand": {...}}; `vs_cells`: the iteration's vs-base cells
    (rules.compare). The cells checked are those whose CI lies above 1 + margin; when none does
    (a geomean of many small wins), the total is over every cell that got faster. `whole_step`: the
    profile ran on the host, where it sees the whole step (see the module's doc)."""
    cells, findings = [], []
    any_won = any(_won(m, margin) for m in vs_cells if m["id"] in profiled["base"] and m["id"] in profiled["cand"])
    for m in vs_cells:
        cid = m["id"]
        if cid not in profiled["base"] or cid not in profiled["cand"]:
            continue
        a = account_cell(cid, profiled["base"][cid], profiled["cand"][cid], m, whole_step)
        a.checked = _won(m, margin)
        if not any_won and a.saved_ms and a.saved_ms > 0:
            cells.append(a)  # in the total only: no single cell's share is resolved enough to hold it
            a.finding = _vanished(a)
            if a.finding:
                findings.append(Finding(rule=RULE, severity=BLOCK, message=a.finding, why=WHY, fix=FIX, cell=cid))
            continue
        if a.checked:
            a.finding = _out_of_bounds(cid, a.share(-NOISE_Z), a.share(NOISE_Z), a.share(), a.round_shares())
            a.unsure = None if a.finding else _unsure(cid, a.share(-NOISE_Z), a.share(NOISE_Z), a.share(),
                                                      a.round_shares())
        a.finding = a.finding or _vanished(a)
        if a.finding:
            findings.append(Finding(rule=RULE, severity=BLOCK, message=a.finding, why=WHY, fix=FIX, cell=cid))
        cells.append(a)
    checked = [a for a in cells if a.checked] or [a for a in cells if not any_won and a.saved_ms and a.saved_ms > 0]
    total: dict | None = None
    if checked:
        saved = sum(a.saved_ms for a in checked)
        expl = sum(a.explained_ms for a in checked)
        noise = math.sqrt(sum(a.noise_ms ** 2 for a in checked))
        n_rounds = min(len(a.paired) for a in checked)
        rounds = [sum(a.paired[r] for a in checked) / saved for r in range(n_rounds)] if saved > 0 else []
        total = {"cells": [a.id for a in checked], "saved_ms": saved, "explained_ms": expl, "share": expl / saved,
                 "share_low": (expl - NOISE_Z * noise) / saved, "share_high": (expl + NOISE_Z * noise) / saved,
                 "round_shares": rounds}
        label = "over the cells that won"
        why = _out_of_bounds(label, total["share_low"], total["share_high"], total["share"], rounds)
        if why:
            findings.append(Finding(rule=RULE, severity=BLOCK, message=why, why=WHY, fix=FIX))
        else:
            total["unsure"] = _unsure(label, total["share_low"], total["share_high"], total["share"], rounds)
    missing = [m["id"] for m in vs_cells if m["id"] not in {a.id for a in cells}]
    unsure = [a.unsure for a in cells if a.unsure] + ([total["unsure"]] if total and total.get("unsure") else [])
    return {"cells": [a.to_dict() for a in cells], "total": total, "not_profiled": missing,
            "findings": [f.to_dict() for f in findings], "blocked": bool(findings), "unsure": unsure,
            "bounds": {"share": list(SHARE_BOUNDS), "noise_z": NOISE_Z, "vanished_share": VANISHED_SHARE,
                       "taken_over": TAKEN_OVER}}


# -- taking the profile ------------------------------------------------------------------------------

def latest(ws: Workspace, base_commit: str, cand_commit: str, record: str | None = None) -> dict | None:
    """The newest explanation of this base and candidate commit (and vs-base record, when given)."""
    found = []
    for p in ws.explain_docs():
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("base_commit") == base_commit and doc.get("cand_commit") == cand_commit \
                and (record is None or doc.get("record") == record):
            found.append({**doc, "_path": str(p)})
    return found[-1] if found else None


def _orders(rounds: int) -> list[tuple[str, str]]:
    """The sides' order in each round: base first, then the candidate first, and so on (ABBA), so that
    load that rises or falls over the profile moves both sides alike."""
    return [("base", "cand") if r % 2 == 0 else ("cand", "base") for r in range(rounds)]


def _run_side(python: str, tree: Path, registry: Path, op: str, cells: list[dict], out: Path, side: str,
              steps: int, device: str | None, env: dict, timeout: float,
              on_cell: Callable[[str], None] | None = None) -> dict:
    cmd = [python, str(SCRIPT), "--tree", str(tree), "--registry", str(registry), "--op", op,
           "--cells", json.dumps(cells), "--steps", str(steps), "--out", str(out), "--side", side]
    if device:
        cmd += ["--device", device]
    data = profiling.run_step_script(cmd, tree, env, timeout, out / f"cells-{side}.json", side, on_cell=on_cell)
    profiling.check_provenance(data.get("hello"), tree, op, side)
    return data


def take(target, contract, iteration, *, steps: int = DEFAULT_STEPS, device: str | None = None,
         command: str = "", timeout: float = 3600, on_event: Callable[..., None] | None = None) -> dict:
    """Profile the cells of `iteration`'s vs-base measurement on the base and on the iteration's
    commit, account for the measured saving, and write `explain/<stamp>/explain.json`."""
    say = on_event or (lambda *a, **k: None)
    vs = iteration.vs_base or {}
    if not vs.get("record"):
        raise UsageError(f"iteration {iteration.iter} has no measurement against the base to explain",
                         "keep an iteration first (`flaloop iter`)")
    ws = target.workspace(contract.op)
    rec_path = ws.path_of(vs["record"])
    rec = record_mod.read(rec_path)
    cells = [model_mod.Cell.from_dict(c.cell.to_dict()) for c in rec.cells if c.status == "ok"]
    cfg = model_mod.BenchConfig(inputs=dict(rec.config.inputs or {}), seed=rec.config.seed, sample_ms=1.0)
    wires = [c.to_wire(cfg, 1, "eager") for c in cells]
    stamp = clock.now_stamp()
    out = ws.explain / stamp
    out.mkdir(parents=True, exist_ok=True)
    env = profiling.step_env(ws)
    base_commit, cand_commit = vs.get("base_commit") or contract.base_commit, iteration.commit
    sides: dict[str, list[dict]] = {"base": [], "cand": []}
    per_round = max(2, math.ceil(steps / ROUNDS))
    with git.worktree(target.root, base_commit, "explain-base") as base_tree, \
            git.worktree(target.root, cand_commit, "explain-cand") as cand_tree:
        registry = target.worker_registry(contract, base_tree, out)  # both sides read the base's, as the bench does
        trees = {"base": base_tree, "cand": cand_tree}
        for r, order in enumerate(_orders(ROUNDS)):
            for side in order:
                say("side", side=side, cells=len(wires), steps=per_round, round=r + 1, rounds=ROUNDS)
                rdir = out / f"round-{r + 1}"
                rdir.mkdir(exist_ok=True)
                sides[side].append(_run_side(target.python, trees[side], registry, contract.op, wires, rdir, side,
                                             per_round, device, env, timeout,
                                             on_cell=lambda cid, s=side: say("cell", side=s, cell=cid)))
    profiled = {s: {cid: [d["cells"][cid] for d in runs] for cid in runs[0]["cells"]
                    if all(cid in d["cells"] for d in runs)} for s, runs in sides.items()}
    on_gpu = sides["cand"][0].get("device") == "cuda"
    doc = {"kind": "explain", "schema": 1, "op": contract.op, "created": stamp, "command": command,
           "iter": iteration.iter, "base_commit": base_commit, "cand_commit": cand_commit, "record": vs["record"],
           "steps": per_round * ROUNDS, "rounds": ROUNDS, "order": [" then ".join(o) for o in _orders(ROUNDS)],
           "device": sides["cand"][0].get("device"),
           "kernels_are": "CUDA kernels" if on_gpu else
           "host work (no GPU): Triton kernels run by the interpreter, CPU operators and host time outside them",
           **account(profiled, vs.get("cells") or [], vs.get("margin") or 0.005, whole_step=not on_gpu)}
    fsutil.atomic_write_json(out / EXPLAIN_FILE, doc)
    return {**doc, "_path": str(out / EXPLAIN_FILE)}


def for_go(target, contract, iteration, *, steps: int = DEFAULT_STEPS, on_event=None, command: str = "") -> dict:
    """The explanation a go rests on: the recorded one of this iteration and measurement, else a new one."""
    ws = target.workspace(contract.op)
    vs = iteration.vs_base or {}
    have = latest(ws, vs.get("base_commit") or contract.base_commit, iteration.commit, vs.get("record"))
    return have or take(target, contract, iteration, steps=steps, on_event=on_event, command=command)


def go_missing(doc: dict) -> list[tuple[str, str]]:
    """What the explanation leaves missing for a go: (item, why)."""
    if doc.get("blocked"):
        return [("explained win", f"{RULE}: " + "; ".join(f["message"] for f in doc["findings"])
                 + f" (explain.json: {doc.get('_path')})")]
    if doc.get("not_profiled"):
        return [("explained win", "measured cells without a profile on both sides: " + ", ".join(doc["not_profiled"]))]
    if doc.get("total") is None:
        return [("explained win", "no cell that got faster could be profiled on both sides")]
    return []
