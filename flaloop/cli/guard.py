"""`flaloop audit`: the guard's static rules over the diff, and justified exceptions to them.

`print_findings(findings, console)` is how every command shows guard findings (static or probe).
"""

from __future__ import annotations

import difflib
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from flaloop.cli.app import JsonOpt, PyOpt, RepoOpt, app, command, emit_json, human, out
from flaloop.core import git
from flaloop.core.errors import UsageError
from flaloop.guard import catalogue
from flaloop.guard.audit import AuditResult, audit
from flaloop.report.terminal import print_findings
from flaloop.task import contract as contract_mod
from flaloop.task.target import Target


def print_audit(op: str, r: AuditResult, console: Console) -> None:
    n_block = sum(f.blocking for f in r.findings)
    n_warn = sum(f.severity == "warn" for f in r.findings)
    n_allowed = sum(f.allowed is not None for f in r.findings)
    console.print(f"audit {op}: {len(r.files)} changed file(s) against base {r.base_commit[:12]}, "
                  f"{len(r.analysed)} Python file(s) analysed in {r.seconds:.2f}s: "
                  f"{n_block} blocking, {n_warn} warning(s), {n_allowed} allowed")
    print_findings(r.findings, console)
    if r.frozen:
        console.print(Text(f"frozen files changed (the gate is red on these): {', '.join(r.frozen)}", style="red"))
    if r.not_loaded:
        console.print(f"not read as code (neither the op nor the bench imports them): {', '.join(r.not_loaded)}")
    if r.blocked:
        console.print(Text("BLOCKED: no FASTER verdict while a blocking finding stands", style="bold red"))
    else:
        console.print(Text("no blocking finding", style="bold green"))


def record_allowances(target: Target, c: contract_mod.Contract, rules: list[str], whys: list[str],
                      console: Console) -> list[dict]:
    """Validate every --allow/--why pair first, then record them all in the contract, loudly."""
    if whys and not rules:
        raise UsageError("--why goes with --allow RULE", "e.g. --allow numeric-tf32 --why \"the spec asks for TF32\"")
    if not rules:
        return []
    if not whys:
        raise UsageError(f"--allow {' '.join(rules)} without --why: an exception is recorded with its reason, "
                         "never silently", f"add --why \"...\" saying why {c.op} needs it")
    if len(whys) not in (1, len(rules)):
        raise UsageError(f"{len(rules)} --allow but {len(whys)} --why", "give one --why for all, or one per --allow")
    pairs = list(zip(rules, whys if len(whys) == len(rules) else whys * len(rules), strict=True))
    for rule, why in pairs:
        if not catalogue.known(rule):
            close = difflib.get_close_matches(rule, list(catalogue.RULES), n=3, cutoff=0.5)
            raise UsageError(f"unknown guard rule {rule!r}",
                             (f"did you mean {', '.join(close)}? " if close else "") +
                             f"known rules: {', '.join(catalogue.RULES)} (docs/GUARD.md)")
        if rule in catalogue.NEVER_ALLOWED:
            raise UsageError(f"{rule} cannot be allowed: the candidate's results are wrong",
                             "make them agree with the base's (docs/GUARD.md)")
        if not why.strip():
            raise UsageError(f"--why for {rule} is empty", "say why this task needs the exception")
    entries = [c.allow(rule, " ".join(why.split())) for rule, why in pairs]
    path = c.save(target)
    contract_mod.update_draft_allowed(target, c)
    for e in entries:
        console.print(Text(f"ALLOWED: guard rule {e['rule']} no longer blocks {c.op}: \"{e['why']}\"",
                           style="bold yellow"))
    console.print(f"  recorded in {path.relative_to(target.root)} and docs/draft.md; delete the entry there to undo")
    return entries


@app.command("audit")
@command
def audit_cmd(
    op: str,
    base: Annotated[str | None, typer.Option("--base", help="Base git ref (default: the contract's base commit).")] = None,
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", help="Record a justified exception to guard rule RULE in the contract (repeatable; needs --why).")] = None,
    why: Annotated[list[str] | None, typer.Option(
        "--why", help="Why the exception is needed: one for every --allow, or one per --allow.")] = None,
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Static guard rules over the diff against the base; exit 1 on a blocking finding, 0 otherwise."""
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    console = human(as_json)
    recorded = record_allowances(target, c, allow or [], why or [], console)
    base_commit = git.resolve_ref(target.root, base) if base else None
    result = audit(target, c, base_commit)
    if as_json:
        emit_json({"ok": True, "op": op, **result.to_dict(), "recorded_allowances": recorded})
    else:
        print_audit(op, result, out)
    raise typer.Exit(1 if result.blocked else 0)
