"""`flaloop list` and `flaloop init`: the target's ops, and the task contract."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flaloop import contract as contract_mod
from flaloop.bench import model as model_mod
from flaloop.cli.app import LIST, JsonOpt, LockOptions, PyOpt, RepoOpt, app, command, human, out, with_options
from flaloop.cli.render import print_table
from flaloop.target import Target


@app.command("list")
@command
def list_cmd(repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False) -> None:
    """List the target's ops with their import path and gate test file."""
    target = Target.discover(repo, python)
    ops = target.ops()
    if as_json:
        print(json.dumps({"ok": True, "root": str(target.root), "ops": [
            {**s.to_dict(), "test_file_exists": (target.root / s.test_file).is_file()} for s in ops]}))
        return
    table = Table(title=f"ops in {target.root}")
    for col in ("op", "import path", "gate test file", "from"):
        table.add_column(col, overflow="fold")  # a path is wrapped, never cut
    for s in ops:
        exists = (target.root / s.test_file).is_file()
        test = s.test_file if exists else f"{s.test_file} (missing)"
        table.add_row(s.name, f"{s.import_path}.{s.func_name}", test, s.source)
    print_table(out, table)


# -- init ---------------------------------------------------------------------------------------

@app.command("init")
@command
@with_options(LockOptions)
def init_cmd(
    op: str,
    target_speedup: Annotated[str, typer.Option("--target", help="Speedup goal, e.g. 1.2x.")] = "1.0x",
    shapes: Annotated[list[str] | None, typer.Option("--shapes", help="Registry shape names (repeatable).")] = None,
    base: Annotated[str, typer.Option("--base", help="Base git ref.")] = "HEAD",
    langs: Annotated[str, typer.Option("--langs", metavar=LIST, help="Allowed languages, comma separated.")] = "triton",
    modes: Annotated[str, typer.Option("--modes", metavar=LIST, help="Bench modes, comma separated.")] = "fwd,fwdbwd",
    inputs: Annotated[list[str] | None, typer.Option("--input", help="Override an input transform: k=l2norm, or b=neg:a (minus input a).")] = None,
    varlen: Annotated[bool, typer.Option("--varlen", help="Bench a packed cu_seqlens variant of each shape too.")] = False,
    l2: Annotated[str, typer.Option("--l2", help=model_mod.L2_HELP)] = "rotate",
    max_iters: Annotated[int, typer.Option("--max-iters", help="Iteration cap of the loop.")] = 20,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing contract.")] = False,
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Write the task contract: docs/draft.md and contract.json under profile/<op>-opt/."""
    target = Target.discover(repo, python)
    spec = target.op(op)
    target.test_path(spec)
    shape_list = [s for item in (shapes or []) for s in item.split(",") if s]
    c = contract_mod.create(
        target, spec, base_ref=base, speedup=contract_mod.parse_speedup(target_speedup),
        shapes=shape_list or None, langs=[x for x in langs.split(",") if x],
        modes=[x for x in modes.split(",") if x], overrides=contract_mod.parse_overrides(inputs or []),
        varlen=varlen, max_iters=max_iters, l2=l2)
    with lock_options.hold(target, op, human(as_json), "init"):
        cpath, dpath = contract_mod.write(target, c, force)
    if as_json:
        print(json.dumps({"ok": True, "contract": str(cpath), "draft": str(dpath), **c.to_dict()}))
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
