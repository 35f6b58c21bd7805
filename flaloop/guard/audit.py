"""`flaloop audit`: the static rules over the diff against the base, with the contract's allowances.

The diff is the working tree against the base commit: tracked files that differ (staged or
not), untracked files git would show, and, inside the target package, ignored files that
Python would import (a compiled `*.so` shadows a `.py` of the same name). `profile/` (flaloop's
own workspace) is never part of it. The rules live in guard/static.py and guard/rules/.

Reads files and git only: no target interpreter, no GPU; a few seconds on an FLA checkout.
"""

from __future__ import annotations

import ast
import difflib
import time
from dataclasses import dataclass, field

from flaloop.core import git
from flaloop.guard.findings import Finding, apply_allowances
from flaloop.guard.static import Change, run_static

WORKSPACE = "profile/"
# ignored files inside the package that Python would still import
IMPORTABLE_IGNORED = (".py", ".so", ".pyd")
MOVED = 0.6  # similarity above which an untracked file is a deleted one, moved
STATUS = {"A": "added", "M": "modified", "D": "deleted", "T": "modified", "C": "added", "U": "modified"}


@dataclass
class AuditResult:
    base_commit: str
    findings: list[Finding] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # the files the diff touches
    seconds: float = 0.0
    analysed: list[str] = field(default_factory=list)    # Python files the rules read
    not_loaded: list[str] = field(default_factory=list)  # changed files the op, gate and bench never import
    frozen: list[str] = field(default_factory=list)      # changed frozen files: the gate is red on these
    code_unchanged: bool | None = None  # every change is to comments, docstrings or layout of Python files

    @property
    def blocked(self) -> bool:
        return any(f.blocking for f in self.findings)

    def to_dict(self) -> dict:
        return {"base_commit": self.base_commit, "blocked": self.blocked, "files": self.files,
                "seconds": round(self.seconds, 3), "findings": [f.to_dict() for f in self.findings],
                "analysed": self.analysed, "not_loaded": self.not_loaded, "frozen": self.frozen,
                "code_unchanged": self.code_unchanged,
                "counts": {"block": sum(f.blocking for f in self.findings),
                           "warn": sum(f.severity == "warn" for f in self.findings),
                           "allowed": sum(f.allowed is not None for f in self.findings)}}


def changed_files(target, base_commit: str, package: str) -> list[Change]:
    """Every file the candidate changes relative to `base_commit` (see the module doc)."""
    root = target.root
    out: dict[str, Change] = {}
    for letter, path, old in git.changed_since(root, base_commit):
        status = "modified" if letter == "R" else STATUS.get(letter, "modified")
        out[path] = Change(path, status, base_path=old)
    for path in git.untracked(root):
        out.setdefault(path, Change(path, "untracked"))
    if (root / package).is_dir():
        for path in git.untracked(root, under=package, ignored=True):
            if path.endswith(IMPORTABLE_IGNORED) and "__pycache__" not in path:
                out.setdefault(path, Change(path, "ignored"))
    return _pair_moves(root, base_commit, [c for p, c in sorted(out.items()) if not p.startswith(WORKSPACE)])


def _pair_moves(root, base_commit: str, changes: list[Change]) -> list[Change]:
    """A file moved without git knowing (deleted, and an untracked copy elsewhere) is judged against
    its old self, so moving code is not mistaken for writing it."""
    gone = {c.path: (git.file_at(root, base_commit, c.path) or b"").decode(errors="replace").splitlines()
            for c in changes if c.status == "deleted" and c.path.endswith(".py")}
    if not gone:
        return changes
    out = []
    for c in changes:
        if c.status == "untracked" and c.path.endswith(".py") and (root / c.path).is_file():
            lines = (root / c.path).read_text(errors="replace").splitlines()
            best = max(gone, key=lambda old: difflib.SequenceMatcher(None, gone[old], lines).quick_ratio())
            if difflib.SequenceMatcher(None, gone[best], lines, autojunk=False).ratio() >= MOVED:
                c = Change(c.path, "modified", base_path=best)
        out.append(c)
    return out


def audit(target, contract, base_commit: str | None = None) -> AuditResult:
    """Static rules over the working tree's diff against `base_commit` (default: the contract's)."""
    t0 = time.monotonic()
    base = base_commit or contract.base_commit
    package = contract.import_path.split(".")[0]
    changes = changed_files(target, base, package)
    registry = target.registry_file
    registry_rel = str(registry.relative_to(target.root)) if registry.is_file() else None
    static = run_static(target.root, base, contract, changes, registry=registry_rel)
    findings = apply_allowances(static.findings, getattr(contract, "allowed", []))
    return AuditResult(base_commit=base, findings=findings, files=[c.path for c in changes],
                       seconds=time.monotonic() - t0, analysed=static.analysed, not_loaded=static.not_loaded,
                       frozen=static.frozen, code_unchanged=same_code(target.root, base, changes))


def _code(src: bytes | str) -> str | None:
    """A Python module's syntax tree without its docstrings: what runs, not how it reads."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def same_code(root, base_commit: str, changes: list[Change]) -> bool:
    """Whether the diff leaves the code as it was: every change a modified Python file whose syntax
    tree, docstrings aside, is the base's (comments, docstrings, blank lines, formatting)."""
    for c in changes:
        if c.status != "modified" or not c.path.endswith(".py") or not (root / c.path).is_file():
            return False
        old = git.file_at(root, base_commit, c.base_path or c.path)
        now = _code((root / c.path).read_bytes())
        if old is None or now is None or _code(old) != now:
            return False
    return True
