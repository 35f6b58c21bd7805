"""Git, read-only towards the user's work.

Nothing here checks out, stashes or resets the user's working tree. Other revisions are
materialised as detached worktrees in temporary directories that are removed on success,
error and Ctrl-C alike (`worktree()` is a context manager).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flaloop import fsutil, procs
from flaloop.errors import UsageError

# FLA's conftest stops NaN-poisoning for any frame whose file path contains these, so no
# tree we run tests from may live under such a path.
POISON_BLIND_MARKERS = ("tests/", "test_")


def _git(cwd: Path, *args: str, check: bool = True, text: bool = True,
         timeout: float | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=text, timeout=timeout,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"},
        )
    except FileNotFoundError as exc:  # pragma: no cover - git is a hard requirement
        raise UsageError("git is not installed", "install git and retry") from exc
    except subprocess.TimeoutExpired as exc:
        if check:
            raise UsageError(f"git {' '.join(args)} did not finish within {timeout:.0f}s in {cwd}") from exc
        return subprocess.CompletedProcess(exc.cmd, 124, "" if text else b"", "timed out" if text else b"timed out")
    if check and proc.returncode != 0:
        err = proc.stderr if text else proc.stderr.decode(errors="replace")
        raise UsageError(f"git {' '.join(args)} failed in {cwd}: {err.strip()}")
    return proc


def repo_root(path: Path) -> Path:
    """The top of the git work tree containing `path`."""
    path = Path(path).resolve()
    if not path.exists():
        raise UsageError(f"{path} does not exist", "pass --repo PATH pointing at your checkout")
    proc = _git(path if path.is_dir() else path.parent, "rev-parse", "--show-toplevel", check=False)
    if proc.returncode != 0:
        raise UsageError(
            f"{path} is not inside a git repository",
            "flaloop compares your working tree with a git ref: run it inside a checkout "
            "(or `git init && git add -A && git commit -m base` first)",
        )
    return Path(proc.stdout.strip())


def resolve_ref(root: Path, ref: str) -> str:
    """Full commit SHA of `ref`, or a UsageError naming the ref."""
    proc = _git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        hint = "check `git log --oneline` or `git branch -a`"
        if ref == "HEAD":
            hint = "the repository has no commit yet: commit your base first"
        elif is_shallow(root):
            hint = ("this is a shallow clone, which may lack it: `git fetch --unshallow` "
                    "(or `git fetch --deepen N`), then retry")
        raise UsageError(f"unknown base ref {ref!r} in {root}", hint)
    return proc.stdout.strip()


def is_shallow(root: Path) -> bool:
    return _git(root, "rev-parse", "--is-shallow-repository", check=False).stdout.strip() == "true"


def require_commit(root: Path, commit: str, what: str) -> None:
    """A UsageError naming `what` when `commit` is not in this clone (shallow, or history rewritten)."""
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode == 0:
        return
    if is_shallow(root):
        hint = "this is a shallow clone: `git fetch --unshallow` (or `git fetch --deepen N`) to get it"
    else:
        hint = "was the history rewritten (rebase, force-push)? fetch it, or choose another base"
    raise UsageError(f"{what} {commit[:12]} is not in this clone", hint)


def head_commit(root: Path) -> str:
    return resolve_ref(root, "HEAD")


def file_at(root: Path, commit: str, relpath: str) -> bytes | None:
    """Contents of `relpath` at `commit`, or None when it does not exist there."""
    proc = _git(root, "show", f"{commit}:{relpath}", check=False, text=False)
    return proc.stdout if proc.returncode == 0 else None


def diff_against(root: Path, commit: str, relpath: str) -> str:
    """Unified diff of the working-tree file against `commit` (new files included)."""
    proc = _git(root, "diff", "--no-color", commit, "--", relpath, check=False)
    if proc.stdout.strip():
        return proc.stdout
    if not (root / relpath).exists():
        return f"{relpath}: deleted in the working tree"
    # Untracked file: git diff shows nothing, so show it as all-new.
    proc = _git(root, "diff", "--no-color", "--no-index", "/dev/null", relpath, check=False)
    return proc.stdout


def tree_state(root: Path) -> dict:
    """HEAD, whether the tree is dirty, and a hash of the uncommitted diff (untracked files included)."""
    head = head_commit(root)
    status = _git(root, "status", "--porcelain", "--untracked-files=all").stdout
    dirty = bool(status.strip())
    digest = None
    if dirty:
        h = hashlib.sha256()
        h.update(_git(root, "diff", "--binary", "HEAD", text=False).stdout)
        for line in status.splitlines():
            if line.startswith("?? "):
                rel = line[3:]
                h.update(rel.encode())
                p = root / rel
                if p.is_file():
                    h.update(p.read_bytes())
        digest = h.hexdigest()[:12]
    return {"head": head, "dirty": dirty, "diff_hash": digest}


def ensure_ignored(root: Path, relpath: str) -> bool:
    """Make git ignore `relpath` via .git/info/exclude unless it already is. True if added."""
    probe = relpath.rstrip("/") + "/probe"
    if _git(root, "check-ignore", "-q", probe, check=False).returncode == 0:
        return False
    git_dir = Path(_git(root, "rev-parse", "--git-common-dir").stdout.strip())
    if not git_dir.is_absolute():
        git_dir = root / git_dir
    exclude = git_dir / "info" / "exclude"
    existing = exclude.read_text() if exclude.exists() else ""
    sep = "" if not existing or existing.endswith("\n") else "\n"
    fsutil.atomic_write_text(exclude, f"{existing}{sep}/{relpath.strip('/')}/\n")  # the user's file
    return True


def neutral_tempdir(prefix: str = "flaloop-") -> Path:
    """A fresh temp dir whose path contains neither `tests/` nor `test_` (see POISON_BLIND_MARKERS)."""
    for _ in range(20):
        d = Path(tempfile.mkdtemp(prefix=prefix))
        if not any(m in f"{d}/" for m in POISON_BLIND_MARKERS):
            return d
        shutil.rmtree(d, ignore_errors=True)
    raise UsageError(
        f"the temp directory {tempfile.gettempdir()} has 'tests/' or 'test_' in its path",
        "set TMPDIR to a neutral directory: FLA's NaN poisoning is blind under such paths",
    )


@contextlib.contextmanager
def worktree(root: Path, commit: str, name: str = "base") -> Iterator[Path]:
    """A detached worktree of `commit` in a neutral temp dir; removed however the block ends.

    It is locked from birth with this process as the reason, so that the worktree of a flaloop
    that was killed outright (SIGKILL, power loss) is found and removed by the next run
    (`reap_stale_worktrees`), and `git worktree prune` never takes it from a live run.
    """
    path = None
    try:
        with procs.deferred_interrupts():  # created and locked, or not at all; an interrupt waits
            tmp = neutral_tempdir("flaloop-wt-")
            proc = _git(root, "worktree", "add", "--detach", "--quiet", "--lock", "--reason", lock_reason(),
                        str(tmp / name), commit, check=False)
            if proc.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                require_commit(root, commit, "the base commit")
                raise UsageError(f"git could not make a worktree of {commit[:12]} in {tmp}: {proc.stderr.strip()}")
            path = tmp / name
        yield path
    finally:
        if path is not None:  # (an interrupt held above is raised inside this try: still removed)
            with procs.deferred_interrupts():
                remove_worktree(root, path)


def lock_reason() -> str:
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return f"flaloop pid={os.getpid()} host={socket.gethostname()} started={started}"


def remove_worktree(root: Path, path: Path) -> None:
    """Unlock and remove a worktree of ours and its temp dir; every step bounded in time."""
    _git(root, "worktree", "unlock", str(path), check=False, timeout=60)
    _git(root, "worktree", "remove", "--force", str(path), check=False, timeout=120)
    if path.parent.name.startswith("flaloop-wt-"):
        shutil.rmtree(path.parent, ignore_errors=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
    _git(root, "worktree", "prune", check=False, timeout=60)


@dataclass(frozen=True)
class WorktreeEntry:
    path: str
    locked: str | None  # the lock reason, "" when locked without one, None when not locked


def worktree_entries(root: Path) -> list[WorktreeEntry]:
    out, path, locked = [], None, None
    for line in [*_git(root, "worktree", "list", "--porcelain").stdout.splitlines(), ""]:
        if line.startswith("worktree "):
            path, locked = line.split(" ", 1)[1], None
        elif line == "locked" or line.startswith("locked "):
            locked = line[len("locked "):] if line.startswith("locked ") else ""
        elif not line and path is not None:
            out.append(WorktreeEntry(path, locked))
            path = None
    return out


def list_worktrees(root: Path) -> list[str]:
    return [e.path for e in worktree_entries(root)]


_REASON = re.compile(r"^flaloop pid=(\d+) host=(\S+)")


def stale_owner(entry: WorktreeEntry) -> int | None:
    """The pid of the dead flaloop run on this host that locked this worktree, else None."""
    m = _REASON.match(entry.locked or "")
    if not m or m.group(2) != socket.gethostname():
        return None  # not ours, or another host's (its pids mean nothing here)
    pid = int(m.group(1))
    return None if pid_is_flaloop(pid) else pid


def pid_is_flaloop(pid: int) -> bool:
    """Whether `pid` is alive and (where /proc tells) a flaloop process, not a reused pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    try:
        return b"flaloop" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: alive is all we know


def reap_stale_worktrees(root: Path) -> list[tuple[int, str]]:
    """Remove the worktrees that killed flaloop runs left behind; (pid, path) of each one removed."""
    reaped = []
    for entry in worktree_entries(root):
        pid = stale_owner(entry)
        if pid is None:
            continue
        remove_worktree(root, Path(entry.path))
        if entry.path not in list_worktrees(root):
            reaped.append((pid, entry.path))
    return reaped
