"""`flaloop demo`: the optimization loop on the bundled example, examples/minifla, in a scratch repo.

Each step is the real command a user would type, run as a subprocess and shown before it runs:
the contract, two ways the gate says no (a kernel bug, a loosened tolerance), the baseline, an
honest speedup that is kept, a cheat that is dropped, two changes that gain nothing and are
reverted, the stall rule refusing a third, the re-assessment that releases it, and the status.
On the CPU the example's Triton kernels run in the interpreter (TRITON_INTERPRET=1), where a
larger chunk means fewer interpreted loop iterations: a real speedup, measured as one.
It ends with the go (the kept iteration's explanation by its kernels) and the report. The scratch repo
lives in a neutral temp dir (or under --keep DIR) and stays there: its path, OPT_LOG.md, REPORT.md
and the plots are printed at the end.
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

from flaloop.bench import forkservers
from flaloop.core import git
from flaloop.core.errors import UsageError
from flaloop.core.workspace import REPORT_FILE, Workspace

# In a wheel the example ships inside the package (setup.py); in a checkout it is examples/minifla.
PACKAGE = Path(__file__).resolve().parents[1]  # flaloop/
EXAMPLE = next((p for p in (PACKAGE / "_example" / "minifla", PACKAGE.parent / "examples" / "minifla") if p.is_dir()),
               PACKAGE.parent / "examples" / "minifla")
OP = "chunk_linear_attn"
TINY = "B1_T64_H2_D32"
CHUNK = Path("minifla/ops/linear_attn/chunk.py")
# Few pairs, one round: the demo's speed differences are large (x1.5 and more), and it must stay short.
QUICK = ["--min-pairs", "4", "--max-pairs", "8", "--rounds", "1", "--cell-seconds", "20"]
IDENTITY = {"GIT_AUTHOR_NAME": "demo", "GIT_AUTHOR_EMAIL": "demo@localhost",
            "GIT_COMMITTER_NAME": "demo", "GIT_COMMITTER_EMAIL": "demo@localhost"}
# A cheat the tests cannot see: zeros at exactly the bench's shape and dtype. The guard's static
# rule `shape-branch` names it (a branch on a literal shape value the registry uses) before any
# bench runs; were it spelled so that no rule read it, the bench's base-versus-candidate check
# would block the cell (differs-from-base).
CHEAT = ("    _, T, H, K = q.shape\n",
         "    _, T, H, K = q.shape\n"
         "    if q.dtype == torch.bfloat16 and T == 64:  # the bench's shape and dtype; the tests use others\n"
         "        return torch.zeros_like(v), None\n")


def _sh(console: Console, repo: Path, args: list[str], expect: int | tuple[int, ...] = 0) -> int:
    console.rule(f"$ flaloop {shlex.join(args)}", style="cyan")
    proc = subprocess.run([sys.executable, "-m", "flaloop", *args], cwd=repo, env={**os.environ, **IDENTITY})
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


def _say(console: Console, title: str, text: str) -> None:
    console.print(f"\n[bold]{escape(title)}[/] {escape(text)}", markup=True)


def run_demo(console: Console, keep: Path | None = None) -> Path:
    """The demo in `keep` (else a new temp dir); the scratch repo stays where it says it is."""
    if not EXAMPLE.is_dir():
        raise UsageError(f"the bundled example is missing at {EXAMPLE}",
                         "reinstall flaloop (the example ships inside the package), or run from a checkout")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the example's Triton kernels run on the CPU
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two bench workers share the cores; don't let torch spin
    scratch = git.neutral_tempdir("flaloop-demo-") if keep is None else keep
    clean = keep is None  # a demo that fails half way leaves no temp dir behind
    repo = scratch / "minifla"
    if repo.exists():
        raise UsageError(f"{repo} already exists", "pass another --keep directory")
    # the demo's warm fork servers are its own, and end with it
    own_servers = forkservers.DIR_ENV not in os.environ
    if own_servers:
        os.environ[forkservers.DIR_ENV] = str(scratch / "forkservers")
    try:
        shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        env = {**os.environ, **IDENTITY}
        for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
            subprocess.run(["git", *args], cwd=repo, check=True, env=env)
        console.print(f"scratch repo: {repo} (a git copy of examples/minifla)")
        chunk, test = repo / CHUNK, repo / "tests" / "ops" / "test_linear_attn.py"

        _sh(console, repo, ["init", OP, "--target", "1.2x", "--shapes", TINY, "--modes", "fwd"])

        _say(console, "The gate says no (1/2):", "the forward kernel skips the store of its last chunk; "
             "the test's NaN poisoning catches it.")
        original = chunk.read_text()
        plant_unwritten_tail(chunk)
        _sh(console, repo, ["gate", OP], expect=1)
        chunk.write_text(original)
        _say(console, "The gate says no (2/2):", "the test's tolerance is loosened; the frozen set catches it "
             "before pytest runs.")
        test_original = test.read_text()
        _replace(test, "torch.float32: 0.005,", "torch.float32: 0.5,")
        _sh(console, repo, ["gate", OP], expect=1)
        test.write_text(test_original)

        _say(console, "Phase 1, the baseline:", "the full gate on the base and one timed run of it (base "
             "against itself, which also checks the harness); OPT_LOG.md gets its header and row 0.")
        _sh(console, repo, ["baseline", OP, *QUICK])

        _say(console, "An honest speedup:", "chunks of 64 timesteps instead of 32 halve the sequential "
             "loop of every kernel. One iteration: gate, guard, bench, a row, a commit.")
        _replace(chunk, "CHUNK_SIZE = 32", "CHUNK_SIZE = 64")
        _sh(console, repo, ["iter", OP, "chunk size 32 -> 64: half the sequential steps", *QUICK])

        _say(console, "A cheat:", "skip the kernel and return zeros at the bench's shape and dtype, which no "
             "test case uses. The gate stays green; the guard's static rules name the special case "
             "(shape-branch) and nothing is benchmarked. It is still logged and committed, then reverted.")
        _replace(chunk, *CHEAT)
        _sh(console, repo, ["iter", OP, "skip the work at T=64", *QUICK], expect=1)

        _say(console, "No gain (1/3):", "chunks of 16 mean twice the steps of the kept version: slower than "
             "the best, so it is reverted; history keeps the attempt.")
        _replace(chunk, "CHUNK_SIZE = 64", "CHUNK_SIZE = 16")
        _sh(console, repo, ["iter", OP, "chunk size 64 -> 16: smaller tiles", *QUICK])
        _say(console, "No gain (2/3):", "back to chunks of 32: still slower than the kept 64.")
        _replace(chunk, "CHUNK_SIZE = 64", "CHUNK_SIZE = 32")
        _sh(console, repo, ["iter", OP, "chunk size 64 -> 32: the original tiles", *QUICK])
        _say(console, "No gain (3/3):", "three iterations in a row without a keep (the drop counts): the "
             "loop refuses the next one until the situation is re-assessed.")
        _replace(chunk, "CHUNK_SIZE = 64", "CHUNK_SIZE = 128")
        _sh(console, repo, ["iter", OP, "chunk size 64 -> 128", *QUICK], expect=1)
        _say(console, "Re-assess:", "what was re-profiled, what the log shows as tried, what is next and why. "
             "(The refused change is still in the working tree: a refusal touches nothing.)")

        _sh(console, repo, ["reassess", OP, "--profiled", "the interpreter spends its time in the chunk loop",
                            "--tried", "chunk size in both directions",
                            "--next", "fuse the backward sweeps into one kernel",
                            "--why", "each kernel re-walks the sequence; one walk would do"])
        _sh(console, repo, ["status", OP])
        _sh(console, repo, ["header", OP, "--iter", "1"])
        _say(console, "The end, a go:", "iteration 1 met the target. The go profiles it against the base on "
             "every measured cell and accounts for the saving kernel by kernel (on the CPU the kernels are the "
             "interpreter's), and runs compute-sanitizer where there is one; then the report for the pull request.")
        _sh(console, repo, ["stop", OP, "--go"])
        _sh(console, repo, ["report", OP])
        ws = Workspace.at(repo, OP)
        log = ws.opt_log
        console.rule(f"{log.relative_to(repo)}", style="cyan")
        console.print(log.read_text())
        console.rule("git log --oneline", style="cyan")
        subprocess.run(["git", "log", "--oneline"], cwd=repo)
        console.print(f"\n[green]demo finished[/]: the scratch repo is kept at {escape(str(repo))}", markup=True)
        for path in [log, ws.report / REPORT_FILE, *sorted(ws.report.glob("*.png"))]:
            if path.exists():
                console.print(f"  {path}")
        console.print(f"  (remove it with: rm -rf {shlex.quote(str(scratch))})")
        return repo
    except BaseException:
        if clean:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        if own_servers:
            forkservers.stop_all()
            del os.environ[forkservers.DIR_ENV]


def plant_unwritten_tail(chunk: Path) -> None:
    """Make the forward kernel skip storing its last chunk (see examples/minifla)."""
    _replace(chunk, "mask=m_t[:, None] & m_v[None, :])", "mask=m_t[:, None] & m_v[None, :] & (i_t < NT - 1))")
