"""`flaloop demo`: the whole loop on the bundled example, examples/minifla, in a scratch repo.

Each step is the real command a user would type, run as a subprocess and shown before it runs.
The scratch repo lives in a neutral temp dir and is removed at the end unless --keep is given.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from flaloop import git
from flaloop.errors import UsageError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minifla"
OP = "chunk_linear_attn"
TINY = "B1_T64_H2_D32"


def _sh(console: Console, repo: Path, args: list[str], expect: int | tuple[int, ...] = 0,
        env: dict | None = None) -> int:
    console.rule(f"$ flaloop {shlex.join(args)}", style="cyan")
    proc = subprocess.run([sys.executable, "-m", "flaloop", *args], cwd=repo, env={**os.environ, **(env or {})})
    expected = (expect,) if isinstance(expect, int) else expect
    mark = "as expected" if proc.returncode in expected else f"UNEXPECTED (wanted {expected})"
    console.print(f"[dim]exit {proc.returncode}: {mark}[/]", markup=True)
    if proc.returncode not in expected:
        raise UsageError(f"demo step `flaloop {shlex.join(args)}` exited {proc.returncode}")
    return proc.returncode


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if old not in text:
        raise UsageError(f"demo: cannot plant the change in {path}: {old!r} not found")
    path.write_text(text.replace(old, new, 1))


def run_demo(console: Console, keep: Path | None = None) -> Path | None:
    if not EXAMPLE.is_dir():
        raise UsageError(f"the bundled example is missing at {EXAMPLE}", "run the demo from a flaloop checkout")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the example's Triton kernels run on the CPU
    scratch = git.neutral_tempdir("flaloop-demo-") if keep is None else keep
    repo = scratch / "minifla"
    if repo.exists():
        raise UsageError(f"{repo} already exists", "pass another --keep directory")
    try:
        shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        env = {**os.environ, "GIT_AUTHOR_NAME": "demo", "GIT_AUTHOR_EMAIL": "demo@localhost",
               "GIT_COMMITTER_NAME": "demo", "GIT_COMMITTER_EMAIL": "demo@localhost"}
        for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
            subprocess.run(["git", *args], cwd=repo, check=True, env=env)
        console.print(f"scratch repo: {repo} (a git copy of examples/minifla)")

        _sh(console, repo, ["list"])
        _sh(console, repo, ["init", OP, "--target", "1.1x", "--shapes", TINY])
        _sh(console, repo, ["gate", OP])

        console.print("\n[bold]Plant a kernel bug:[/] the forward kernel skips the store of its last "
                      "chunk; NaN poisoning must catch it.", markup=True)
        chunk = repo / "minifla" / "ops" / "linear_attn" / "chunk.py"
        original = chunk.read_text()
        plant_unwritten_tail(chunk)
        _sh(console, repo, ["gate", OP], expect=1)
        chunk.write_text(original)

        console.print("\n[bold]Loosen the test's tolerance:[/] the frozen set catches it.", markup=True)
        test = repo / "tests" / "ops" / "test_linear_attn.py"
        test_original = test.read_text()
        _replace(test, "torch.float32: 0.005,", "torch.float32: 0.5,")
        _sh(console, repo, ["gate", OP], expect=1)
        test.write_text(test_original)

        console.print("\n[bold]A/A benchmark:[/] base against itself, paired and interleaved.", markup=True)
        _sh(console, repo, ["bench", OP, "--aa", "--modes", "fwd", "--min-pairs", "6", "--max-pairs", "12",
                            "--cell-seconds", "60"], expect=(0, 3))
        console.print("\n[bold]verify:[/] gate first, then the paired benchmark of the working tree.", markup=True)
        _sh(console, repo, ["verify", OP, "--modes", "fwd", "--min-pairs", "6", "--max-pairs", "12",
                            "--cell-seconds", "60"], expect=(0, 3))
        console.print(f"\n[green]demo finished[/]: workspace {escape(str(repo / 'profile' / (OP + '-opt')))}",
                      markup=True)
        return repo if keep else None
    finally:
        if keep is None:
            shutil.rmtree(scratch, ignore_errors=True)


def plant_unwritten_tail(chunk: Path) -> None:
    """Make the forward kernel skip storing its last chunk (see examples/minifla)."""
    _replace(chunk, "mask=m_t[:, None] & m_v[None, :])", "mask=m_t[:, None] & m_v[None, :] & (i_t < NT - 1))")
