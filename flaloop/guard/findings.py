"""A guard finding: what was seen, where, why it matters and what to do.

Static rules (guard/static.py) and dynamic probes (bench workers, judged in guard/dynamic.py)
speak this one type, so the CLI, the run record, OPT_LOG and the report print them alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

BLOCK = "block"
WARN = "warn"
SEVERITIES = (BLOCK, WARN)


@dataclass(frozen=True)
class Finding:
    rule: str                 # stable id, e.g. "numeric-tf32"; docs/GUARD.md has a section per id
    severity: str             # "block" or "warn"
    message: str              # what was seen, concretely
    why: str = ""             # why it fakes or risks a win
    fix: str = ""             # what to do instead
    file: str | None = None   # repo-relative path (static rules)
    line: int | None = None
    cell: str | None = None   # bench cell id (probes)
    side: str | None = None   # "base" / "cand" (probes)
    allowed: str | None = None  # the contract's recorded justification, when an --allow covers it

    @property
    def blocking(self) -> bool:
        return self.severity == BLOCK and self.allowed is None

    @property
    def where(self) -> str:
        if self.file:
            return f"{self.file}:{self.line}" if self.line else self.file
        return self.cell or ""

    def to_dict(self) -> dict:
        return {**asdict(self), "blocking": self.blocking, "where": self.where}

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def apply_allowances(findings: list[Finding], allowed: list[dict]) -> list[Finding]:
    """Mark findings covered by the contract's justified exceptions ({"rule": id, "why": text})."""
    by_rule = {a["rule"]: a.get("why", "") for a in allowed or []}
    out = []
    for f in findings:
        why = by_rule.get(f.rule)
        out.append(f if why is None else Finding(**{**asdict(f), "allowed": why or "(no reason given)"}))
    return out
