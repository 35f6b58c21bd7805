"""Finish a measurement: the analysis, the guard's judgement and the roofline of a session's raw
results, as the run record (bench/record.RunRecord). Pure over its inputs: it measures nothing
and reads no tree, so a record made from a Ray node's measurement is the same as a local one."""

from __future__ import annotations

from flaloop.bench import evidence, roofline
from flaloop.bench.analysis import analyse
from flaloop.bench.measurement import Measurement
from flaloop.bench.plan import MeasurePlan
from flaloop.bench.record import GuardSummary, RunRecord
from flaloop.guard import timing
from flaloop.guard.findings import Finding, apply_allowances


def _static_findings(plan: MeasurePlan) -> list[Finding]:
    return [Finding.from_dict(f) for f in (plan.static or {}).get("findings") or []]


def _guard(plan: MeasurePlan, m: Measurement) -> GuardSummary:
    findings = list(m.run_findings) + _static_findings(plan) + [f for r in m.results for f in r.findings]
    return GuardSummary(blocked=any(f.blocking for f in findings), findings=findings, static=plan.static,
                        integrity=m.integrity, allowed=plan.allowed, probes=plan.config.probes,
                        probe_seconds=round(m.probe_seconds, 3), timed_calls=_timed_calls(m))


def _timed_calls(m: Measurement) -> dict:
    """The timed-call checks (bench/timed.py) with their share of the run's wall time."""
    out = dict(m.timed_calls or {})
    if out:
        out["share"] = round(out.get("seconds", 0.0) / m.wall_s, 4) if m.wall_s else None
    return out


def _below_floor(record: RunRecord, allowed: list[dict]) -> None:
    """A candidate faster than its roofline floor did not do the work: the cell is BLOCKED (only a
    warning when the base is below it too, or the floor is uncertain: guard/timing.floor_uncertain).
    An allowance recorded under the rule's earlier id, implausible-speedup, still applies."""
    if record.aa:
        return
    ceilings = (record.roofline or {}).get("ceilings")
    allowed = list(allowed or []) + [{**a, "rule": "below-floor"} for a in allowed or []
                                     if a.get("rule") == "implausible-speedup"]
    for cell in record.cells:
        roof, cand, base = cell.roofline, cell.summary.cand, cell.summary.base
        if not roof or not roof.floor_ms:
            continue
        f = timing.below_floor(cell.id, cand.median if cand else None, roof.floor_ms, base.median if base else None,
                               timing.floor_uncertain(ceilings, roof.bound, cell.cell.dtype))
        if f is None:
            continue
        (f,) = apply_allowances([f], allowed)
        cell.findings.append(f)
        record.guard.findings.append(f)
        if f.blocking and cell.verdict not in ("BLOCKED", None):
            cell.reason = (cell.reason + "; " if cell.reason else "") + f"guard: below-floor (measured {cell.verdict})"
            cell.verdict = "BLOCKED"
            record.guard.blocked = True
    record.summary.n_blocked = sum(c.verdict == "BLOCKED" for c in record.cells)


def _same_code(record: RunRecord, plan: MeasurePlan) -> None:
    """A clear win where the diff leaves the code as it was (guard/timing.same_code_speedup); not
    with `--cand-env`, whose sides differ on purpose by their environment."""
    if record.aa or plan.config.cand_env or not (plan.static or {}).get("code_unchanged"):
        return
    for cell in record.cells:
        est = cell.estimate
        f = timing.same_code_speedup(cell.id, est.speedup if est else None, est.ci_low if est else None, cell.pairs)
        if f is None:
            continue
        (f,) = apply_allowances([f], plan.allowed)
        cell.findings.append(f)
        record.guard.findings.append(f)
        if f.blocking and cell.verdict not in ("BLOCKED", None):
            cell.reason = (cell.reason + "; " if cell.reason else "") + f"guard: {f.rule} (measured {cell.verdict})"
            cell.verdict = "BLOCKED"
            record.guard.blocked = True
    record.summary.n_blocked = sum(c.verdict == "BLOCKED" for c in record.cells)


def _unseen(plan: MeasurePlan, m: Measurement) -> dict | None:
    """What the warm-up checked on shapes nobody times, with its share of the run's wall time."""
    if m.unseen is None:
        if not plan.unseen:
            return None
        return {**plan.unseen, "off": plan.unseen.get("off") or "not reached: the run ended before the check"}
    out = dict(m.unseen)
    out["share"] = round(out.get("seconds", 0.0) / m.wall_s, 4) if m.wall_s else None
    return out


def _test_calls(plan: MeasurePlan, m: Measurement) -> dict | None:
    """The test's own calls the warm-up replayed, with their share of the run's wall time."""
    if m.test_calls is None:
        if not plan.test_calls:
            return None
        return {**{k: v for k, v in plan.test_calls.items() if k != "calls"},
                "off": plan.test_calls.get("off") or "not reached: the run ended before the check"}
    out = dict(m.test_calls)
    out["share"] = round(out.get("seconds", 0.0) / m.wall_s, 4) if m.wall_s else None
    return out


def finish(plan: MeasurePlan, m: Measurement, *, created: str, gpu: str | None = None) -> RunRecord:
    run_blocked = [f for f in m.run_findings + _static_findings(plan) if f.blocking]
    summary = analyse(m.results, plan.config.margin, plan.config.seed, aa=plan.config.aa, run_blocked=run_blocked)
    record = RunRecord(
        op=plan.op, created=created, command=plan.command, base=plan.base, candidate=plan.candidate,
        config=plan.config, env=dict(m.env), gpu=gpu, host=m.host,
        # where each side imported the op from: a measuring pair's word, or the warm-up pair's
        # when no cell got as far as a round (blocked, refused or failed in the warm-up)
        workers=m.hellos[0] if m.hellos else m.warmup_hellos,
        rounds=[{s: h.get("pid") for s, h in hs.items()} for hs in m.hellos],
        import_s=[{s: h.get("import_s") for s, h in hs.items()} for hs in m.hellos],
        warmup=m.warmup, primed=m.primed, contested=m.contested, restarts=m.restarts,
        gate=plan.gate, unverified=plan.gate is None, interrupted=m.interrupted,
        last_gate=plan.last_gate if plan.gate is None else None,
        errors=list(m.errors), wall_s=m.wall_s, timeline=m.timeline, lean_check=m.lean_check,
        waited_s={k: round(v, 2) for k, v in m.waited.items()}, transfer=m.transfer, unseen=_unseen(plan, m),
        test_calls=_test_calls(plan, m),
        guard=_guard(plan, m), summary=summary, cells=m.results)
    _same_code(record, plan)
    if not m.interrupted and m.env:
        record.env["during"] = evidence.during_evidence(evidence.readings_of(record))
    if m.env and m.env.get("device") == "cuda":
        record.env["contention"] = evidence.contention([p for c in record.cells for p in c.pairs], m.env.get("idle"))
        if m.ceilings_error:
            record.errors.append(f"roofline ceilings not measured: {m.ceilings_error}")
        ceilings = roofline.Ceilings.from_dict(m.ceilings) if m.ceilings else None
        roofline.annotate(record, ceilings, roofline.family_for(plan.registry_entry, plan.op))
        _below_floor(record, plan.allowed)
    return record
