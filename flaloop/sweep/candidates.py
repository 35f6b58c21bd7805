"""A sweep's candidates: what the user named, as commits, and which of them cannot be measured.

Each candidate is a tree state: a ref (branch, tag, commit) resolved to its commit, or a patch
applied to the base in a temporary index (git.patch_commit). Bad input is reported per
candidate, and the others still run: an unknown ref, a patch that does not apply, a candidate
whose tree is another candidate's (measured once, under the first name) or the base's. Too many
candidates is refused before anything runs. Every candidate's commit is kept under
`refs/flaloop/sweeps/<stamp>/<key>` (a patch's commit has no other name), so that `flaloop iter
--from-sweep` can read it back later; none of this touches a branch, the index or a file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from flaloop.bench.record import TreeRef
from flaloop.core import git
from flaloop.core.errors import UsageError

MAX_CANDIDATES = 16  # each costs a full gate and a paired bench; --max-candidates raises it
PATCH_SUFFIXES = (".diff", ".patch")


@dataclass
class Candidate:
    key: str                  # c01, c02, ...: its directory in the sweep
    ref: str                  # what the user named (a ref, a patch file, or "HEAD" of an op check)
    kind: str = "ref"         # ref | patch | head
    commit: str | None = None
    tree: str | None = None
    invalid: str = ""         # why this input cannot be measured (bad input: exit 2)

    def tree_ref(self) -> TreeRef:
        return TreeRef(commit=self.commit or "", ref=self.ref, tree=self.tree)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Candidate:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _patches(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise UsageError(f"--patches {directory}: not a directory", "give a directory of .diff or .patch files")
    found = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in PATCH_SUFFIXES)
    if not found:
        raise UsageError(f"--patches {directory}: no .diff or .patch file in it",
                         "write each candidate as `git diff BASE > DIR/name.diff`")
    return found


def resolve(root: Path, base: TreeRef, refs: list[str], patches: Path | None, limit: int = MAX_CANDIDATES,
            stamp: str | None = None) -> list[Candidate]:
    """The candidates, in the order given (refs, then the patch files by name)."""
    files = _patches(patches) if patches is not None else []
    n = len(refs) + len(files)
    if n == 0:
        raise UsageError("no candidates: name refs with --candidates or a directory with --patches",
                         "e.g. `flaloop sweep OP --candidates opt/a opt/b`")
    if n > limit:
        raise UsageError(f"{n} candidates, more than --max-candidates {limit}: each costs a full gate and a "
                         "paired bench", f"sweep fewer, or raise the limit with --max-candidates {n}")
    out: list[Candidate] = []
    for i, ref in enumerate(refs, 1):
        c = Candidate(f"c{i:02d}", ref)
        try:
            c.commit = git.resolve_ref(root, ref)
        except UsageError:
            c.invalid = f"unknown ref {ref!r} (not a branch, tag or commit of this repository)"
        out.append(c)
    for j, path in enumerate(files, len(refs) + 1):
        c = Candidate(f"c{j:02d}", str(path), kind="patch")
        try:
            c.commit = git.patch_commit(root, base.commit, path)
        except UsageError as exc:
            c.invalid = exc.message
        out.append(c)
    seen: dict[str, Candidate] = {}
    for c in out:
        if c.invalid:
            continue
        c.tree = git.tree_of(root, c.commit)
        if c.tree == base.tree:
            c.invalid = f"its tree is the base's ({base.commit[:12]}): nothing to compare (the A/A is `flaloop bench OP --aa`)"
        elif c.tree in seen:
            c.invalid = f"the same tree as {seen[c.tree].ref}: measured once, under that name"
        else:
            seen[c.tree] = c
            if stamp:
                git.keep_ref(root, f"sweeps/{stamp}/{c.key}", c.commit)
    return out
