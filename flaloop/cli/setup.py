"""`flaloop list` and `flaloop init`: the target's ops, and the task contract."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flaloop.bench import model as model_mod
from flaloop.cli.app import LIST, JsonOpt, LockOptions, PyOpt, RepoOpt, app, command, human, out, with_options
from flaloop.core import clock, git
from flaloop.core.errors import UsageError
from flaloop.loop import rules, store
from flaloop.report.terminal import print_table
from flaloop.task import contract as contract_mod
from flaloop.task.target import Target


@app.command("list")
@command
def list_cmd(repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False) -> None:
    """List the target's ops with their import path and gate test file."""
    target = Target.discover(repo, python)
    ops = target.ops()
    shapes = {s.name: list(target.shape_configs(s)) for s in ops}  # what `--shapes` takes
    if as_json:
        print(json.dumps({"ok": True, "root": str(target.root), "ops": [
            {**s.to_dict(), "test_file_exists": (target.root / s.test_file).is_file(), "shapes": shapes[s.name]}
            for s in ops]}))
        return
    table = Table(title=f"ops in {target.root}")
    for col in ("op", "import path", "gate test file", "shapes", "from"):
        table.add_column(col, overflow="fold")  # a path is wrapped, never cut
    for s in ops:
        exists = (target.root / s.test_file).is_file()
        test = s.test_file if exists else f"{s.test_file} (missing)"
        table.add_row(s.name, f"{s.import_path}.{s.func_name}", test, ", ".join(shapes[s.name]) or "-", s.source)
    print_table(out, table, drop=("from", "shapes"))


# -- init ---------------------------------------------------------------------------------------

@app.command("init")
@command
@with_options(LockOptions)
def init_cmd(
    op: str,
    target_speedup: Annotated[str, typer.Option("--target", help="Speedup goal, e.g. 1.2x.")] = "1.0x",
    shapes: Annotated[list[str] | None, typer.Option("--shapes", help="Registry shape names (repeatable).")] = None,
    base: Annotated[str | None, typer.Option("--base", metavar="REF", help="Base git ref (default: HEAD; with "
                                             "--keep-base, the loop's base).")] = None,
    langs: Annotated[str, typer.Option("--langs", metavar=LIST, help="Allowed languages, comma separated.")] = "triton",
    modes: Annotated[str, typer.Option("--modes", metavar=LIST, help="Bench modes, comma separated.")] = "fwd,fwdbwd",
    inputs: Annotated[list[str] | None, typer.Option("--input", help="Override an input transform: k=l2norm, or b=neg:a (minus input a).")] = None,
    varlen: Annotated[bool, typer.Option("--varlen", help="Bench a packed cu_seqlens variant of each shape too.")] = False,
    l2: Annotated[str, typer.Option("--l2", help=model_mod.L2_HELP)] = "rotate",
    max_iters: Annotated[int, typer.Option("--max-iters", help="Iteration cap of the loop.")] = 20,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing contract.")] = False,
    keep_base: Annotated[bool, typer.Option(
        "--keep-base", help="With --force over a loop that has a baseline: keep the loop's base commit; the "
                            "loop goes on.")] = False,
    new_loop: Annotated[bool, typer.Option(
        "--new-loop", help="With --force over a loop that has a baseline: move the base (--base, default HEAD) and "
                           "start a new loop; the old loop's log and records are moved to archive/.")] = False,
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Write the task contract: docs/draft.md and contract.json under profile/<op>-opt/."""
    target = Target.discover(repo, python)
    spec = target.op(op)
    target.test_path(spec)
    if keep_base and new_loop:
        raise UsageError("--keep-base and --new-loop say opposite things about the base", "choose one")
    shape_list = [s for item in (shapes or []) for s in item.split(",") if s]
    ws = target.workspace(op)
    loop_base = rules.baseline_of(store.iterations(ws)) if force else None
    if keep_base and loop_base is not None:
        if base is not None and git.resolve_ref(target.root, base) != loop_base.commit:
            raise UsageError(f"--keep-base keeps the loop's base {loop_base.commit[:12]}, but --base {base} is "
                             f"another commit", "drop --base, or use --new-loop to move the base")
        base = loop_base.commit
    base = base or "HEAD"
    c = contract_mod.create(
        target, spec, base_ref=base, speedup=contract_mod.parse_speedup(target_speedup),
        shapes=shape_list or None, langs=[x for x in langs.split(",") if x],
        modes=[x for x in modes.split(",") if x], overrides=contract_mod.parse_overrides(inputs or []),
        varlen=varlen, max_iters=max_iters, l2=l2)
    archived = None
    with lock_options.hold(target, op, human(as_json), "init"):
        if loop_base is not None and loop_base.commit != c.base_commit:
            if not new_loop:
                raise UsageError(
                    f"the loop of {op} has a baseline at {loop_base.commit[:12]}; --force would move its base to "
                    f"{c.base_commit[:12]} ({base}), and every figure of the loop is against the old one",
                    "add --keep-base to keep the loop's base (the loop goes on), or --new-loop to move the base "
                    "and start a new loop (the old one is archived)")
            archived = ws.archive_loop(clock.name_safe(clock.now_iso()))
        cpath, dpath = contract_mod.write(target, c, force)
    moved = (f"the base moved from {loop_base.commit[:12]} to {c.base_commit[:12]}: a new loop starts (run "
             f"`flaloop baseline {op}`); the old loop's log and records are in {archived}") if archived else None
    if as_json:
        print(json.dumps({"ok": True, "contract": str(cpath), "draft": str(dpath), **c.to_dict(),
                          "new_loop": moved, "archived": str(archived) if archived else None}))
        if moved:
            human(as_json).print(moved)
        return
    out.print(f"contract for [bold]{escape(c.op)}[/]: {escape(c.import_path)}.{escape(c.func_name)} "
              f"in {escape(c.entry_file)}", markup=True)
    out.print(f"  signature: {c.signature}")
    out.print(f"  base: {c.base_ref} = {c.base_commit[:12]}   target: {c.target_speedup:g}x   "
              f"shapes: {', '.join(c.shapes) or '(none)'}")
    table = Table(title="frozen set (hashed at the base commit)")
    table.add_column("file")
    table.add_column("why")
    table.add_column("sha256")
    for f in c.frozen:
        table.add_row(f.path, f.reason, f.sha256[:12])
    out.print(table)
    out.print(f"wrote {cpath.relative_to(target.root)} and {dpath.relative_to(target.root)} "
              f"(git ignores {cpath.parent.relative_to(target.root)}/)")
    if moved:
        out.print(moved)
