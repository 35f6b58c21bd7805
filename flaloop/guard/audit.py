"""`flaloop audit`: the static rules over the diff against the base, with the contract's allowances.

(Stub: the rules land in guard/static.py.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flaloop.guard.findings import Finding


@dataclass
class AuditResult:
    base_commit: str
    findings: list[Finding] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # the files the diff touches
    seconds: float = 0.0

    @property
    def blocked(self) -> bool:
        return any(f.blocking for f in self.findings)

    def to_dict(self) -> dict:
        return {"base_commit": self.base_commit, "blocked": self.blocked, "files": self.files,
                "seconds": round(self.seconds, 3), "findings": [f.to_dict() for f in self.findings]}


def audit(target, contract, base_commit: str | None = None) -> AuditResult:
    """Static rules over the working tree's diff against `base_commit` (default: the contract's)."""
    return AuditResult(base_commit or contract.base_commit)
