"""The loop's commands: baseline, iter, reassess, stop, dispatch, trap, header, status, log.

Parsing and printing only; the decisions live in flaloop/loop/ (rules.py is the rule book).
Exit codes: 0 done (an iteration delivered a status, even revert or noise), 1 a rule said no
(gate red or guard blocked: the iteration is a `drop`; stalled; a stop bar not met; a hand-edited
log row), 2 usage or setup (git state, no baseline, bad condition), 3 measurement failed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from flaloop.bench.record import RunRecord
from flaloop.cli.app import (
    JsonOpt,
    LockOptions,
    PyOpt,
    RepoOpt,
    app,
    command,
    command_line,
    emit_json,
    human,
    out,
    progress_bar,
    with_options,
)
from flaloop.cli.measure import (
    BenchOptions,
    GateOptions,
    gate_plan,
    run_bench_with_progress,
    run_gate_with_progress,
    sanitize_events,
    sanitize_record,
)
from flaloop.cli.report import explain_events
from flaloop.core import clock, git
from flaloop.core.errors import GateRed, MeasurementError, RuleRefused, UsageError
from flaloop.core.workspace import Workspace
from flaloop.diagnose import explain
from flaloop.diagnose.sanitizer import flow as sanitize_mod
from flaloop.loop import bounds, iteration, records, rules, store
from flaloop.loop import condition as cond_mod
from flaloop.loop import header as header_mod
from flaloop.loop import traps as traps_mod
from flaloop.loop.store import Decision, DispatchRow
from flaloop.modelcheck import run as modelcheck
from flaloop.report import fmt, opt_log
from flaloop.report.loop import print_iteration, print_status
from flaloop.report.terminal import print_bench, print_gate
from flaloop.sweep import promote
from flaloop.task.contract import Contract
from flaloop.task.target import Target

EXIT = {"keep": 0, "noise": 0, "revert": 0, "signal": 0, "baseline": 0}


def _setup(op: str, repo: str | None, python: str | None) -> tuple[Target, Contract, Workspace]:
    target = Target.discover(repo, python)
    c = Contract.load(target, op)
    return target, c, target.workspace(op)


def _command_line() -> str:
    return command_line()


def _no_base(opts: BenchOptions, cmd: str) -> None:
    if opts.base:
        raise UsageError(f"--base is not an option of `flaloop {cmd}`",
                         "the loop picks its bases itself: the best kept iteration and the contract's base")


def _hooks(target: Target, c: Contract, bench_opts: BenchOptions, gate_opts: GateOptions,
           console: Console, sanitize: bool = False) -> iteration.Hooks:
    from flaloop.guard import audit as audit_mod

    sanitized: dict = {}  # candidate commit -> sanitize.json: one sanitizer run per candidate

    def gate(tree: Target, k_expr: str | None):
        workers, gpus, _ = gate_plan(gate_opts)
        with progress_bar(console) as bar:
            result = run_gate_with_progress(tree, c, k_expr, None, console, bar, workers, gpus,
                                            regate=gate_opts.regate)
        print_gate(result, console)
        return result

    def bench(base_commit: str, aa: bool, gate: dict | None) -> RunRecord:
        opts = dataclasses.replace(bench_opts, base=base_commit)
        what = "A/A: the base against itself" if aa else f"the working tree against {base_commit[:12]}"
        console.print(f"[bold]bench[/]: {escape(what)}", markup=True)
        with progress_bar(console) as bar:
            record = run_bench_with_progress(target, c, opts, opts.config(c, aa=aa), bar, gate=gate)
        if sanitize and not aa:  # its findings block the record's cells, so rules.compare sees them
            sanitize_record(target, c, record, console, sanitized)
        print_bench(record, console)
        return record

    return iteration.Hooks(gate=gate, bench=bench, audit=lambda: audit_mod.audit(target, c),
                           say=lambda msg: console.print(msg))


# -- baseline and iter --------------------------------------------------------------------------

@app.command("baseline")
@command
@with_options(GateOptions, BenchOptions, LockOptions)
def baseline_cmd(
    op: str,
    force: Annotated[bool, typer.Option("--force", help="Measure the baseline again.")] = False,
    gate_options: GateOptions = None,  # type: ignore[assignment]
    bench_options: BenchOptions = None,  # type: ignore[assignment]
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Phase 1: the full gate on the base, one timed run of the base; OPT_LOG.md with row 0."""
    target, c, ws = _setup(op, repo, python)
    _no_base(bench_options, "baseline")
    if bench_options.shape_list() or bench_options.modes:
        raise UsageError("the baseline times the contract's shapes and modes",
                         f"change them with `flaloop init {op} --force --shapes ... --modes ...`")
    console = human(as_json)
    with lock_options.hold(target, op, human(as_json), "baseline"):
        it = iteration.run_baseline(target, c, ws, _hooks(target, c, bench_options, gate_options, console),
                                    force=force, command=_command_line())
    if as_json:
        emit_json({"ok": True, "iteration": it.to_dict(), "opt_log": str(ws.opt_log), "traps": str(ws.traps_md)})
        return
    out.print(f"baseline of {op} recorded: {opt_log.env_line(it.baseline['env'], it.commit)}")
    for cell in it.baseline["cells"]:
        out.print(f"  {cell['id']}: device {fmt.ms(cell['device_ms'])} ms, eager {fmt.ms(cell['eager_ms'])} ms "
                  f"({cell['timer']})")
    out.print(f"wrote {ws.opt_log} and {ws.traps_md}")
    out.print(f"next: edit the kernel, then `flaloop iter {op} \"<one-line direction>\"`")


def _subset(opts: BenchOptions, c: Contract) -> str | None:
    why = ["--quick (one round, a wide stopping rule)"] if opts.quick else []
    shapes = opts.shape_list()
    if shapes and not set(c.shapes) <= set(shapes):
        why.append(f"shapes {','.join(shapes)} of {','.join(c.shapes)}")
    modes = [m for m in (opts.modes or "").split(",") if m]
    if modes and not set(c.modes) <= set(modes):
        why.append(f"modes {','.join(modes)} of {','.join(c.modes)}")
    return "; ".join(why) or None


@app.command("iter")
@command
@with_options(GateOptions, BenchOptions, LockOptions)
def iter_cmd(
    op: str,
    direction: Annotated[str | None, typer.Argument(
        help="One line: what this change tries (with --from-sweep: the candidate to take, as the sweep names it).")]
    = None,
    gate_k: Annotated[str | None, typer.Option(
        "--gate-k", help="Gate on a pytest -k subset: a signal iteration (never keep, not reverted).")] = None,
    note: Annotated[str, typer.Option("--note", help="A remark for the row.")] = "",
    from_sweep: Annotated[str | None, typer.Option(
        "--from-sweep", help="A sweep (its directory or stamp): put its candidate DIRECTION names in the clean "
                             "working tree, then iterate on it as usual (full gate, a fresh bench, one row, one "
                             "commit).")] = None,
    sanitize: Annotated[bool, typer.Option(
        "--sanitize", help="After the bench, run every contract cell under compute-sanitizer on the base and on "
                           "the candidate; an error only the candidate has blocks (the iteration is a drop).")]
    = False,
    gate_options: GateOptions = None,  # type: ignore[assignment]
    bench_options: BenchOptions = None,  # type: ignore[assignment]
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """One iteration: gate, guard, bench vs the best and the base, one OPT_LOG row, one commit."""
    target, c, ws = _setup(op, repo, python)
    _no_base(bench_options, "iter")
    if not (direction or "").strip():
        raise UsageError("the direction is empty" if not from_sweep else "--from-sweep needs the candidate to take",
                         'say in one line what this change tries, e.g. "BT 64 -> 128"' if not from_sweep else
                         f"e.g. `flaloop iter {op} --from-sweep SWEEP opt/my-branch` (the sweep's table names them)")
    console = human(as_json)
    source = None
    with lock_options.hold(target, op, human(as_json), "iter"):
        if from_sweep:
            source = promote.source(target, op, from_sweep, direction)
            iteration.preflight(target, c, ws, require_change=False)  # every refusal before the tree changes
            files = promote.apply(target, source)
            console.print(f"{source['ref']} ({source['commit'][:12]}) is in the working tree now: {', '.join(files)}")
            direction = f"{source['ref']} (from sweep {source['stamp']})"
            note = "; ".join(x for x in (promote.describe(source), note.strip()) if x)
        try:
            it = iteration.run_iteration(target, c, ws, _hooks(target, c, bench_options, gate_options, console,
                                                               sanitize=sanitize),
                                         direction=direction, k_expr=gate_k, subset=_subset(bench_options, c),
                                         note=note, command=_command_line(), source=source)
        except BaseException:
            if source is not None and git.changed_paths(target.root):
                console.print("the candidate's change is still in the working tree, nothing was committed "
                              "(`git status` lists it)")
            raise
    measured = bool(it.gate and it.gate.get("green")) and not it.guard["blocked"]
    code = EXIT.get(it.status, 3 if measured else 1)
    if as_json:
        emit_json({"ok": True, "exit_code": code, "iteration": it.to_dict(), "row": records.render_row(
            opt_log.iteration_row(it)), "opt_log": str(ws.opt_log)})
    else:
        print_iteration(it, ws, out)
    raise typer.Exit(code)


# -- reassess and stop --------------------------------------------------------------------------

def _require(**texts: str | None) -> None:
    empty = [f"--{k.replace('_', '-')}" for k, v in texts.items() if not (v or "").strip()]
    if empty:
        raise UsageError(f"{', '.join(empty)} must say something", "each is one or two sentences")


def _checked_log(ws: Workspace, c: Contract):
    iters = store.iterations(ws)
    if rules.baseline_of(iters) is None:
        raise UsageError(f"no baseline for {c.op} yet", f"run `flaloop baseline {c.op}` first")
    edits = records.check_doc(ws, ws.opt_log)
    if edits:
        raise records.HandEdited(ws.opt_log, c.op, edits)
    return iters


@app.command("reassess")
@command
@with_options(LockOptions)
def reassess_cmd(
    op: str,
    profiled: Annotated[str, typer.Option("--profiled", help="What was re-profiled, and what it showed.")] = "",
    tried: Annotated[str, typer.Option("--tried", help="Which axes the log shows as tried.")] = "",
    next_: Annotated[str, typer.Option("--next", help="The next direction.")] = "",
    why: Annotated[str, typer.Option("--why", help="Why that direction, given the profile.")] = "",
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Record a re-assessment in OPT_LOG.md; it releases a stalled loop."""
    _require(profiled=profiled, tried=tried, next=next_, why=why)
    target, c, ws = _setup(op, repo, python)
    with lock_options.hold(target, op, human(as_json), "reassess"):
        iters = _checked_log(ws, c)
        decisions = store.decisions(ws)
        stall = rules.stall_count(iters, decisions)
        d = Decision(n=max((x.n for x in decisions), default=0) + 1, kind="reassess",
                     after_iter=max(i.iter for i in iters), created=clock.now_iso(),
                     data={"profiled": profiled.strip(), "tried": tried.strip(), "next": next_.strip(),
                           "why": why.strip(), "directions": rules.tried(iters), "stall_before": stall})
        store.save_decision(ws, d)
        iteration.rewrite_logs(ws, c)
    if as_json:
        emit_json({"ok": True, "decision": d.to_dict(), "opt_log": str(ws.opt_log)})
        return
    out.print(f"re-assessment R{d.n} after iteration {d.after_iter} recorded (stall counter {stall} -> 0)")
    out.print("directions the log shows as tried:")
    for t in d.data["directions"]:
        out.print(f"  #{t['iter']} {t['direction']}: {t['status']} ({fmt.speedup(t['vs_best'])} vs best)")
    out.print(f"next: {d.data['next']}")


@app.command("stop")
@command
@with_options(LockOptions)
def stop_cmd(
    op: str,
    go: Annotated[bool, typer.Option("--go", help="The target is met: stop with a go.")] = False,
    no_go: Annotated[bool, typer.Option("--no-go", help="Stop without reaching the target.")] = False,
    bound: Annotated[str | None, typer.Option(
        "--bound", help="With --no-go: the limit flaloop measured, KIND[@CELL][: note], KIND one of "
                        "roofline, launch, timer, ncu-memory, ncu-sol; flaloop fills in its number from the "
                        "best iteration's records and checks that it binds.")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="With --go: profiled steps per cell when the "
                                                               "explanation must be taken.")] = explain.DEFAULT_STEPS,
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Stop the loop: --go needs a kept iteration that meets the target, kernels that explain its win and a
    clean compute-sanitizer run (both taken here when not yet recorded); --no-go the five-item bar with a
    measured bound."""
    if go == no_go:
        raise UsageError("say --go or --no-go", "--go when a kept iteration meets the target, --no-go otherwise")
    target, c, ws = _setup(op, repo, python)
    console = human(as_json)
    explanation: dict | None = None
    sanitized: dict | None = None
    in_model: dict | None = None
    checked = None
    with lock_options.hold(target, op, console, "stop"):
        iters = store.iterations(ws)
        if rules.baseline_of(iters) is not None and (edits := records.check_doc(ws, ws.opt_log)):
            raise records.HandEdited(ws.opt_log, c.op, edits)
        if go:
            missing = rules.go_missing(iters, store.dispatch_rows(ws), target_speedup=c.target_speedup, shapes=c.shapes,
                                       modes=c.modes, varlen=c.varlen, l2=c.l2)
            if not missing:
                console.print("the go needs kernels that explain the win: the kept iteration against the base ...")
                explanation = explain.for_go(target, c, rules.best(iters), steps=steps, command=_command_line(),
                                             on_event=explain_events(console))
                missing = explain.go_missing(explanation)
            if not missing:
                console.print("... and compute-sanitizer on every cell, the base against the kept commit ...")
                sanitized = sanitize_mod.for_go(target, c, rules.best(iters), command=_command_line(),
                                                on_event=sanitize_events(console))
                missing = sanitize_mod.go_missing(sanitized)
            if not missing and modelcheck.named(c):
                console.print("... and the model check the contract names, the base against the kept commit ...")
                in_model = modelcheck.for_go(target, c, rules.best(iters), command=_command_line())
                missing = modelcheck.go_missing(in_model)
        else:
            checked = bounds.check(ws, iters, bound, c.target_speedup)
            missing = rules.no_go_missing(iters, checked)
        verdict = "go" if go else "no-go"
        if missing:
            msg = (f"stop --{verdict} refused; missing: {', '.join(k for k, _ in missing)}\n"
                   + "\n".join(f"  - {k}: {v}" for k, v in missing))
            if as_json:
                emit_json({"ok": False, "error": msg, "missing": [{"item": k, "why": v} for k, v in missing],
                           "explanation": explanation, "sanitize": sanitized,
                           "bound": checked.__dict__ if checked else None,
                           "exit_code": 1})
                console.print(msg)
                raise typer.Exit(1)
            raise RuleRefused(msg, "`flaloop status` shows where the loop stands")
        best = rules.best(iters)
        decisions = store.decisions(ws)
        data = {"verdict": verdict, "bound": checked.text if checked else None, "iter": best.iter,
                "commit": best.commit, "speedup": rules.speedup_vs_base(best),
                "target": c.target_speedup, "conditions": rules.stop_conditions(iters, c.max_iters),
                "bar": list(rules.NO_GO_ITEMS) if no_go else ["keep", "full gate", "target", "full shape set",
                                                              *(["varlen cells"] if c.varlen else []),
                                                              *(["L2 states"] if c.l2 != "rotate" else []),
                                                              "explained win", "sanitizer",
                                                              *(["model"] if in_model else [])]}
        if checked:
            data["bound_numbers"] = checked.numbers
        if sanitized:
            data["sanitize"] = ws.rel(sanitized.get("path"))
            data["sanitizer_notes"] = {t: e.get("reason") for t, e in (sanitized.get("tools") or {}).items()}
        if in_model:
            data["model"] = ws.rel(in_model.get("path"))
            data["model_step"] = {k: (in_model.get("step") or {}).get(k) for k in ("verdict", "speedup", "predicted")}
        if explanation:
            data["explanation"] = ws.rel(explanation["_path"])
            data["explained_share"] = (explanation.get("total") or {}).get("share")
        d = Decision(n=max((x.n for x in decisions), default=0) + 1, kind="stop",
                     after_iter=max(i.iter for i in iters), created=clock.now_iso(), data=data)
        store.save_decision(ws, d)
        iteration.rewrite_logs(ws, c)
    if as_json:
        emit_json({"ok": True, "decision": d.to_dict(), "opt_log": str(ws.opt_log), "explanation": explanation})
        return
    if go:
        share = data.get("explained_share")
        out.print(f"stop --go recorded: iteration {best.iter} ({best.commit[:12]}) at "
                  f"{fmt.speedup(d.data['speedup'])} vs base, target {c.target_speedup:g}x; the kernels account "
                  f"for {'-' if share is None else f'{share:.0%}'} of the measured saving ({data['explanation']})")
    else:
        out.print(f"stop --no-go recorded: {d.data['bound']}")
    out.print(f"next: flaloop report {op}")


# -- dispatch (phase 3) -------------------------------------------------------------------------

def _entry_defined(target: Target, c: Contract, name: str) -> bool:
    """Whether the op's package directory defines `name` (a def or an assignment)."""
    pkg_dir = (target.root / c.entry_file).parent
    pattern = re.compile(rf"^\s*(def\s+{re.escape(name)}\s*\(|{re.escape(name)}\s*=)", re.M)
    return any(pattern.search(p.read_text(errors="replace")) for p in pkg_dir.rglob("*.py"))


DISPATCH_ACTIONS = ("add", "list")


@app.command("dispatch")
@command
@with_options(BenchOptions, LockOptions)
def dispatch_cmd(
    action: Annotated[str, typer.Argument(metavar="ACTION", help="add (bench the bucket, write the row) or list.")],
    op: Annotated[str, typer.Argument(metavar="OP", help="The op (`dispatch add OP`, as `trap add OP`).")],
    when: Annotated[str | None, typer.Option("--when", help='Bucket condition over B, T, H, D: "T<=512".')] = None,
    entry: Annotated[str | None, typer.Option("--entry", help="The specialized entry point's name.")] = None,
    why: Annotated[str | None, typer.Option("--why", help="Why this bucket gets its own path.")] = None,
    bench_options: BenchOptions = None,  # type: ignore[assignment]
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Phase 3: a shape bucket routed to a specialized entry point, with its measured row in dispatch.md
    (`flaloop dispatch add OP --when ...`, `flaloop dispatch list OP`)."""
    if action not in DISPATCH_ACTIONS and op in DISPATCH_ACTIONS:  # the older order, `dispatch OP add`
        action, op = op, action
        human(True).print(f"note: the order is `flaloop dispatch {action} {op}` (the action first, as `trap add OP`)")
    if action not in DISPATCH_ACTIONS:
        raise UsageError(f"unknown dispatch action {action!r}", "`flaloop dispatch add OP` or `flaloop dispatch list OP`")
    target, c, ws = _setup(op, repo, python)
    if action == "list":
        rows = store.dispatch_rows(ws)
        if as_json:
            emit_json({"ok": True, "rows": [r.to_dict() for r in rows], "dispatch_md": str(ws.dispatch_md)})
        else:
            for r in rows:
                out.print(records.render_row(opt_log.dispatch_row(r)))
        return
    _require(when=when, entry=entry, why=why)
    _no_base(bench_options, "dispatch")
    if bench_options.shape_list():
        raise UsageError("--shapes is not an option of `dispatch add`", "the bucket's condition (--when) picks them")
    cond = cond_mod.Condition.parse(when or "")
    shape_configs = target.shape_configs(target.op(op))
    shapes = cond_mod.bucket(cond, shape_configs)
    if not shapes:
        raise UsageError(f"no registry shape matches --when {cond.text!r}: there is nothing to measure, and a "
                         "dispatch row needs a measurement",
                         "shapes: " + ", ".join(f"{k} {v}" for k, v in shape_configs.items()))
    if not re.fullmatch(r"[A-Za-z_]\w*", entry or ""):
        raise UsageError(f"--entry {entry!r} is not a Python name")
    if not _entry_defined(target, c, entry):
        raise UsageError(f"{entry} is not defined under {(target.root / c.entry_file).parent.relative_to(target.root)}",
                         "write the specialized entry point first; the row records what was measured")
    console = human(as_json)
    with lock_options.hold(target, op, human(as_json), "dispatch"):
        iters = _checked_log(ws, c)
        if edits := records.check_doc(ws, ws.dispatch_md):
            raise records.HandEdited(ws.dispatch_md, c.op, edits)
        opts = dataclasses.replace(bench_options, base=c.base_commit, shapes=[",".join(shapes)])
        console.print(f"[bold]bench[/]: bucket {escape(cond.text)} = {escape(', '.join(shapes))}, the working tree "
                      f"against the base {c.base_commit[:12]}", markup=True)
        with progress_bar(console) as bar:
            record = run_bench_with_progress(target, c, opts, opts.config(c), bar, gate=None)
        print_bench(record, console)
        cmp = rules.compare(record, ws.rel(record.path))
        if cmp["blocked"]:
            raise GateRed("a bench cell of the bucket was blocked (base and candidate disagree): no row written",
                          "fix the specialized path; `flaloop gate` and `flaloop bench` show the cells")
        if not cmp["complete"]:
            raise MeasurementError("the bucket could not be measured on every cell: no row written",
                                   f"see {record.path}")
        if cmp["verdict"] != "FASTER":
            g = cmp["geomean"]
            raise RuleRefused(f"the bucket is {g['speedup']:.4f}x [{g['ci_low']:.4f}, {g['ci_high']:.4f}] "
                              f"{cmp['verdict']} vs the base: a specialization must be measurably faster to "
                              f"earn a row", f"the measurement is kept in {record.path}")
        best = rules.best(iters)
        cand = record.candidate
        cand_env = dict(record.config.cand_env or {})
        # a kept tree ran without the candidate's variables: its measurement is not this one
        same = best.iter if best.status == "keep" and not cand.dirty and not cand_env and git.same_tree(
            target.root, cand.head or cand.commit, best.commit) else None
        rows = store.dispatch_rows(ws)
        row = DispatchRow(
            n=max((r.n for r in rows), default=0) + 1, condition=cond.text, entry=entry, why=(why or "").strip(),
            shapes=shapes, vs_base=cmp, latency=[{"id": x["id"], "base_ms": x["base_ms"], "cand_ms": x["cand_ms"]}
                                                 for x in cmp["cells"]],
            tree={"head": cand.head, "dirty": cand.dirty, "diff_hash": cand.diff_hash},
            after_iter=max(i.iter for i in iters), created=clock.now_iso(), same_as_iter=same, cand_env=cand_env)
        store.save_dispatch(ws, row)
        iteration.rewrite_logs(ws, c)
    if as_json:
        emit_json({"ok": True, "row": row.to_dict(), "dispatch_md": str(ws.dispatch_md)})
        return
    out.print(f"dispatch row {row.n}: {records.render_row(opt_log.dispatch_row(row))}")
    if same is None:
        out.print(f"before `flaloop stop {op} --go`: commit the dispatch with `flaloop iter`, so that the full "
                  "shape set is measured with it")


# -- traps, header, status, log -----------------------------------------------------------------

@app.command("trap")
@command
@with_options(LockOptions)
def trap_cmd(
    action: Annotated[str, typer.Argument(help="add")],
    op: str,
    fact: Annotated[str, typer.Option("--fact", help="What is true.")] = "",
    why: Annotated[str, typer.Option("--why", help="Why it bites.")] = "",
    how: Annotated[str, typer.Option("--how", help="How to apply it.")] = "",
    title: Annotated[str | None, typer.Option("--title", help="A short name (default: the fact's start).")] = None,
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Append a trap (Fact / Why / How to apply) to profile/<op>-opt/TRAPS.md."""
    if action != "add":
        raise UsageError(f"unknown trap action {action!r}", "use `flaloop trap add OP --fact ... --why ... --how ...`")
    _require(fact=fact, why=why, how=how)
    target, c, ws = _setup(op, repo, python)
    last = max((i.iter for i in store.iterations(ws)), default=None)
    source = f"added on {clock.today()}" + (f" after iteration {last}" if last is not None else "")
    name = (title or "").strip() or _short_title(fact)
    with lock_options.hold(target, op, human(as_json), "trap"):
        n = traps_mod.add(ws, op, traps_mod.Trap(name, fact.strip(), why.strip(), how.strip(), source))
    if as_json:
        emit_json({"ok": True, "trap": n, "title": name, "traps": str(ws.traps_md)})
        return
    out.print(f"T{n}. {name} appended to {ws.traps_md}")


def _short_title(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3].rsplit(" ", 1)[0] + "..."


@app.command("header")
@command
def header_cmd(
    op: str,
    iter_n: Annotated[int, typer.Option("--iter", help="A kept iteration.")],
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Print the kept kernel's header: Identity, Delta, Lessons, Dead-ends, Open directions."""
    target, c, ws = _setup(op, repo, python)
    found = traps_mod.parse_traps(ws.traps_md.read_text()) if ws.traps_md.exists() else []
    sections = header_mod.header(c, store.iterations(ws), store.decisions(ws), found, iter_n)
    if as_json:
        emit_json({"ok": True, "iter": iter_n, "sections": sections, "text": header_mod.render(sections)})
        return
    print(header_mod.render(sections), end="")


@app.command("status")
@command
def status_cmd(op: str, repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False) -> None:
    """Where the loop stands: phase, iterations, best, stall counter, last gate, target, next command."""
    target, c, ws = _setup(op, repo, python)
    st = rules.state(store.iterations(ws), store.decisions(ws), store.dispatch_rows(ws), op=op, target_speedup=c.target_speedup,
                     max_iters=c.max_iters, shapes=c.shapes, modes=c.modes, varlen=c.varlen, l2=c.l2)
    edits = records.check_doc(ws, ws.opt_log)
    doc = {"ok": True, "op": op, **st, "opt_log": {"path": str(ws.opt_log), "hand_edits": [e.to_dict() for e in edits]},
           "workspace": {"path": str(ws.path), "usage": ws.usage()}}
    if as_json:
        emit_json(doc)
        return
    print_status(doc, out)


@app.command("log")
@command
@with_options(LockOptions)
def log_cmd(
    op: str,
    restore: Annotated[bool, typer.Option(
        "--restore", help="Render over hand-edited rows (the edited file is saved beside it).")] = False,
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Render OPT_LOG.md (and dispatch.md) from the records; a hand-edited row is reported (exit 1)."""
    target, c, ws = _setup(op, repo, python)
    with lock_options.hold(target, op, human(as_json), "log"):
        saved = iteration.rewrite_logs(ws, c, restore=restore)
    if as_json:
        emit_json({"ok": True, "opt_log": str(ws.opt_log), "saved": [str(p) for p in saved]})
        return
    out.print(f"rendered {ws.opt_log}")
    for p in saved:
        out.print(f"your edited version is kept as {p}")
