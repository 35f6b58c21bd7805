"""`flaloop sweep`: many candidates of one op, or every op a change touches, against one base.

Exit codes: 0 every candidate judged (measured, or blocked by the gate or the guard); 1 (an ops
check) an op is SLOWER beyond the margin on a cell, or blocked; 2 usage: a candidate that is bad
input (unknown ref, patch that does not apply, a duplicate tree, the base itself; the others still
run), more candidates than --max-candidates, ray not installed, an unreachable Ray address;
3 a candidate could not be measured (it does not import, a worker crashed). With --fail-on slower, a
candidate SLOWER on a cell or its geomean turns 0 into 1 (an ops check already exits 1 there).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flaloop.bench.plan import base_ref, tree_ref, working_tree
from flaloop.bench.run import triton_cache
from flaloop.cli.app import (
    LIST,
    FailOnOpt,
    JsonOpt,
    LockOptions,
    PyOpt,
    RepoOpt,
    app,
    command,
    command_line,
    emit_json,
    fail_on_exit,
    human,
    out,
    progress_bar,
    with_options,
)
from flaloop.cli.measure import BenchOptions, parse_gpus
from flaloop.core import clock, git, locks
from flaloop.core.errors import UsageError
from flaloop.core.fsutil import unique_dir
from flaloop.modelcheck import run as modelcheck
from flaloop.report.compare import slower_in_sweep
from flaloop.report.sweep import table_headers, table_rows
from flaloop.report.terminal import print_table
from flaloop.sweep import candidates as cand_mod
from flaloop.sweep import ops as ops_mod
from flaloop.sweep import run as sweep_run
from flaloop.sweep.candidates import Candidate
from flaloop.sweep.record import SweepRecord, SweepRow
from flaloop.task import gate as gate_mod
from flaloop.task.contract import Contract, create
from flaloop.task.target import Target

EXECUTORS = ("local", "ray")


def print_sweep(rec: SweepRecord, console: Console) -> None:
    what = f"{rec.ops[0]}: {len(rec.rows)} candidate(s)" if rec.kind == "candidates" else \
        f"{len(rec.rows)} op(s) the change touches"
    table = Table(title=f"sweep of {what}, against the base {rec.base.commit[:12]}")
    for h in table_headers(rec):
        table.add_column(h, overflow="fold")
    for row in table_rows(rec):
        table.add_row(*row)
    print_table(console, table)
    console.print(f"executor: {rec.executor.get('kind')} ({rec.executor.get('slots')} at a time), {rec.wall_s:.0f} s; "
                  f"margin ±{rec.margin:.1%}")
    if rec.path:
        console.print(f"sweep record: {rec.path} (and sweep.md, sweep.png beside it)")
    top = next((r for r in rec.rows if r.rank == 1), None)
    if top is not None and rec.kind == "candidates":
        console.print(f"next: `flaloop iter {rec.ops[0]} --from-sweep {Path(rec.path).parent} {top.ref}` gates and "
                      "measures the best one again as one iteration (a sweep promotes nothing)")


def _executor(kind: str, address: str | None, target: Target, sweep_dir: Path, gpus: list[str] | None, retries: int,
              cancel, console: Console):
    if kind not in EXECUTORS:
        raise UsageError(f"--executor {kind!r} is not one of {', '.join(EXECUTORS)}")
    if address and kind != "ray":
        raise UsageError("--address goes with --executor ray", "e.g. --executor ray --address ray://head:10001")
    if kind == "local":
        from flaloop.sweep.executors import LocalExecutor

        return LocalExecutor(repo=target.root, home=target.root, run_root=sweep_dir,
                             triton_cache=lambda op: triton_cache(target.workspace(op)), gpus=gpus, cancel=cancel)
    from flaloop.sweep import ray_executor  # imports ray: only here

    return ray_executor.RayExecutor(repo=target.root, address=address, retries=retries, cancel=cancel,
                                    say=lambda m: console.print(m))


def _events(bar, rows: dict[str, SweepRow]):
    tasks: dict[str, int] = {}

    def on_event(kind: str, key: str | None = None, **info) -> None:
        if key is None or key not in rows:
            return
        info = {k: v for k, v in info.items() if v is not None}  # a missing value is left out, never "None"
        name = rows[key].ref if rows[key].kind != "head" else rows[key].op
        if key not in tasks:
            tasks[key] = bar.add_task(f"{name}: queued", total=None, last="")
        t = tasks[key]
        if kind == "start":
            bar.update(t, description=f"{name}: started" + (f" on {info['where']}" if info.get("where") else ""))
        elif kind == "gate":
            bar.update(t, description=f"{name}: gate", last="")
        elif kind == "bench":
            bar.update(t, description=f"{name}: bench", last="")
        elif kind == "warm":
            bar.update(t, description=f"{name}: warm-up", completed=info["index"], total=info["total"], last=info["cell"])
        elif kind == "unseen":
            bar.update(t, description=f"{name}: unseen shapes", completed=info["index"], total=info["total"],
                       last=info["cell"])
        elif kind in ("unseen-options", "test-calls"):
            bar.update(t, description=f"{name}: {'options' if kind == 'unseen-options' else 'test calls'}",
                       completed=info["index"], total=info["total"], last=info["cell"])
        elif kind == "round":
            bar.update(t, description=f"{name}: round {info['round']}/{info['rounds']}", completed=0, total=None)
        elif kind == "pair":
            bar.update(t, description=f"{name}: pairs", completed=info["n"], total=None, last=info["cell"])
        elif kind == "retry":
            bar.update(t, description=f"{name}: retried ({info.get('why', '')[:60]})")
        elif kind == "done":
            said = " ".join(str(info[k]) for k in ("status", "verdict") if info.get(k)) or "done"
            bar.update(t, description=f"{name}: {said}", completed=1, total=1)

    return on_event


def _candidate_entries(target: Target, op: str, refs: list[str], patches: Path | None, bench_options, limit: int,
                       stamp: str):
    c = Contract.load(target, op)
    base = base_ref(target, c, bench_options.base)
    found = cand_mod.resolve(target.root, base, refs, patches, limit=limit, stamp=stamp)
    entries = [sweep_run.Entry.of(c, k) for k in found]
    return c, base, entries


def _op_contract(target: Target, op: str, base, bench_options, console: Console) -> Contract:
    """The op's own contract when it is against this base; else one made for the check (not
    written), with the shapes, modes and input overrides of the op's contract where it has one."""
    try:
        own: Contract | None = Contract.load(target, op)
    except UsageError:
        own = None
    if own is not None and own.base_commit == base.commit:
        return own
    console.print(f"{op}: a contract against {base.commit[:12]} made for this check (not written)")
    return create(target, target.op(op), base_ref=base.commit, speedup=1.0,
                  shapes=bench_options.shape_list() or (own.shapes if own else None), langs=["triton"],
                  modes=own.modes if own else ["fwd", "fwdbwd"], overrides=own.input_overrides if own else {},
                  frozen_may_differ=True)


def _ops_entries(target: Target, spec: str, bench_options, console: Console):
    if not bench_options.base:
        raise UsageError("--ops checks a change against a base: name it", "e.g. --ops changed --base origin/main")
    specs = {o.name: (o.import_path, o.func_name) for o in target.ops()}
    chosen = ops_mod.parse_ops(spec, list(specs))
    base = tree_ref(target.root, bench_options.base)
    head = working_tree(target)
    changed = git.names_between(target.root, base.commit, head.commit)
    if chosen is None:
        with git.worktree(target.root, base.commit, "base") as wt:
            hits = ops_mod.touched(specs, changed, [ops_mod.reader(target.root), ops_mod.reader(wt)])
        for op, files in sorted(hits.items()):
            console.print(f"{op}: the change touches {', '.join(files[:4])}" + (" ..." if len(files) > 4 else ""))
        chosen = sorted(hits)
    entries = []
    for op in chosen:
        c = _op_contract(target, op, base, bench_options, console)
        k = Candidate(key=op, ref=head.ref if not head.dirty else "working tree", kind="head", commit=head.commit,
                      tree=head.tree)
        if k.tree == base.tree:
            k.invalid = f"the head is the base ({base.commit[:12]}): nothing to compare"
        entries.append(sweep_run.Entry.of(c, k))
    return base, entries


@app.command("sweep", context_settings={"allow_extra_args": True})
@command
@with_options(BenchOptions, LockOptions)
def sweep_cmd(
    ctx: typer.Context,
    op: Annotated[str | None, typer.Argument(help="The op whose candidates to sweep (not with --ops).")] = None,
    candidates: Annotated[list[str] | None, typer.Option(
        "--candidates", help="Refs to measure against the base: branches, tags, commits (space- or comma-separated, "
                             "after the op).")] = None,
    patches: Annotated[Path | None, typer.Option(
        "--patches", help="A directory of .diff/.patch files, each applied to the base as one candidate.")] = None,
    ops: Annotated[str | None, typer.Option(
        "--ops", metavar=LIST, help="The pull-request check: changed (every op whose code the diff against --base touches), "
                      "all, or a comma list; the head against the base, per op.")] = None,
    executor: Annotated[str, typer.Option("--executor", help="local (this host's GPUs, or its CPU) or ray.")] = "local",
    address: Annotated[str | None, typer.Option(
        "--address", help="The Ray cluster (ray://host:10001, or host:6379); none: a local Ray instance for the run.")]
    = None,
    gpus: Annotated[str | None, typer.Option("--gpus", metavar=LIST, help="GPUs the local executor uses, e.g. 0,1 (default: all).")]
    = None,
    max_candidates: Annotated[int, typer.Option(
        "--max-candidates", help="Refuse a sweep of more candidates than this.")] = cand_mod.MAX_CANDIDATES,
    retries: Annotated[int, typer.Option(
        "--retries", help="Ray: how often a job whose worker or node died is started again, elsewhere if possible.")]
    = 2,
    rank_by: Annotated[str, typer.Option(
        "--rank-by", help="geomean: the op's (default); model: each measured candidate's `flaloop model` step-time "
                          "speedup, checked one after another on this host (local executor, one op).")] = "geomean",
    regate: Annotated[bool, typer.Option(
        "--regate", help="Run each gate even where a green gate of the same tree state is recorded.")] = False,
    fail_on: FailOnOpt = None,
    bench_options: BenchOptions = None,  # type: ignore[assignment]
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Gate and bench many candidates (or every op a change touches) against one base, in parallel over
    the GPUs; a ranked table, a sweep record and a plot. Never commits; promote with `iter --from-sweep`."""
    console = human(as_json)
    extra = [a for a in ctx.args if a]
    bad = [a for a in extra if a.startswith("-")]
    if bad:
        raise UsageError(f"unknown option(s) {' '.join(bad)}", "see `flaloop sweep --help`")
    refs = [r for item in [*(candidates or []), *extra] for r in item.split(",") if r]
    if extra and candidates is None:
        raise UsageError(f"unexpected argument(s) {' '.join(extra)}", "candidates follow --candidates")
    if ops is not None and (op or refs or patches):
        raise UsageError("--ops checks a change per op: it takes no OP, --candidates or --patches",
                         "either `flaloop sweep OP --candidates ...` or `flaloop sweep --ops changed --base REF`")
    if ops is None and not op:
        raise UsageError("name the op to sweep, or --ops", "e.g. `flaloop sweep OP --candidates opt/a opt/b`")
    if max_candidates < 1:
        raise UsageError(f"--max-candidates {max_candidates}: need at least 1")
    if retries < 0:
        raise UsageError(f"--retries {retries}: need 0 or more")
    if rank_by not in ("geomean", "model"):
        raise UsageError(f"--rank-by {rank_by}: not one of geomean, model")
    if rank_by == "model" and (ops is not None or executor != "local"):
        raise UsageError("--rank-by model ranks the candidates of one op on this host",
                         "name the op and its candidates, with the local executor")
    target = Target.discover(repo, python)
    gpu_list = parse_gpus(gpus)
    root_dir = sweep_run.sweeps_dir(target, op if ops is None else None)
    git.ensure_ignored(target.root, os.path.relpath(root_dir, target.root))
    # the sweep's directory first: its name is the stamp its candidates' refs are kept under
    sweep_dir = unique_dir(root_dir, clock.now_stamp())
    try:
        if ops is None:
            contract, base, entries = _candidate_entries(target, op, refs, patches, bench_options, max_candidates,
                                                         sweep_dir.name)
            cfg = bench_options.config(contract)
            locked = [op]
        else:
            base, entries = _ops_entries(target, ops, bench_options, console)
            if len(entries) > max_candidates:
                raise UsageError(f"{len(entries)} ops, more than --max-candidates {max_candidates}",
                                 f"check fewer (--ops a,b), or raise the limit with --max-candidates {len(entries)}")
            cfg = bench_options.config(entries[0].contract) if entries else None
            locked = sorted({e.contract.op for e in entries})
    except BaseException:
        with contextlib.suppress(OSError):
            sweep_dir.rmdir()
        raise
    if not entries:
        sweep_dir.rmdir()
        if as_json:
            emit_json({"ok": True, "kind": "sweep", "sweep": "ops", "candidates": [], "base": asdict(base),
                       "exit_code": 0})
        else:
            out.print(f"the change against {base.commit[:12]} touches no op's code: nothing to measure")
        raise typer.Exit(0)
    cancel = threading.Event()
    with contextlib.ExitStack() as stack:
        for name in locked:  # in name order: two sweeps over overlapping ops never wait on each other in a circle
            stack.enter_context(locks.workspace_lock(target, name, wait=not lock_options.no_wait, command="sweep",
                                                     on_wait=lambda h, n=name: console.print(locks.waiting_message(h, n))))
        for pid, path in git.reap_stale_worktrees(target.root):
            console.print(f"removed a worktree left by a killed flaloop run (pid {pid}): {path}")
        git.reap_stale_tempdirs()
        try:
            ex = _executor(executor, address, target, sweep_dir, gpu_list, retries, cancel, console)
        except BaseException:  # ray missing, an unreachable address: nothing ran, no empty sweep left
            with contextlib.suppress(OSError):
                sweep_dir.rmdir()
            raise
        stack.callback(ex.close)
        rows = {e.row.key: e.row for e in entries}
        with progress_bar(console) as bar:
            rec = sweep_run.run(target, kind="candidates" if ops is None else "ops", entries=entries, base=base,
                                cfg=cfg, shapes=bench_options.shape_list(), executor=ex, sweep_dir=sweep_dir,
                                regate=regate, gate_workers=_gate_workers(ex),
                                command=command_line(), on_event=_events(bar, rows),
                                say=lambda m: console.print(escape(m)))
            if rank_by == "model":
                modelcheck.rank_sweep(target, contract, rec, on_event=_events(bar, rows),
                                      say=lambda m: console.print(escape(m)))
                sweep_run.save(sweep_dir, rec)
    code = fail_on_exit(sweep_run.exit_code(rec), fail_on, slower_in_sweep(rec.rows), console)
    if as_json:
        emit_json({"ok": True, **rec.to_json(), "exit_code": code})
    else:
        print_sweep(rec, out)
    raise typer.Exit(code)


def _gate_workers(ex) -> int | None:
    """The gate's xdist workers per job: on a GPU host, up to 8 a GPU and one for every two CPU cores
    among the jobs at once (a cold FLA gate is compile-bound); none on the CPU; a Ray node decides
    for itself (None)."""
    devices = getattr(ex, "devices", None)
    if devices is None:
        return None
    return gate_mod.xdist_workers(0 if devices == [None] else 1, sharing=len(devices))
