"""Real git repos for the tests: examples/minifla, the pure-torch toy op (tests/support/toy/), and the
toy op dispatched through a backend registry (tests/support/toy_dispatch/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# how the prepared minifla repo is initialised (tests/conftest.py), and any fixture that re-bases it
INIT_ARGS = ("--target", "1.1x", "--shapes", "B1_T64_H2_D32")
MINIFLA = ROOT / "examples" / "minifla"
TOY = Path(__file__).resolve().parent / "toy"
TOY_DISPATCH = Path(__file__).resolve().parent / "toy_dispatch"
OP = "chunk_linear_attn"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def commit_all(dest: Path) -> Path:
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "base")
    return dest


def make_repo(dest: Path) -> Path:
    shutil.copytree(MINIFLA, dest, ignore=_IGNORE)
    return commit_all(dest)


def fresh_copy(prepared: Path, dest: Path) -> Path:
    """Each test edits its own copy of a prepared repo (its .git and cached baseline included)."""
    shutil.copytree(prepared, dest, symlinks=True)
    return dest


def with_test_calls(prepared: Path, repo: Path) -> Path:
    """`repo` (a copy of `prepared`) with the test's calls its gate recorded at the base."""
    shutil.copy(prepared.parent / "calls.json", repo / "profile" / f"{OP}-opt" / "gate" / "calls.json")
    return repo


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not found in {path}"
    path.write_text(text.replace(old, new, count))


@contextmanager
def planted(path: Path, text: str) -> Iterator[Path]:
    """`path` holds `text` inside the block and its own text again after it, whatever the block raised:
    a module-scoped repo takes one plant at a time and is left as it was."""
    before = path.read_text()
    try:
        path.write_text(text)
        yield path
    finally:
        path.write_text(before)


# -- a pure-torch toy target: fast enough to benchmark many times on a CPU ----------------------

def make_toy_repo(dest: Path) -> Path:
    """The toy op's repo (ops toy_attn and toy_log, its registry, its frozen test), committed."""
    shutil.copytree(TOY, dest, ignore=_IGNORE, dirs_exist_ok=True)
    return commit_all(dest)


def make_dispatched_repo(dest: Path, verify: str) -> Path:
    """The toy repo with `toy_attn` dispatched to the `blocked` backend (switched by TOY_BLOCKED) where
    `verify`, an expression over q, k and v, holds; committed. The registry has the shape of FLA's
    `fla.ops.backends` (per operation a registry, backends tried in order with a verifier, the op's
    own code when none takes the call, `_logged` keys of what served)."""
    repo = make_toy_repo(dest)
    shutil.copy(TOY_DISPATCH / "dispatch.py", repo / "toyop" / "ops" / "dispatch.py")
    blocked = (TOY_DISPATCH / "blocked.py.in").read_text()
    (repo / "toyop" / "ops" / "toy" / "blocked.py").write_text(blocked.replace("{verify}", verify))
    fast = repo / "toyop" / "ops" / "toy" / "fast.py"
    edit(fast, "import torch\n", "import torch\n\nfrom toyop.ops.dispatch import dispatch\n"
                                 "from toyop.ops.toy import blocked  # noqa: F401 - registers the backend\n")
    edit(fast, "def toy_attn(", "@dispatch(\"toy\")\ndef toy_attn(")
    return commit_all(repo)


def worktrees(repo: Path) -> list[str]:
    """The repo's worktrees. A test that polls this while flaloop adds one can catch git between
    writing the worktree's directory and its `commondir` file: read again a moment later."""
    from flaloop.core.errors import UsageError
    from flaloop.core.git import list_worktrees

    for _ in range(10):
        try:
            return list_worktrees(repo)
        except UsageError as exc:
            if "commondir" not in str(exc) and "gitdir" not in str(exc):
                raise
            time.sleep(0.1)
    return list_worktrees(repo)
