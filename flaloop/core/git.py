"""Git, read-only towards the user's work.

Nothing here checks out, stashes or resets the user's working tree. Other revisions are
materialised as detached worktrees in temporary directories that are removed on success,
error and Ctrl-C alike (`worktree()` is a context manager).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flaloop.core import clock, fsutil, procs
from flaloop.core.errors import UsageError

# FLA's conftest stops NaN-poisoning for any frame whose file path contains these, so no
# tree we run tests from may live under such a path.
POISON_BLIND_MARKERS = ("tests/", "test_")
# git serialises work on one repository's worktree list through lock files; the measurements of a
# sweep run in threads of one flaloop, so they take turns adding and removing worktrees.
_WORKTREE_LOCK = threading.Lock()
SNAPSHOT_MESSAGE = "flaloop: a snapshot of the working tree (not on any branch)"


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


OWNER_FILE = ".flaloop-owner"  # "<pid> <host>" of the process a temp dir of ours belongs to
OWNED_PREFIXES = ("flaloop-wt-", "flaloop-gate-")


def neutral_tempdir(prefix: str = "flaloop-") -> Path:
    """A fresh temp dir whose path contains neither `tests/` nor `test_` (see POISON_BLIND_MARKERS).
    It names its owner (this process) in OWNER_FILE, so that a run killed outright leaves nothing
    the next run does not remove (`reap_stale_tempdirs`)."""
    for _ in range(20):
        d = Path(tempfile.mkdtemp(prefix=prefix))
        if not any(m in f"{d}/" for m in POISON_BLIND_MARKERS):
            if prefix in OWNED_PREFIXES:
                (d / OWNER_FILE).write_text(f"{os.getpid()} {socket.gethostname()}\n")
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
        with procs.deferred_interrupts(), _WORKTREE_LOCK:  # created and locked, or not at all; an interrupt waits
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
    started = clock.now_iso()
    return f"flaloop pid={os.getpid()} host={socket.gethostname()} started={started}"


def remove_worktree(root: Path, path: Path) -> None:
    """Unlock and remove a worktree of ours and its temp dir; every step bounded in time."""
    with _WORKTREE_LOCK:
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
    if not procs.exists(pid):
        return False
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


def reap_stale_tempdirs(tmp: Path | None = None) -> list[Path]:
    """Remove the temp dirs of ours (worktrees' and gates') whose owner on this host is dead: a
    flaloop, or a Ray task, killed outright. Only a pid that no longer exists counts as dead (a
    live one of any kind is left alone: it may be a test process running flaloop in-process); a
    dir without an owner file is not touched. The worktree's registration in its repository is
    removed by that repository's next run (`reap_stale_worktrees`)."""
    tmp = Path(tmp or tempfile.gettempdir())
    host, gone = socket.gethostname(), []
    for prefix in OWNED_PREFIXES:
        for d in tmp.glob(f"{prefix}*"):
            try:
                pid, where = (d / OWNER_FILE).read_text().split()
                dead = where == host and not procs.exists(int(pid))
            except (OSError, ValueError):
                continue
            if dead:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d)
    return gone


def changed_since(root: Path, commit: str) -> list[tuple[str, str, str]]:
    """(status letter, path, path at `commit`) of every tracked file whose working-tree content
    differs from `commit`: staged and unstaged edits alike. A moved file (git's rename detection)
    has status R and its old path; untracked files are not included (see `untracked`).
    """
    out = _git(root, "diff", "--name-status", "-M", "-z", commit, "--").stdout
    parts = [p for p in out.split("\0") if p]
    rows, i = [], 0
    while i < len(parts):
        letter = parts[i][0]
        if letter in "RC":  # R100\0old\0new
            rows.append((letter, parts[i + 2], parts[i + 1]))
            i += 3
        else:
            rows.append((letter, parts[i + 1], parts[i + 1]))
            i += 2
    return rows


def untracked(root: Path, under: str | None = None, ignored: bool = False) -> list[str]:
    """Files git does not track: those it would show (default), or those it ignores (`ignored`)."""
    args = ["ls-files", "--others", "--exclude-standard", "-z"]
    if ignored:
        args.append("--ignored")
    if under:
        args += ["--", under]
    return [p for p in _git(root, *args).stdout.split("\0") if p]


def files_at(root: Path, commit: str, under: str) -> list[str]:
    """Paths of the files under `under` at `commit`."""
    proc = _git(root, "ls-tree", "-r", "--name-only", "-z", commit, "--", under, check=False)
    return [p for p in proc.stdout.split("\0") if p] if proc.returncode == 0 else []


# -- tree states: a commit for every candidate, made without touching the user's index or branch ----

def tree_of(root: Path, commit: str) -> str:
    """The tree id of a commit: two commits with equal trees are the same code."""
    return _git(root, "rev-parse", f"{commit}^{{tree}}").stdout.strip()


def _plumbing_env(index: Path | None = None) -> dict:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    # commit-tree needs an identity; the snapshot is flaloop's, not the user's
    env.setdefault("GIT_AUTHOR_NAME", "flaloop")
    env.setdefault("GIT_AUTHOR_EMAIL", "flaloop@localhost")
    env.setdefault("GIT_COMMITTER_NAME", "flaloop")
    env.setdefault("GIT_COMMITTER_EMAIL", "flaloop@localhost")
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    return env


def _plumb(root: Path, *args: str, index: Path | None = None, input: str | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, input=input,
                          env=_plumbing_env(index))
    if proc.returncode != 0:
        raise UsageError(f"git {' '.join(args)} failed in {root}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def commit_tree(root: Path, tree: str, parent: str, message: str) -> str:
    """A commit of `tree` on top of `parent`, on no branch (a dangling commit until a ref names it)."""
    return _plumb(root, "commit-tree", tree, "-p", parent, "-F", "-", input=message + "\n")


def snapshot(root: Path) -> str:
    """The working tree as a commit: HEAD itself when nothing is uncommitted, else a commit on top
    of HEAD holding exactly what `commit_all` would take (tracked edits, untracked files git does not
    ignore, bytecode aside). Built in a temporary index: the user's index, branch and files are
    untouched, and no ref points at it (a measurement checks it out as a worktree, like the base)."""
    head = head_commit(root)
    if not changed_paths(root):
        return head
    fd, tmp = tempfile.mkstemp(prefix="flaloop-index-")
    os.close(fd)
    index = Path(tmp)
    try:
        index.unlink()  # git wants to create it
        _plumb(root, "read-tree", "HEAD", index=index)
        _plumb(root, "add", "-A", "--", ".", *NOT_A_CHANGE, index=index)
        tree = _plumb(root, "write-tree", index=index)
    finally:
        index.unlink(missing_ok=True)
    if tree == tree_of(root, head):
        return head
    return commit_tree(root, tree, head, SNAPSHOT_MESSAGE)


def keep_ref(root: Path, name: str, commit: str) -> str:
    """Point `refs/flaloop/<name>` at `commit` (a sweep's candidates outlive the sweep: `iter
    --from-sweep` reads them back); not a branch, never checked out."""
    ref = f"refs/flaloop/{name}"
    _plumb(root, "update-ref", ref, commit)
    return ref


def drop_refs(root: Path, prefix: str) -> int:
    """Delete every `refs/flaloop/<prefix>...` ref (a pruned sweep's); how many."""
    refs = _git(root, "for-each-ref", "--format=%(refname)", f"refs/flaloop/{prefix}").stdout.split()
    for ref in refs:
        _git(root, "update-ref", "-d", ref, check=False)
    return len(refs)


def patch_commit(root: Path, base: str, patch: Path) -> str:
    """A commit on top of `base` with `patch` (a unified diff, `git diff` or `git format-patch`)
    applied, made in a temporary index; UsageError quoting git when it does not apply."""
    fd, tmp = tempfile.mkstemp(prefix="flaloop-index-")
    os.close(fd)
    index = Path(tmp)
    try:
        index.unlink()
        _plumb(root, "read-tree", base, index=index)
        proc = subprocess.run(["git", "apply", "--cached", "--whitespace=nowarn", str(patch.resolve())], cwd=root,
                              capture_output=True, text=True, env=_plumbing_env(index))
        if proc.returncode != 0:
            raise UsageError(f"the patch {patch} does not apply to {base[:12]}: "
                             f"{(proc.stderr or proc.stdout).strip().splitlines()[0] if (proc.stderr or proc.stdout).strip() else 'git apply failed'}",
                             "make it against the base (`git diff BASE > change.diff`), or choose that base (--base)")
        tree = _plumb(root, "write-tree", index=index)
    finally:
        index.unlink(missing_ok=True)
    return commit_tree(root, tree, base, f"flaloop: {patch.name} applied to {base[:12]}")


def bundle(root: Path, commits: list[str], dest: Path) -> Path:
    """A git bundle holding `commits` and their history (what a remote measurement clones)."""
    refs = []
    for i, c in enumerate(dict.fromkeys(commits)):
        refs.append(keep_ref(root, f"bundle/{os.getpid()}-{i}", c))
    try:
        _plumb(root, "bundle", "create", str(dest), *refs)
    finally:
        for ref in refs:
            subprocess.run(["git", "update-ref", "-d", ref], cwd=root, capture_output=True)
    return dest


def clone_bundle(bundle_file: Path, dest: Path) -> Path:
    """A repository at `dest` holding every ref of a bundle (a remote measurement's trees); no checkout."""
    dest.mkdir(parents=True, exist_ok=True)
    _plumb(dest, "init", "-q")
    _plumb(dest, "fetch", "-q", str(bundle_file), "refs/*:refs/*")
    return dest


def names_between(root: Path, a: str, b: str) -> set[str]:
    """The paths that differ between two commits (both names of a move)."""
    out = _git(root, "diff", "--name-status", "--no-renames", "-z", a, b).stdout
    parts = [p for p in out.split("\0") if p]
    return {parts[i + 1] for i in range(0, len(parts) - 1, 2)}


def diff_between(root: Path, a: str, b: str) -> str:
    """The binary-safe diff from commit `a` to commit `b`."""
    return _git(root, "diff", "--binary", "--no-color", a, b).stdout


def apply_to_worktree(root: Path, diff_text: str) -> None:
    """Apply a diff to the working tree (not the index), or change nothing and say why."""
    for args in (["apply", "--check", "--whitespace=nowarn", "-"], ["apply", "--whitespace=nowarn", "-"]):
        proc = subprocess.run(["git", *args], cwd=root, input=diff_text, capture_output=True, text=True,
                              env=_plumbing_env())
        if proc.returncode != 0:
            raise UsageError(f"the candidate does not apply to the working tree: {(proc.stderr or '').strip()[:400]}",
                             "its base and your branch differ on these files: iterate from its base, or rebase it")


# -- commits made by the loop (flaloop iter): on the user's branch, never over their work ---------

IN_PROGRESS = {"MERGE_HEAD": "a merge", "CHERRY_PICK_HEAD": "a cherry-pick", "REVERT_HEAD": "a revert",
               "rebase-merge": "a rebase", "rebase-apply": "a rebase or `git am`", "BISECT_LOG": "a bisect"}


def current_branch(root: Path) -> str | None:
    """The checked-out branch, or None when HEAD is detached."""
    proc = _git(root, "symbolic-ref", "-q", "--short", "HEAD", check=False)
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def operation_in_progress(root: Path) -> str | None:
    """What half-done git operation (merge, rebase, ...) the repository is in, if any."""
    for name, what in IN_PROGRESS.items():
        path = Path(_git(root, "rev-parse", "--git-path", name).stdout.strip())
        if not path.is_absolute():
            path = root / path
        if path.exists():
            return what
    return None


# Python bytecode is never part of a change, even in a repo whose .gitignore forgets it: the gate and
# the bench import the tree, and the files they leave would otherwise be committed, and would make
# the tree look edited while it was being measured.
NOT_A_CHANGE = (":(exclude,glob)**/__pycache__/**", ":(exclude,glob)**/*.py[co]")


def changed_paths(root: Path) -> list[str]:
    """Paths `commit_all` takes: tracked changes and untracked files git does not ignore (bytecode aside)."""
    out = _git(root, "status", "--porcelain", "--untracked-files=all", "--", ".", *NOT_A_CHANGE).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def change_fingerprint(root: Path) -> str:
    """HEAD plus a hash of everything `commit_all` would take: equal fingerprints, equal candidates."""
    h = hashlib.sha256(head_commit(root).encode())
    h.update(_git(root, "diff", "--binary", "HEAD", "--", ".", *NOT_A_CHANGE, text=False).stdout)
    for rel in changed_paths(root):
        p = root / rel
        if p.is_file():
            h.update(rel.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def is_ancestor(root: Path, ancestor: str, descendant: str = "HEAD") -> bool:
    return _git(root, "merge-base", "--is-ancestor", ancestor, descendant, check=False).returncode == 0


def same_tree(root: Path, a: str, b: str) -> bool:
    """Whether two commits have identical trees (a revert brought the code back)."""
    return _git(root, "rev-parse", f"{a}^{{tree}}").stdout == _git(root, "rev-parse", f"{b}^{{tree}}").stdout


def identity_problem(root: Path) -> str | None:
    """Why `git commit` would fail for lack of a name/e-mail, or None."""
    proc = _git(root, "var", "GIT_COMMITTER_IDENT", check=False)
    return None if proc.returncode == 0 else proc.stderr.strip() or "no committer identity"


def commit_all(root: Path, message: str) -> str:
    """`git add -A` (.gitignore respected) and one commit with `message`; its SHA.

    Hooks are skipped (--no-verify): the commit must hold exactly the tree that was measured,
    and a formatting hook would change it after the fact.
    """
    _git(root, "add", "-A", "--", ".", *NOT_A_CHANGE)
    _commit(root, message)
    return head_commit(root)


def revert(root: Path, commits: list[str], message: str) -> str:
    """One commit that reverts `commits` (newest first); history keeps the attempt. Its SHA."""
    proc = _git(root, "revert", "--no-commit", *commits, check=False)
    if proc.returncode != 0:
        _git(root, "revert", "--abort", check=False)
        raise UsageError(f"git revert of {', '.join(c[:12] for c in commits)} failed: {proc.stderr.strip()}",
                         "resolve it by hand; the attempt is committed and nothing was lost")
    _commit(root, message)
    return head_commit(root)


def _commit(root: Path, message: str) -> None:
    proc = subprocess.run(["git", "commit", "--no-verify", "-q", "-F", "-"], cwd=root, input=message, text=True,
                          capture_output=True, env={**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"})
    if proc.returncode != 0:
        raise UsageError(f"git commit failed in {root}: {(proc.stderr or proc.stdout).strip()}",
                         "set user.name and user.email (git config), then rerun")
