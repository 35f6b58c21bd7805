"""The user's git state around a CLI call: branch, HEAD, index, the status and contents of every file
outside profile/, the stash list and the worktrees. Commands documented to commit may only move HEAD
forward on the same branch."""

from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

COMMITTING = ("iter", "dispatch", "stop")
_LOCKED_BY = re.compile(r"^locked flaloop pid=(\d+) ")


@dataclass(frozen=True)
class UserState:
    branch: bytes | None
    head: bytes | None
    index: str
    status: tuple[bytes, ...]
    files: tuple[tuple[bytes, str], ...]
    stash: bytes
    worktrees: tuple[tuple[str, int | None], ...]  # (path, flaloop pid that locked it)


def _git_bytes(repo: Path, *args: str) -> bytes | None:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True)
    return proc.stdout if proc.returncode == 0 else None


def user_state(repo: Path) -> UserState | None:
    """What the user has in `repo`; None when it is not a git work tree."""
    if not Path(repo).is_dir() or _git_bytes(repo, "rev-parse", "--is-inside-work-tree") != b"true\n":
        return None
    top = Path(_git_bytes(repo, "rev-parse", "--show-toplevel").decode().strip())

    def mine(path: bytes) -> bool:
        return not path.startswith(b"profile/")

    status = tuple(e for e in (_git_bytes(top, "status", "--porcelain", "-z", "--untracked-files=all") or b"")
                   .split(b"\0") if e and mine(e[3:]))
    files = []
    for rel in (_git_bytes(top, "ls-files", "-z", "--cached", "--others", "--exclude-standard") or b"").split(b"\0"):
        p = top / rel.decode(errors="surrogateescape")
        if rel and mine(rel) and p.is_file() and not p.is_symlink():
            files.append((rel, hashlib.sha256(p.read_bytes()).hexdigest()))
    trees, path = [], None
    for line in (_git_bytes(top, "worktree", "list", "--porcelain") or b"").decode(errors="replace").splitlines():
        if line.startswith("worktree "):
            path = line[len("worktree "):]
            trees.append((path, None))
        elif (m := _LOCKED_BY.match(line)) and trees:
            trees[-1] = (path, int(m.group(1)))
    return UserState(
        branch=_git_bytes(top, "symbolic-ref", "-q", "HEAD"), head=_git_bytes(top, "rev-parse", "-q", "--verify", "HEAD"),
        index=hashlib.sha256(_git_bytes(top, "diff", "--cached", "--binary") or b"").hexdigest(),
        status=status, files=tuple(sorted(set(files))), stash=_git_bytes(top, "stash", "list") or b"",
        worktrees=tuple(trees))


def assert_user_state_kept(repo: Path, before: UserState | None, args, pid: int) -> None:
    """The user's git state after a flaloop process `pid` ran `args` equals `before`."""
    after = user_state(repo)
    if before is None or after is None:
        return
    what = f"`flaloop {' '.join(map(str, args))}`"

    def trees(s: UserState) -> list[str]:
        # Worktrees locked by *other* flaloop runs come and go (a concurrent run, a killed run's
        # leftover that this one reaps); this run's own must be gone when it ends.
        return sorted(p for p, owner in s.worktrees if owner is None or owner == pid)

    assert trees(after) == trees(before), f"{what} left or removed worktrees: {trees(before)} -> {trees(after)}"
    assert after.branch == before.branch, f"{what} switched the branch: {before.branch} -> {after.branch}"
    assert after.stash == before.stash, f"{what} changed the stash list"
    if next((a for a in args if not a.startswith("-")), None) in COMMITTING and after.head != before.head:
        old, new = before.head.decode().strip() if before.head else None, after.head.decode().strip()
        assert old is None or _git_bytes(repo, "merge-base", "--is-ancestor", old, new) is not None, \
            f"{what} moved HEAD to a commit that does not descend from the old HEAD"
        # It may commit the user's change and revert it (a non-keep iteration): every file content
        # the user had must then be in one of the new commits, or be the old HEAD's (already history:
        # `iter --from-sweep` starts from a clean tree and replaces committed files).
        commits = (_git_bytes(repo, "rev-list", f"{old}..{new}" if old else new) or b"").decode().split()
        commits += [old] if old else []
        for rel, digest in sorted(set(before.files) - set(after.files)):
            kept = any(hashlib.sha256(_git_bytes(repo, "show", f"{c}:{rel.decode()}") or b"").hexdigest() == digest
                       for c in commits)
            assert kept, f"{what} lost the user's {rel.decode()}: it is neither in the tree nor in a new commit"
        return
    assert after.files == before.files, f"{what} changed the user's files: " + ", ".join(
        sorted({r.decode() for r, _ in set(after.files) ^ set(before.files)}))
    assert after.head == before.head, f"{what} moved HEAD"
    assert after.index == before.index, f"{what} changed the index"
    assert after.status == before.status, f"{what} changed `git status`: {before.status} -> {after.status}"
