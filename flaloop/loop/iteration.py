"""Phase 1 (`flaloop baseline`) and one iteration of the loop (`flaloop iter`).

An iteration is: refuse early if the repo or the loop is not in a state to take one -> gate (the
full frozen test) -> guard (static audit, then the bench's probes) -> paired bench of the working
tree against the best kept iteration (a worktree of its commit), and against the base when the
best is not the base -> a status from those (rules.decide) -> one commit of the candidate on the
current branch -> a revert commit when the status says so -> the record and its OPT_LOG row.

The gate and the bench are passed in as callables (`Hooks`), so this module decides and records
while the CLI owns progress bars and tables. Nothing is committed or logged until every
measurement is in; an interrupt before that leaves the working tree exactly as it was, and the
commit-revert-record step itself defers Ctrl-C until it is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flaloop.bench.model import Cell, l2_states
from flaloop.core import clock, git
from flaloop.core.errors import GateRed, MeasurementError, RuleRefused, UsageError
from flaloop.core.workspace import Workspace, rel_dir
from flaloop.guard.findings import BLOCK, Finding
from flaloop.loop import records, rules, store, traps
from flaloop.loop.store import Iteration
from flaloop.report import opt_log
from flaloop.task.contract import Contract
from flaloop.task.target import Target

REVERTED = ("revert", "drop", "noise")


@dataclass
class Hooks:
    gate: Callable[[Target, str | None], object]  # (tree to gate, -k expr) -> gate.GateResult
    bench: Callable[[str, bool, dict | None], object]  # (base commit, A/A, gate dict) -> bench.record.RunRecord
    audit: Callable[[], object]  # () -> guard.audit.AuditResult of the working tree
    say: Callable[[str], None] = lambda msg: None


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block is done (a commit without its record, or the reverse,
    would leave the log and the history disagreeing); re-raised as KeyboardInterrupt afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        raise KeyboardInterrupt


def gate_summary(result, ws: Workspace) -> dict:
    d = result.to_dict()
    return {"green": bool(result.green), "signal_only": bool(result.signal_only), "counts": d.get("counts"),
            "k_expr": result.k_expr, "log_path": ws.rel(result.log_path),
            "reasons": [f"{f.kind}: {f.message}" for f in result.findings][:5]}


def guard_summary(audit_result, bench_records: list) -> dict:
    """The audit's findings, the bench probes' findings, and one per cell a probe blocked."""
    findings = [f.to_dict() for f in audit_result.findings]
    blocked = bool(audit_result.blocked)
    for rec in bench_records:
        findings += [f.to_dict() for f in rec.guard.findings]
        blocked = blocked or rec.guard.blocked
        covered = {f.cell for f in rec.guard.findings}
        for cell in rec.cells:
            if cell.verdict == "BLOCKED":
                blocked = True
                if cell.id not in covered:
                    findings.append(Finding("bench-cell-blocked", BLOCK, cell.reason or "blocked",
                                            cell=cell.id, side="cand").to_dict())
    return {"blocked": blocked, "findings": findings}


# -- baseline -----------------------------------------------------------------------------------

def run_baseline(target: Target, contract: Contract, ws: Workspace, hooks: Hooks, *, force: bool,
                 command: str) -> Iteration:
    t0 = time.monotonic()
    iters = store.iterations(ws)
    existing = rules.baseline_of(iters)
    base = contract.base_commit
    archived = None
    if iters and (existing is None or existing.commit != base):
        archived = ws.archive_loop(clock.name_safe(clock.now_iso()))
        hooks.say(f"the log was for another base commit: moved it to {ws.rel(archived)}")
    elif existing and not force:
        raise UsageError(f"a baseline for the base {base[:12]} exists (iteration 0 of {ws.rel(ws.opt_log)})",
                         "pass --force to measure it again (the iterations stay)")
    if not archived and (edits := records.check_doc(ws, ws.opt_log)):
        raise records.HandEdited(ws.opt_log, contract.op, edits)

    tree = git.tree_state(target.root)
    if tree["head"] == base and not tree["dirty"]:
        result = hooks.gate(target, None)
    else:
        hooks.say(f"the gate runs on the base {base[:12]} in a temporary worktree (your tree is not the base)")
        with git.worktree(target.root, base, "base") as wt:
            result = hooks.gate(target.tree(wt), None)
    gate = gate_summary(result, ws)
    if not result.green:
        raise GateRed(f"the gate is red on the base {base[:12]}: {'; '.join(gate['reasons'])}",
                      "the loop needs a green base: fix the base, or choose another (`flaloop init --base`)")
    rec = hooks.bench(base, True, result.to_dict())
    aa = rules.compare(rec, ws.rel(rec.path))
    if not aa["complete"]:
        bad = [f"{c['id']} {c['verdict']}: {c['reason']}" for c in aa["cells"] if c["verdict"] not in rules.MEASURED]
        raise MeasurementError("the base could not be timed on every cell: " + "; ".join(bad + aa["errors"][:1]),
                               f"see {rec.path}; refused cells need an input override (--input)")
    cells = []
    for c in rec.cells:
        eager = c.summary.eager.get("base")
        cells.append({"id": c.id, "timer": c.timer, "device_ms": c.summary.base.median if c.summary.base else None,
                      "eager_ms": eager.median if eager else None, "launch_bound": c.launch_bound})
    it = Iteration(iter=0, direction="baseline", status="baseline", commit=base, best_before=base,
                   created=clock.now_iso(), gate=gate, note=f"A/A {aa['verdict']}: the harness on this machine",
                   wall_s=round(time.monotonic() - t0, 2), command=command,
                   baseline={"record": aa["record"], "env": rec.env, "cells": cells, "aa": aa,
                             "archived": ws.rel(archived)})
    with deferred_interrupt():
        store.save_iteration(ws, it)
    traps.seed(ws, contract.op)
    rewrite_logs(ws, contract)
    return it


# -- one iteration ------------------------------------------------------------------------------

def preflight(target: Target, contract: Contract, ws: Workspace, require_change: bool = True) -> None:
    """Every refusal that can be known before spending a gate and a bench (`require_change` False:
    before the change is put in the tree, by `iter --from-sweep`)."""
    root = target.root
    if git.current_branch(root) is None:
        raise UsageError("HEAD is detached: an iteration is a commit on a branch",
                         "check out a branch first (`git switch -c opt/<op>`)")
    busy = git.operation_in_progress(root)
    if busy:
        raise UsageError(f"{busy} is in progress in {root}", "finish or abort it, then rerun")
    if not git.is_ancestor(root, contract.base_commit, "HEAD"):
        raise UsageError(f"HEAD does not descend from the contract's base {contract.base_commit[:12]}",
                         "iterate on a branch that starts at the base, or rerun `flaloop init --base`")
    if require_change and not git.changed_paths(root):
        raise UsageError("nothing to commit: the working tree equals HEAD",
                         "an iteration is one change: edit the kernel, then run iter")
    who = git.identity_problem(root)
    if who:
        raise UsageError(f"git cannot commit here: {who}", "set user.name and user.email (git config)")
    iters, decisions = store.iterations(ws), store.decisions(ws)
    base = rules.baseline_of(iters)
    if base is None or base.commit != contract.base_commit:
        raise UsageError(f"no baseline for the contract's base {contract.base_commit[:12]}",
                         f"run `flaloop baseline {contract.op}` first (phase 1: the gate and one timed run of the base)")
    timed = {c["id"] for c in (base.baseline or {}).get("cells", []) if "_varlen" not in c["id"]}
    wanted = {Cell(s, {}, m, l2=state).id for s in contract.shapes for m in contract.modes
              for state in l2_states(contract.l2)}
    if timed != wanted:
        raise UsageError("the contract's shapes, modes or L2 states changed since the baseline was timed",
                         f"time the base again: `flaloop baseline {contract.op} --force`")
    edits = records.check_doc(ws, ws.opt_log)
    if edits:
        raise records.HandEdited(ws.opt_log, contract.op, edits)
    tries = rules.attempts(iters)
    if len(tries) >= contract.max_iters:
        raise RuleRefused(f"the iteration cap is reached ({len(tries)} of {contract.max_iters})",
                          f"decide: `flaloop stop {contract.op} --go` or `--no-go --bound \"...\"`; or raise the cap "
                          f"(`flaloop init {contract.op} --force --max-iters N`)")
    stall = rules.stall_count(iters, decisions)
    if stall >= rules.STALL_LIMIT:
        last = [f"#{i.iter} {i.direction} ({i.status})" for i in tries if i.status != "signal"][-stall:]
        raise RuleRefused(f"stalled: {stall} iterations in a row without a keep: {'; '.join(last)}",
                          f"step back and re-assess before the next one: `flaloop reassess {contract.op} "
                          f"--profiled \"...\" --tried \"...\" --next \"...\" --why \"...\"`")


def run_iteration(target: Target, contract: Contract, ws: Workspace, hooks: Hooks, *, direction: str,
                  k_expr: str | None, subset: str | None, note: str, command: str,
                  source: dict | None = None) -> Iteration:
    """One iteration, start to row. `subset` names a shape/mode subset (a signal-only bench);
    `source` where the change came from (a sweep's candidate: sweep/promote.py), kept in the record."""
    t0 = time.monotonic()
    if not direction.strip():
        raise UsageError("the direction is empty", 'say in one line what this change tries, e.g. "BT 64 -> 128"')
    preflight(target, contract, ws)
    root, base = target.root, contract.base_commit
    iters = store.iterations(ws)
    best = rules.best(iters)
    n = rules.next_number(iters)
    before = git.change_fingerprint(root)
    hooks.say(f"iteration {n}: {direction}  (best so far: iteration {best.iter}, {best.commit[:12]})")
    if not git.same_tree(root, "HEAD", best.commit):
        hooks.say(f"note: HEAD's tree differs from the best kept commit {best.commit[:12]}: commits since then "
                  "are part of this candidate")
    signal_why = [w for w in (f"-k {k_expr}" if k_expr is not None else None, subset) if w]

    result = hooks.gate(target, k_expr)
    gate = gate_summary(result, ws)
    audit = hooks.audit()
    benches: list[dict] = []
    vs_best = vs_base = None
    if result.green and not audit.blocked:
        rec = hooks.bench(best.commit, False, result.to_dict())
        benches.append(rec)
        vs_best = rules.compare(rec, ws.rel(rec.path))
        if best.commit == base:
            vs_base = vs_best  # one bench serves both
        elif vs_best["complete"] and not vs_best["blocked"]:
            rec2 = hooks.bench(base, False, result.to_dict())
            benches.append(rec2)
            vs_base = rules.compare(rec2, ws.rel(rec2.path))
    guard = guard_summary(audit, benches)
    guard_reason = "; ".join(f"{f['rule']} at {f.get('where') or '-'}: {f['message']}"
                             for f in guard["findings"] if f.get("blocking", f.get("severity") == BLOCK))
    outcome = rules.decide(gate=gate, guard_blocked=bool(audit.blocked), guard_reason=guard_reason,
                           vs_best=vs_best, signal=bool(signal_why))
    if git.change_fingerprint(root) != before:
        raise UsageError("the working tree changed while the iteration was being measured",
                         "nothing was committed or logged; rerun iter once the tree holds the change to measure")

    worst = None
    g = (vs_best or {}).get("geomean")
    if g and g.get("worst_cell_id"):
        worst = {"id": g["worst_cell_id"], "speedup": g["worst_speedup"]}
    reason = outcome.reason + (f" [signal: {', '.join(signal_why)}]" if signal_why and outcome.status == "signal"
                               else "")
    it = Iteration(iter=n, direction=direction.strip(), status=outcome.status, commit="", best_before=best.commit,
                   created=clock.now_iso(), gate=gate, guard=guard, vs_best=vs_best, vs_base=vs_base, worst_cell=worst,
                   note=f"{note.strip()}; {reason}" if note.strip() else reason, command=command, source=source)
    with deferred_interrupt():
        it.files = git.changed_paths(root)
        it.commit = git.commit_all(root, commit_message(contract, it, best))
        it.wall_s = round(time.monotonic() - t0, 2)
        store.save_iteration(ws, it)
        if it.status in REVERTED:
            pending = [s.commit for s in rules.pending_signals(iters)]
            it.reverted = [it.commit, *pending]
            it.revert_commit = git.revert(root, it.reverted, revert_message(contract, it, best))
            if not git.same_tree(root, it.revert_commit, best.commit):
                it.note += f"; the tree is back at HEAD before the iteration, not at {best.commit[:12]}"
            store.save_iteration(ws, it)
    try:
        rewrite_logs(ws, contract)
    except records.HandEdited as exc:  # the iteration itself is done: say so before the refusal
        exc.message = (f"iteration {n} is recorded ({it.status}) and committed as {it.commit[:12]}, but "
                       f"OPT_LOG.md was not re-rendered: " + exc.message)
        raise
    return it


def _cmp_line(cmp: dict | None) -> str:
    return opt_log.comparison_text(cmp, link=False) if cmp else "not measured"


def commit_message(contract: Contract, it: Iteration, best: Iteration) -> str:
    runs = sorted({c["record"] for c in (it.vs_best, it.vs_base) if c and c.get("record")})
    base_line = ("same bench (the best is the base)" if it.vs_base is it.vs_best and it.vs_best
                 else _cmp_line(it.vs_base))
    return (f"flaloop iter {it.iter} [{it.status}]: {it.direction}\n\n"
            f"Gate: {opt_log.gate_text(it.gate)}\n"
            f"Guard: {'BLOCKED' if it.guard['blocked'] else 'nothing blocking'} "
            f"({len(it.guard['findings'])} finding(s))\n"
            f"vs best (iteration {best.iter}, {best.commit[:12]}): {_cmp_line(it.vs_best)}\n"
            f"vs base ({contract.base_commit[:12]}): {base_line}\n"
            f"Status: {it.status}: {it.note}\n"
            + (f"Run records: {', '.join(f'{rel_dir(contract.op)}/{r}' for r in runs)}\n" if runs else "")
            + f"\nFlaloop-Op: {contract.op}\nFlaloop-Iteration: {it.iter}\nFlaloop-Status: {it.status}\n"
            + (f"Flaloop-Sweep: {it.source['stamp']} {it.source['ref']} {it.source['commit']}\n" if it.source else ""))


def revert_message(contract: Contract, it: Iteration, best: Iteration) -> str:
    undone = ", ".join(c[:12] for c in it.reverted)
    return (f"flaloop iter {it.iter} [{it.status}]: revert \"{it.direction}\"\n\n"
            f"Back to the best kept state, iteration {best.iter} ({best.commit[:12]}).\n"
            f"Reverts {undone}; the attempt stays in the history.\n\n"
            f"Flaloop-Op: {contract.op}\nFlaloop-Iteration: {it.iter}\nFlaloop-Status: {it.status}\n")


def rewrite_logs(ws: Workspace, contract: Contract, *, restore: bool = False) -> list[Path]:
    """OPT_LOG.md (and dispatch.md when it has rows) written afresh from the records (records.render_*);
    the paths of edited files saved aside."""
    saved = []
    dispatch = store.dispatch_rows(ws)
    text = opt_log.render_opt_log(contract, store.iterations(ws), store.decisions(ws), dispatch)
    if p := records.write_doc(ws, ws.opt_log, text, contract.op, restore=restore):
        saved.append(p)
    if dispatch or ws.dispatch_md.exists():
        if p := records.write_doc(ws, ws.dispatch_md, opt_log.render_dispatch(contract, dispatch), contract.op,
                                  restore=restore):
            saved.append(p)
    return saved
