"""The static rules: each check reads one parsed file and yields `Hit`s.

A check sees one version of a file (base or candidate) and reports *everything* it matches;
guard/static.py runs it on both versions and keeps only what the candidate adds, so a check
never needs to know about the diff. A hit's `key` says which occurrences are "the same thing"
across versions (e.g. `cast:torch.bfloat16`): the base's count of a key is the candidate's
allowance for it.

A new rule: a `Rule` in guard/catalogue.py, and a check function in a sibling module, in that
module's CHECKS list (a new module goes into `CHECKS` below). What a check is, and what it yields
(`Hit`, `FileContext`, `Check`), is guard/rules/check.py.
"""

from __future__ import annotations

from flaloop.guard.rules import delegation, harness, numeric, state
from flaloop.guard.rules.check import Check, FileContext, Hit
from flaloop.guard.source import Source

CHECKS: list[Check] = [*numeric.CHECKS, *delegation.CHECKS, *state.CHECKS, *harness.CHECKS]


def run_checks(src: Source, ctx: FileContext) -> list[Hit]:
    if src.tree is None:
        return []
    hits: list[Hit] = []
    for check in CHECKS:
        hits.extend(check(src, ctx))
    return hits
