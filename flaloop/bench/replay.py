"""Calls beyond the registry's, base against candidate in the warm-up pair: the test's own calls
recorded at the base (flaloop/task/testcalls.py) and the op's keyword options nobody calls
(bench/options.py).

The gate runs in the candidate's process, where the candidate can loosen the test's judge; the
registry calls the op one way only. Both leave a wrong kernel unseen. Here each call is built on
both sides from one seed (worker/replay.py: fresh values in the recorded dtypes, offsets that stay
valid, the registry's transforms), run forward and backward through every output on both sides at
once, each side's results written to a file, and the base compares the candidate's with its own
within --diff-tol: nothing of the judging happens in the candidate's process.

A call the base refuses (raises, or gives non-finite values) is skipped and named; one the candidate
fails or computes differently is a finding: `test-call-differs`, `unseen-option-differs` (never
allowable: it is wrong). In an A/A both sides are the base: a difference is `unstable`, never a
finding. What ran, with its seconds and its share of the run, goes into the record (`test_calls`,
`unseen.options`). Functions of the session's port (bench/port.SessionPort), after
`warmup.check_unseen`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from flaloop.bench import options as options_mod
from flaloop.bench.port import sticky_cuda
from flaloop.bench.workers import WorkerFailed
from flaloop.guard import dynamic
from flaloop.task import testcalls

if TYPE_CHECKING:
    from flaloop.bench.port import SessionPort


def _ready(s: SessionPort) -> str | None:
    """Why the warm-up pair cannot replay anything now, or None."""
    if s.blocked_run():
        return "the run was already blocked"
    if not any(r.status == "pending" for r in s.results):
        return "no cell passed its warm-up: nothing will be measured"
    if set(s.workers) != {"base", "cand"} or any(w.dead for w in s.workers.values()):
        return "no live warm-up pair left to check them"
    return None


def check_test_calls(s: SessionPort) -> None:
    """The plan's sample of the test's recorded calls, each replayed base against candidate."""
    plan = s.test_calls or {}
    t0 = time.monotonic()
    out = {k: plan.get(k) for k in ("n", "seed", "dtype", "tol", "aa", "off", "recorded")}
    out.update(calls=[], checked=0, differ=0, skipped=0, unstable=0, seconds=0.0, stopped=None)
    s.out.test_calls = out
    out["off"] = out["off"] or _ready(s)
    if out["off"]:
        return
    found: list = []
    backward = plan.get("backward", True)
    try:
        for i, call in enumerate(plan.get("calls") or []):
            what = testcalls.describe(call)
            s.on_event("test-calls", cell=what, index=i, total=len(plan["calls"]))
            payload = {"call": {k: call[k] for k in ("fn", "args", "kwargs")}, "inputs": s.cfg.inputs,
                       "backward": backward}
            verdict, stop = _one(s, payload, seed_of(out["seed"], "call", call["index"]), f"call-{i}", out["aa"])
            out["calls"].append({"index": call["index"], "fn": call["fn"], "call": what, "count": call.get("count"),
                                 **verdict})
            _count(out, verdict)
            if verdict["status"] == "differs":
                found.append(dynamic.finding("test-call-differs", f"{what}: {verdict['why']}; a call the test made at "
                                             f"the base (calls.json #{call['index']}, replayed with --unseen-seed "
                                             f"{out['seed']})", f"test call #{call['index']}"))
            if stop:
                out["stopped"] = stop
                break
    finally:
        out["seconds"] = round(time.monotonic() - t0, 3)
        s.broken = None
        s.add_run_findings(found)


def check_options(s: SessionPort) -> None:
    """The plan's option combinations, each on its unseen shape, base against candidate; into the
    record's `unseen.options`."""
    plan = (s.unseen or {}).get("options")
    if plan is None or s.out.unseen is None:
        return
    t0 = time.monotonic()
    out = {k: plan.get(k) for k in ("n", "params", "left_out", "off")}
    out.update(combos=[], checked=0, differ=0, skipped=0, unstable=0, seconds=0.0, stopped=None)
    s.out.unseen["options"] = out
    out["off"] = out["off"] or s.out.unseen.get("off") or _ready(s)
    if out["off"]:
        return
    found: list = []
    aa = bool(s.unseen.get("aa"))
    backward = "fwdbwd" in (s.unseen.get("modes") or [])
    try:
        for i, combo in enumerate(plan.get("combos") or []):
            what = options_mod.label(combo)
            s.on_event("unseen-options", cell=what, index=i, total=len(plan["combos"]))
            wire, why = options_mod.wire_options(combo, plan.get("params") or [])
            entry = {"options": combo["options"], "shape": combo["shape"]["name"], "tests": combo.get("tests", False)}
            if wire is None:
                verdict, stop = {"status": "skipped", "why": why}, None
            else:
                shp = combo["shape"]
                cell = {"id": f"options-{i}", "shape": dict(shp["shape"]), "seqlens": shp.get("seqlens"),
                        "mode": "fwdbwd", "dtype": s.unseen.get("dtype") or s.cfg.dtype, "seed": 0,
                        "inputs": s.cfg.inputs}
                payload = {"cell": cell, "options": wire, "backward": backward}
                verdict, stop = _one(s, payload, seed_of(s.unseen.get("seed") or 0, "options", i), f"options-{i}", aa)
            out["combos"].append({**entry, **verdict})
            _count(out, verdict)
            if verdict["status"] == "differs":
                found.append(dynamic.finding("unseen-option-differs", f"{what}: {verdict['why']}; options the registry "
                                             f"never sets (drawn with --unseen-seed {s.unseen.get('seed')}: the record's "
                                             f"`unseen.options` holds them)", f"options {what}"))
            if stop:
                out["stopped"] = stop
                break
    finally:
        out["seconds"] = round(time.monotonic() - t0, 3)
        s.out.unseen["seconds"] = round((s.out.unseen.get("seconds") or 0.0) + out["seconds"], 3)
        s.broken = None
        s.add_run_findings(found)


def seed_of(seed, kind: str, i: int) -> int:
    """The seed of one replayed call: the run's seed, the kind and the call's number."""
    import hashlib

    h = hashlib.sha256(f"flaloop-replay:{int(seed or 0)}:{kind}:{int(i)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _count(out: dict, verdict: dict) -> None:
    status = verdict["status"]
    out["checked"] += status in ("match", "differs", "unstable")
    out["differ"] += status == "differs"
    out["skipped"] += status == "skipped"
    out["unstable"] += status == "unstable"


def _one(s: SessionPort, payload: dict, seed: int, tag: str, aa: bool) -> tuple[dict, str | None]:
    t0 = time.monotonic()
    verdict, stop = _pair(s, payload, seed, tag)
    verdict["seconds"] = round(time.monotonic() - t0, 3)
    if aa and verdict["status"] == "differs":  # the base against itself: noise, not a wrong candidate
        verdict.update(status="unstable", why="the base differs from itself: " + verdict["why"].split(": ", 1)[-1])
    return verdict, stop


def _pair(s: SessionPort, payload: dict, seed: int, tag: str) -> tuple[dict, str | None]:
    """({status: match | differs | skipped, why, worst}, why the checks must stop or None): both
    sides replay the call at once, each into its own file; the base compares the two files."""
    dumps = {side: s.run_dir / f"{tag}-{side}.pt" for side in ("base", "cand")}

    def stop_if(error: str, who: str) -> str | None:
        return f"the {who}'s CUDA context broke" if sticky_cuda(error) else None

    try:
        try:
            replies = s.ask_both("replay", s.cfg.worker_timeout,
                                 {side: {**payload, "seed": seed, "path": str(p)} for side, p in dumps.items()})
        except WorkerFailed as exc:
            if exc.side == "base" or not exc.replies.get("base", {}).get("ok"):
                return {"status": "skipped", "why": f"the base's worker died on it: {exc.message[:300]}"}, \
                    f"the {exc.side} worker died"
            return {"status": "differs", "why": f"the candidate's worker died on it: {exc.message[:300]}"}, \
                "the candidate's worker died"
        b, c = replies["base"], replies["cand"]
        if not b.get("ok"):
            error = str(b.get("error", "unknown error"))
            return {"status": "skipped", "why": f"the base refuses it: {error[:300]}"}, stop_if(error, "base")
        if not c.get("ok"):
            error = str(c.get("error", "unknown error"))
            return {"status": "differs", "why": f"the candidate fails where the base computes: {error[:300]}"}, \
                stop_if(error, "candidate")
        try:
            cmp_ = s.ask("base", "compare", s.cfg.worker_timeout, ref=str(dumps["base"]), subject=str(dumps["cand"]),
                         tol=s.cfg.diff_tol)
        except WorkerFailed as exc:
            return {"status": "skipped", "why": f"the base's worker died comparing: {exc.message}"}, "the base's worker died"
        if not cmp_.get("ok"):
            return {"status": "skipped", "why": f"the base could not compare: {str(cmp_.get('error'))[:300]}"}, None
        return dynamic.output_verdict(cmp_), None
    finally:
        for p in dumps.values():
            p.unlink(missing_ok=True)
