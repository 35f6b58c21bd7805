"""The session's warm-up of each cell, in the warm-up pair (which then measures nothing).

For every cell, both sides before any timed sample: set up (build inputs, compile, autotune,
capture and prove the CUDA graph; the base calibrates k), the base's results finite (else the
inputs are outside the op's domain: refused), the candidate's equal to the base's (else blocked)
and no less precise than its dtype's arithmetic explains (`precision-narrowed`), and the guard's
probes on both sides, the mutation probe among them (docs/GUARD.md). Results cross from the
candidate to the base, which judges them (CUDA IPC handles on a GPU, a file otherwise;
inside/worker/outputs.py): nothing of the base's ever reaches the candidate's process. Then, once a run, base against candidate on a few small shapes nobody
times (`check_unseen`; the draw: bench/unseen.py).

Functions of the session's port (bench/port.SessionPort), which holds the workers and the state
they use; a test drives them over scripted fake workers (tests/unit/test_session.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from flaloop.bench.analysis import tuning_differences
from flaloop.bench.model import Cell, CellResult
from flaloop.bench.port import sticky_cuda
from flaloop.bench.workers import WorkerFailed
from flaloop.guard import dynamic
from flaloop.guard.findings import apply_allowances

if TYPE_CHECKING:
    from flaloop.bench.port import SessionPort


def warm_all(s: SessionPort) -> None:
    for i, res in enumerate(s.results):
        s.on_event("warm", cell=res.cell.id, index=i, total=len(s.results))
        try:
            warm_cell(s, res)
            if not s.broken:
                s.release(res)
        except WorkerFailed as exc:
            s.cell_failed(res, exc)
            if not s.restart(exc.message):
                return
        if s.broken and not s.restart(s.broken):
            return
        if s.blocked_run():
            return


def warm_cell(s: SessionPort, res: CellResult) -> None:
    base = s.setup(res, "base", None, "auto")
    res.setup["base"] = base
    if not base.get("ok"):
        return s.fail(res, "base", base)
    nonfinite = {n: c for n, c in base.get("nonfinite", {}).items() if c}
    if nonfinite:
        res.status, res.reason = "refused", (
            "inputs outside the op's domain: the BASE gives non-finite values "
            + ", ".join(f"{n}: {c}" for n, c in nonfinite.items())
            + " (override an input transform in the contract, e.g. --input k=l2norm, or tie one input to "
            "another as the op's tests draw them, e.g. --input b=neg:a)")
        return None
    cand = s.setup(res, "cand", base["k"], "auto")
    res.setup["cand"] = cand
    if not cand.get("ok"):
        return s.fail(res, "cand", cand)
    res.tuning_differs = tuning_differences(base.get("tuning") or {}, cand.get("tuning") or {})
    if cand["timer"] != base["timer"]:  # both sides must be timed the same way
        why = cand.get("capture_error") or base.get("capture_error")
        base = s.setup(res, "base", base["k"], "eager")
        cand = s.setup(res, "cand", base["k"], "eager")
        res.setup.update(base=base, cand=cand, timer_note=f"one side could not be captured: {why}")
        if not (base.get("ok") and cand.get("ok")):
            return s.fail(res, "base" if not base.get("ok") else "cand", base if not base.get("ok") else cand)
    res.timer, res.k = base["timer"], base["k"]
    cmp_ = exchange(s, res, mutated=False)
    if cmp_ is None:
        return None
    res.diff = cmp_
    if not cmp_.get("match"):
        worst = sorted(cmp_.get("tensors", {}).items(), key=lambda kv: -(kv[1].get("rel_rms") or 0))[:3]
        res.status, res.reason = "blocked", (
            "candidate differs from base: " + ", ".join(
                f"{n} rel-RMS {t.get('rel_rms')}, non-finite {t.get('nonfinite_self')}" for n, t in worst))
        res.findings = [dynamic.finding("differs-from-base", res.reason, res.cell.id)]  # never allowable: it is wrong
        return None
    # one side on another backend: the bench would time the switch, not the change
    found = dynamic.backend_findings(res.cell.id, base.get("backends") or {}, cand.get("backends") or {},
                                     cand_env=s.cfg.cand_env)
    # within --diff-tol, and yet more than the dtype's own arithmetic explains: a narrower dtype
    narrowed = dynamic.precision_finding(res.cell.id, res.cell.dtype, cmp_, aa=s.cfg.aa)
    found += [narrowed] if narrowed else []
    if s.cfg.probes:
        probe(s, res, found)
    elif found:
        judge(s, res, found)
    return None


def judge(s: SessionPort, res: CellResult, found: list) -> None:
    """A cell's warm-up findings, under the contract's allowances; a blocking one blocks the cell."""
    res.findings = apply_allowances(found, s.allowed)
    blocking = sorted({f.rule for f in res.findings if f.blocking})
    if blocking:
        res.status, res.reason = "blocked", "guard: " + ", ".join(blocking)


def exchange(s: SessionPort, res: CellResult, mutated: bool) -> dict | None:
    """The candidate's results on set 0 (with `mutated`: on inputs changed in place) judged by the
    base against its own, computed there after the candidate's; None when a side failed (the cell
    is failed). Nothing of the base's reaches the candidate's process: no result, no path, no
    verdict formed there (a candidate that walks its caller's frames finds only its own inputs).
    On a GPU the candidate's results cross as CUDA IPC handles; where that is impossible, as a
    file in the run directory."""
    dump = s.run_dir / f"{'mutated' if mutated else 'dump'}-{s.results.index(res)}.pt"
    share = s.out.transfer["how"] == "cuda-ipc"
    try:
        d = s.ask("cand", "dump", s.cfg.worker_timeout, cell=res.cell.id, path=str(dump), mutated=mutated, share=share)
        if not d.get("ok"):
            return s.fail(res, "cand", d)
        if share and not d.get("shared"):
            s.out.transfer = {"how": "file", "why": d.get("share_error") or "the candidate could not share"}
        subject = {"subject_shared": d["shared"]} if d.get("shared") else {"subject": str(dump)}
        try:
            c = s.ask("base", "compare", s.cfg.worker_timeout, cell=res.cell.id, tol=s.cfg.diff_tol, mutated=mutated,
                      **subject)
        finally:
            if d.get("shared"):
                s.ask("cand", "unshare", 120)
        if c.get("shared_error"):  # the base could not map the handles: the file, from now on
            s.out.transfer = {"how": "file", "why": f"the base could not map them: {c['shared_error']}"}
            return exchange(s, res, mutated)
    finally:
        dump.unlink(missing_ok=True)
    if not c.get("ok"):
        return s.fail(res, "base", c)
    return c


def probe(s: SessionPort, res: CellResult, found: list) -> None:
    """The guard's probes on one cell, judged together with the warm-up's other `found` findings."""
    t0 = time.monotonic()
    try:
        # one side after the other: each alone on the GPU, as the determinism probe must see it
        replies = {}
        for side in s.order():
            replies[side] = s.ask(side, "probe", s.cfg.worker_timeout, cell=res.cell.id)
            if not replies[side].get("ok"):
                return s.fail(res, side, replies[side])
        b, c = replies["base"], replies["cand"]
        mutated = exchange(s, res, mutated=True)
        if mutated is None:
            return None
    finally:
        s.out.probe_seconds += time.monotonic() - t0
    res.probes = {"base": b["probes"], "cand": c["probes"], "mutated": mutated,
                  "seconds": {"base": b.get("seconds"), "cand": c.get("seconds"), "mutated": mutated.get("seconds")}}
    judge(s, res, [*dynamic.cell_findings(res.cell.id, b["probes"], c["probes"], mutated, s.cfg.diff_tol, aa=s.cfg.aa,
                                          cand_env=s.cfg.cand_env), *found])
    return None


# -- shapes nobody times --------------------------------------------------------------------------

def check_unseen(s: SessionPort) -> None:
    """Base against candidate on the plan's unseen shapes (bench/unseen.py), fwd and fwdbwd, once
    per run, in the warm-up pair after its cells (the pair measures nothing and is closed next, so
    what these setups compile, allocate or break touches no measuring process).

    Each (shape, mode) is a cell of its own for the workers (`setup` of a cell spec with the
    shape, the eager timer, one input set, `check_only`: no call, no timing); both sides `dump`
    their results at once, one call each, and the base `compare`s the candidate's dump with its
    own within --diff-tol (relative RMS, no non-finite values), as the differential check does. A
    shape the base refuses, fails on, or gives non-finite values on is skipped and said; one the
    candidate fails on, crashes on, or computes differently is an `unseen-shape-differs` finding
    that blocks the run (never allowable: it is wrong). What ran, the seed and the seconds go into
    `Measurement.unseen`.

    Once per run, not per cell: the shapes belong to the op, not to a cell, and per cell the cost
    would grow with the cells for no more coverage. In an A/A both sides are the base (see
    bench/unseen.py): a difference there is `unstable`, counted and said, never a finding."""
    plan = s.unseen or {}
    t0 = time.monotonic()
    out = {k: plan.get(k) for k in ("n", "seed", "dtype", "tol", "modes", "off", "aa")}
    out.update(shapes=[], checked=0, differ=0, skipped=0, unstable=0, seconds=0.0, stopped=None)
    s.out.unseen = out
    if out["off"]:
        return
    if s.blocked_run():
        out["off"] = "the run was already blocked"
        return
    if not any(r.status == "pending" for r in s.results):  # a win to guard needs a cell to measure
        out["off"] = "no cell passed its warm-up: nothing will be measured"
        return
    if set(s.workers) != {"base", "cand"} or any(w.dead for w in s.workers.values()):
        out["off"] = "no live warm-up pair left to check them"
        return
    found: list = []
    try:
        stop = _check_shapes(s, plan.get("shapes") or [], out, found)
        missing = _off_path(s, out)
        if missing and not stop and plan.get("on_path"):  # the cells' backends ran on none of them
            out["on_path_because"] = missing
            stop = _check_shapes(s, plan["on_path"], out, found, on_path=True)
            missing = _off_path(s, out)
        out["stopped"] = stop
        if missing and not stop:
            out["off_path"] = missing
            found.append(dynamic.finding(
                "unseen-off-path", f"the cells ran {', '.join(missing)}; no unseen shape did, so the check "
                f"compared other code than the code timed", "unseen"))
    finally:
        out["seconds"] = round(time.monotonic() - t0, 3)
        s.broken = None  # the warm-up pair is closed next: a context these shapes broke measures nothing
        # unseen-shape-differs is never allowable: it is wrong; precision-narrowed is, by the contract
        s.add_run_findings(apply_allowances([f for f in found if f.rule == "precision-narrowed"], s.allowed)
                            + [f for f in found if f.rule != "precision-narrowed"])


def _check_shapes(s: SessionPort, shapes: list[dict], out: dict, found: list, on_path: bool = False) -> str | None:
    """Each of `shapes` in each mode, base against candidate, into `out` (the record's `unseen`)
    and `found`; why the check had to stop, or None."""
    todo = [(shp, mode) for shp in shapes for mode in out["modes"]]
    first = sum(len(x["modes"]) for x in out["shapes"])  # dump files and progress continue the count
    for i, (shp, mode) in enumerate(todo, start=first):
        if not out["shapes"] or out["shapes"][-1]["name"] != shp["name"]:
            out["shapes"].append({**shp, "modes": {}, **({"on_path": True} if on_path else {})})
        cid = f"{shp['name']}/{mode}"
        s.on_event("unseen", cell=cid, index=i, total=first + len(todo))
        t1 = time.monotonic()
        served: dict = {}
        verdict, stop = _unseen_one(s, shp, mode, i, served)
        verdict["seconds"] = round(time.monotonic() - t1, 3)
        if served:
            verdict["served"] = served
        if out["aa"] and verdict["status"] == "differs":  # the base against itself: noise, not a wrong candidate
            verdict.update(status="unstable", why="the base differs from itself: " + verdict["why"].split(": ", 1)[-1])
        out["shapes"][-1]["modes"][mode] = verdict
        status = verdict["status"]
        out["checked"] += status in ("match", "differs", "unstable")
        out["differ"] += status == "differs"
        out["skipped"] += status == "skipped"
        out["unstable"] += status == "unstable"
        if verdict.get("narrowed") and not out["aa"]:
            out["narrowed"] = out.get("narrowed", 0) + 1
            found.append(dynamic.finding("precision-narrowed", f"{cid}: {verdict['narrowed']}", f"unseen {cid}"))
        if status == "differs":
            found.append(dynamic.finding("unseen-shape-differs", f"{cid} ({out['dtype']}): {verdict['why']}; "
                                         f"a shape no bench cell or shape config uses (drawn with --unseen-seed "
                                         f"{out['seed']}: the record's `unseen` holds it)", f"unseen {cid}"))
        if stop:
            return stop
    return None


def _off_path(s: SessionPort, out: dict) -> list[str]:
    """The backends ("op.func -> backend") that served a cell's calls on a side but none of that side's
    checked unseen shapes: FLA's verifiers send a small shape elsewhere (the Gluon AttnRes backend takes
    no head dim under 128 bytes), and the check then compares code nobody timed."""
    missing: set[str] = set()
    for side in ("base", "cand"):
        cells = {k for r in s.results for k in dynamic.backend_keys(((r.setup or {}).get(side) or {}).get("backends"))}
        seen = {k for shp in out["shapes"] for v in shp["modes"].values()
                if v.get("status") in ("match", "differs", "unstable") for k in (v.get("served") or {}).get(side, [])}
        missing |= cells - seen
    return sorted(missing)


def _unseen_one(s: SessionPort, shp: dict, mode: str, index: int, served: dict) -> tuple[dict, str | None]:
    """({status: match | differs | skipped, why, worst}, why the check must stop or None) of one
    (shape, mode). Both sides set up at once (inputs only: `check_only`) and make their one call
    each at once, side by side: the candidate dumps its results to a file, the base keeps its own
    in memory (`hold`: no file of the base's that the candidate could wait for); the base then
    compares the candidate's dump with them (no call, and nothing of the judging in the
    candidate's process). A file, not CUDA IPC: the tensors are small. `served` gets, per side, the
    backends that served that one call (inside/worker/backends.served_within)."""
    cell = Cell(shp["name"], dict(shp["shape"]), mode, s.unseen["dtype"], tuple(shp["seqlens"]) if shp.get("seqlens")
                else None)
    wire = {**cell.to_wire(s.cfg, 1, "eager"), "n_sets": 1, "check_only": True}
    dump = s.run_dir / f"unseen-{index}-cand.pt"  # the base's results stay in its memory (`hold`)

    def skipped(why: str, stop: str | None = None):
        return {"status": "skipped", "why": f"the base refuses it: {why[:300]}"}, stop

    def differs(why: str, stop: str | None = None):
        return {"status": "differs", "why": f"the candidate fails where the base computes: {why[:300]}"}, stop

    def failed(replies: dict) -> tuple[dict, str | None] | None:
        for side, verdict in (("base", skipped), ("cand", differs)):  # the base's failure first: then it is a skip
            r = replies[side]
            if not r.get("ok"):
                error = str(r.get("error", "unknown error")).removeprefix("skip:").strip()
                who = "base" if side == "base" else "candidate"
                return verdict(error, f"the {who}'s CUDA context broke" if sticky_cuda(error) else None)
        return None

    def both(cmd: str, payloads: dict) -> tuple[dict, str | None] | dict:
        try:
            replies = s.ask_both(cmd, s.cfg.worker_timeout, payloads)
        except WorkerFailed as exc:
            if exc.side == "base":
                return skipped(f"its worker died: {exc.message}", "the base's worker died")
            if cmd == "dump" and not exc.replies.get("base", {}).get("ok"):  # the base failed its dump too
                return skipped(f"no results (and the candidate's worker died: {exc.message})", "the candidate's worker died")
            return differs(f"its worker died: {exc.message}", "the candidate's worker died")
        return failed(replies) or replies

    live = True
    try:
        got = both("setup", {"base": {"cell": wire}, "cand": {"cell": wire}})
        if isinstance(got, tuple):
            live = got[1] is None
            return got
        got = both("dump", {"base": {"cell": cell.id, "hold": True}, "cand": {"cell": cell.id, "path": str(dump)}})
        if isinstance(got, tuple):
            live = got[1] is None
            return got
        served.update({side: dynamic.backend_keys(got[side].get("backends")) for side in ("base", "cand")})
        try:
            c = s.ask("base", "compare", s.cfg.worker_timeout, cell=cell.id, subject=str(dump), tol=s.cfg.diff_tol)
        except WorkerFailed as exc:
            live = False
            return {"status": "skipped", "why": f"the base's worker died comparing: {exc.message}"}, "the base's worker died"
        if not c.get("ok"):
            return {"status": "skipped", "why": f"the base could not compare: {str(c.get('error'))[:300]}"}, None
        verdict = dynamic.output_verdict(c)
        if verdict["status"] == "match":
            narrowed = dynamic.precision_finding(f"unseen {cell.id}", s.unseen["dtype"], c)
            if narrowed:
                verdict["narrowed"] = narrowed.message
        elif verdict["status"] == "differs":
            verdict["tensors"] = c.get("tensors") or {}
        return verdict, None
    finally:
        dump.unlink(missing_ok=True)
        if live:
            try:
                s.release(CellResult(cell))
            except WorkerFailed:
                pass
