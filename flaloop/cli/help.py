"""`--help` in the style of git and pytest: commands grouped in the loop's order, metavars in
capitals (OP, N, REF), a default shown only where the option's text does not say it, examples
after each command, and a command's options grouped under headings (its own first, the
measurement's long tail after, the options every command takes last).

`polish(root)` is applied to the click command that typer builds from the app, once per process
(`cli.main`); the grouping follows the option groups `app.with_options` records on each command.
"""

from __future__ import annotations

import types
import typing

from flaloop.cli.app import app

# which heading an option group's options go under
GROUP_TITLES = {"GateOptions": "Gate options", "BenchOptions": "Measurement options",
                "FlaVerifyFlags": "FLA verify.py spellings", "LockOptions": "Common options"}
COMMON = {"repo", "python", "as_json", "help"}  # every command takes these
METAVARS = {"repo": "DIR", "python": "PYTHON", "out_dir": "DIR", "sweep": "DIR", "to": "DIR", "patches": "FILE",
            "base": "REF", "commit": "REF", "cand_env": "NAME=VALUE", "inputs": "NAME=TRANSFORM",
            "input": "NAME=TRANSFORM", "target_speedup": "SPEEDUP", "k_expr": "EXPR", "gate_k": "EXPR"}
EXAMPLES = {
    "list": ["flaloop list"],
    "init": ["flaloop init chunk_gla --shapes B4_T4096_H16_D128 --target 1.2x",
             "flaloop init chunk_gla --force --keep-base --target 1.3x   # a new target, the same loop"],
    "gate": ["flaloop gate chunk_gla", "flaloop gate chunk_gla -k 'T-64'   # a signal, never a gate"],
    "audit": ["flaloop audit chunk_gla"],
    "baseline": ["flaloop baseline chunk_gla"],
    "iter": ["flaloop iter chunk_gla \"fuse the gate into the chunk loop\"",
             "flaloop iter chunk_gla \"BT=128\" --shapes B4_T4096_H16_D128   # a quick signal"],
    "status": ["flaloop status chunk_gla"],
    "log": ["flaloop log chunk_gla", "flaloop log chunk_gla --restore"],
    "header": ["flaloop header chunk_gla --iter 3"],
    "trap": ["flaloop trap add chunk_gla --fact \"...\" --why \"...\" --how \"...\""],
    "reassess": ["flaloop reassess chunk_gla --profiled \"ncu: ...\" --tried \"...\" --next \"...\" --why \"...\""],
    "dispatch": ["flaloop dispatch add chunk_gla --when 'T<=512' --entry chunk_gla_short --why \"...\"",
                 "flaloop dispatch list chunk_gla"],
    "stop": ["flaloop stop chunk_gla --go", "flaloop stop chunk_gla --no-go --bound \"...\""],
    "report": ["flaloop report chunk_gla", "flaloop report chunk_gla --format github"],
    "bench": ["flaloop bench chunk_gla", "flaloop bench chunk_gla --base main --shapes B4_T4096_H16_D128",
              "flaloop bench chunk_gla --aa   # the base against itself"],
    "verify": ["flaloop verify chunk_gla", "flaloop verify --op chunk_gla --gate-k fwd   # FLA's spelling"],
    "compare": ["flaloop compare 20260101T000000Z-bench 20260102T000000Z-bench --op chunk_gla"],
    "sweep": ["flaloop sweep chunk_gla --candidates opt/a opt/b", "flaloop sweep --ops changed --base main"],
    "model": ["flaloop model chunk_delta_rule --aa", "flaloop model chunk_delta_rule --save   # the contract names the check"],
    "profile": ["flaloop profile chunk_gla --mode fwdbwd"],
    "explain": ["flaloop explain chunk_gla"],
    "sanitize": ["flaloop sanitize chunk_gla --tool memcheck"],
    "clean": ["flaloop clean chunk_gla --dry-run"],
    "skill": ["flaloop skill install", "flaloop skill install --to .claude/skills"],
    "mcp": ["flaloop mcp"],
    "demo": ["flaloop demo"],
}


def metavar(param) -> str:
    """An option's value in capitals: its name's word, N for a count, X for a number."""
    if param.name in METAVARS:
        return METAVARS[param.name]
    ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    kinds = {ann, *typing.get_args(ann)}
    if int in kinds:
        return "N"
    if float in kinds:
        return "X"
    long = next((o for o in param.opts if o.startswith("--")), param.opts[0])
    return long.lstrip("-").replace("-", "_").upper()


def _format_options(groups: dict[str, str]):
    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list] = {"Arguments": [], "Options": []}
        for title in GROUP_TITLES.values():
            sections.setdefault(title, [])
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx)
            if record is None:
                continue
            if p.param_type_name == "argument":
                sections["Arguments"].append(record)
            elif p.name in COMMON:
                sections["Common options"].append(record)
            else:
                sections[GROUP_TITLES.get(groups.get(p.name, ""), "Options")].append(record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    return format_options


def polish(root) -> None:
    """Metavars, true defaults, examples and option headings on every command of `root`."""
    if getattr(root, "_flaloop_polished", False):
        return
    root._flaloop_polished = True  # noqa: SLF001 - a mark on the object this module owns the look of
    callbacks = {ci.name or ci.callback.__name__: ci.callback for ci in app.registered_commands}
    for name, cmd in root.commands.items():
        for p in cmd.params:
            if p.param_type_name == "argument":
                p.metavar = p.metavar or p.name.upper()
                shown = p.metavar + ("..." if p.nargs != 1 else "")
                # OP and [OP] as git and pytest write them, not typer's {op} and `op <str>`
                p._usage_display_name = (lambda n=shown, req=p.required: n if req else f"[{n}]")
                p.display_type_rich = lambda ctx: None
            elif not getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = metavar(p)
            if p.param_type_name == "option" and "(default:" in (p.help or ""):
                p.show_default = False  # the text says what the default is
        if name in EXAMPLES:
            cmd.epilog = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
        groups = getattr(callbacks.get(name), "__option_groups__", {})
        cmd.format_options = types.MethodType(_format_options(groups), cmd)

