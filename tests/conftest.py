"""Fixtures: real git repos made from examples/minifla, and flaloop run as a real subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MINIFLA = ROOT / "examples" / "minifla"
OP = "chunk_linear_attn"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


@pytest.fixture(scope="session", autouse=True)
def _own_user_cache(tmp_path_factory):
    """flaloop's user cache (registry answers, GPU ceilings) per test session, not the user's."""
    if "FLALOOP_TEST_KEEP_CACHE" not in os.environ:
        os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    # warm fork servers of this test run: their own directory, short-lived, stopped at the end
    os.environ["FLALOOP_FORKSERVER_DIR"] = str(tmp_path_factory.mktemp("fs"))
    os.environ.setdefault("FLALOOP_FORKSERVER_IDLE_S", "300")
    yield
    from flaloop.bench import forkservers

    forkservers.stop_all()


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def commit_all(dest: Path) -> Path:
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "base")
    return dest


def make_repo(dest: Path) -> Path:
    shutil.copytree(MINIFLA, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
    return commit_all(dest)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        return json.loads(self.stdout)


def flaloop(repo: Path, *args: str, env: dict | None = None, timeout: float = 600) -> Result:
    """Run the CLI as a real subprocess, and check that it left the user's git state alone."""
    # piped, as an agent or CI runs it: no terminal width leaks in from the shell (COLUMNS is the
    # user's, set only by the tests about widths)
    run_env = {**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": None, "LINES": None, **(env or {})}
    for k in [k for k, v in run_env.items() if v is None]:
        del run_env[k]
    target = Path(args[args.index("--repo") + 1]) if "--repo" in args else repo
    before = user_state(target)
    with subprocess.Popen([sys.executable, "-m", "flaloop", *args], cwd=repo, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=run_env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            raise
    assert_user_state_kept(target, before, args, proc.pid)
    return Result(proc.returncode, out, err)


# -- nothing the user has is lost ---------------------------------------------------------------
# Checked around every CLI call of the suite (flaloop() above): branch, HEAD, index, the status and
# contents of every file outside profile/, the stash list and the worktrees are as before. Commands
# documented to commit may only move HEAD forward on the same branch.

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


@pytest.fixture(scope="session")
def prepared_repo(tmp_path_factory) -> Path:
    """minifla as a git repo with a contract and a cached gate baseline: copy it, don't edit it."""
    repo = make_repo(tmp_path_factory.mktemp("prepared") / "minifla")
    r = flaloop(repo, "init", OP, "--target", "1.1x", "--shapes", "B1_T64_H2_D32")
    assert r.code == 0, r.stderr
    r = flaloop(repo, "gate", OP, "--json")
    assert r.code == 0, r.stdout + r.stderr
    # the test's calls this gate at the base recorded, kept beside the repo: a bench replays them
    # only in a copy that asks for them (`with_test_calls`), so that other tests pay nothing for them
    calls = repo / "profile" / f"{OP}-opt" / "gate" / "calls.json"
    shutil.move(calls, repo.parent / "calls.json")
    return repo


def with_test_calls(prepared: Path, repo: Path) -> Path:
    """`repo` (a copy of `prepared`) with the test's calls its gate recorded at the base."""
    shutil.copy(prepared.parent / "calls.json", repo / "profile" / f"{OP}-opt" / "gate" / "calls.json")
    return repo


def fresh_copy(prepared: Path, dest: Path) -> Path:
    """Each test edits its own copy of a prepared repo (its .git and cached baseline included)."""
    shutil.copytree(prepared, dest, symlinks=True)
    return dest


@pytest.fixture
def repo(prepared_repo, tmp_path) -> Path:
    return fresh_copy(prepared_repo, tmp_path / "minifla")


@pytest.fixture
def candidates(repo) -> Path:
    """A copy of the prepared repo with four sweep candidates on branches (tests/sweep_fixtures.py)."""
    from sweep_fixtures import make_candidates

    return make_candidates(repo)


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not found in {path}"
    path.write_text(text.replace(old, new, count))


# -- a pure-torch toy target: fast enough to benchmark many times on a CPU ----------------------

TOY_REGISTRY = '''
from dataclasses import dataclass, field

import torch


def shape_BTHD(B, T, H, D, **kw):
    return (B, T, H, D)


def neg_abs(t):
    return -t.abs() - 0.1


@dataclass
class TensorSpec:
    shape_fn: object
    requires_grad: bool = True
    dtype: str = 'default'
    transform: object = None


@dataclass
class OpConfig:
    name: str
    import_path: str
    inputs: dict
    func_name: str = None
    extra_kwargs: dict = field(default_factory=dict)
    output_is_tuple: bool = True
    skip_backward: bool = False
    post_init: object = None
    category: str = ''
    dim_constraints: dict = None
    default_shapes: dict = None
    test_file: str = None
    backend_env: dict = None


SHAPE_CONFIGS = {
    'B2_T64_H2_D16': {'B': 2, 'T': 64, 'H': 2, 'D': 16},
    'B1_T128_H2_D32': {'B': 1, 'T': 128, 'H': 2, 'D': 32},
}
_REGISTRY = {}


def register_op(config):
    _REGISTRY[config.name] = config


def get_op(name):
    return _REGISTRY[name]


def list_ops():
    return sorted(_REGISTRY)


register_op(OpConfig(
    name='toy_attn', import_path='toyop.ops.toy',
    inputs={'q': TensorSpec(shape_BTHD), 'k': TensorSpec(shape_BTHD), 'v': TensorSpec(shape_BTHD)},
))
register_op(OpConfig(
    name='toy_log', import_path='toyop.ops.toy', func_name='toy_log',
    inputs={'q': TensorSpec(shape_BTHD, transform=neg_abs)}, test_file='tests/ops/test_toy.py',
))
'''

TOY_FAST = '''import torch


def toy_attn(q, k, v, scale=None, cu_seqlens=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = torch.einsum('bthd,bshd->bhts', q.float(), k.float()) * scale
    a = a.tril()
    o = torch.einsum('bhts,bshd->bthd', a, v.float())
    return o.to(q.dtype), None


def toy_log(q):
    return (q.float().log() + 1).to(q.dtype), None
'''

TOY_NAIVE = '''import torch


def naive_toy_attn(q, k, v, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[1]
    o = torch.zeros_like(q, dtype=torch.float32)
    for t in range(T):
        w = (q[:, t:t + 1].float() * k[:, :t + 1].float()).sum(-1, keepdim=True) * scale
        o[:, t] = (w * v[:, :t + 1].float()).sum(1)
    return o.to(q.dtype), None
'''

TOY_TEST = '''import pytest
import torch

from toyop.ops.toy import toy_attn
from toyop.ops.toy.naive import naive_toy_attn


@pytest.mark.parametrize('T', [5, 17])
def test_toy(T):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, T, 2, 8) for _ in range(3))
    torch.testing.assert_close(toy_attn(q, k, v)[0], naive_toy_attn(q, k, v)[0], rtol=1e-4, atol=1e-4)
'''


def make_toy_repo(dest: Path) -> Path:
    files = {
        "benchmarks/ops/registry.py": TOY_REGISTRY,
        "toyop/__init__.py": "",
        "toyop/ops/__init__.py": "",
        "toyop/ops/toy/__init__.py": "from .fast import toy_attn, toy_log\n",
        "toyop/ops/toy/fast.py": TOY_FAST,
        "toyop/ops/toy/naive.py": TOY_NAIVE,
        "tests/conftest.py": "",
        "tests/ops/test_toy.py": TOY_TEST,
    }
    for rel, text in files.items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return commit_all(dest)


# The toy op dispatched through a backend registry shaped like FLA's `fla.ops.backends` (per operation
# a registry, backends tried in order with a verifier, the op's own code when none takes the call,
# `_logged` keys of what served): tests/test_backends.py and test_unseen.py.
TOY_DISPATCH = '''"""A backend registry in the shape of FLA's fla.ops.backends (written for this test)."""
import os


class BackendRegistry:
    _registries = {}

    def __init__(self, operation):
        self._backends, self._logged = {}, set()
        BackendRegistry._registries[operation] = self

    def register(self, backend):
        self._backends[backend.backend_type] = backend


def dispatch(operation):
    def decorator(func):
        def wrapper(*args, **kwargs):
            registry = BackendRegistry._registries.get(operation)
            for be in (registry._backends.values() if registry else ()):
                if be.env_var and os.environ.get(be.env_var, "1") == "0":
                    continue
                key = f"{operation}:{func.__name__}:{be.backend_type}"
                if not be.verify(*args, **kwargs):
                    registry._logged.add(key + ":fail")
                    continue
                registry._logged.add(key)
                return getattr(be, func.__name__)(*args, **kwargs)
            return func(*args, **kwargs)
        return wrapper
    return decorator
'''

TOY_BLOCKED = '''import torch

from toyop.ops.dispatch import BackendRegistry

registry = BackendRegistry("toy")


class Blocked:
    """The same attention, one query block at a time."""
    backend_type, env_var = "blocked", "TOY_BLOCKED"

    def verify(self, q, k, v, scale=None, cu_seqlens=None):
        return {verify}

    def toy_attn(self, q, k, v, scale=None, cu_seqlens=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        s = torch.einsum('bthd,bshd->bhts', q.float(), k.float()) * scale
        o = torch.einsum('bhts,bshd->bthd', s.tril(), v.float())
        return o.to(q.dtype), None


registry.register(Blocked())
'''



def make_dispatched_repo(dest: Path, verify: str) -> Path:
    """The toy repo with `toy_attn` dispatched to the `blocked` backend (switched by TOY_BLOCKED) where
    `verify`, an expression over q, k and v, holds; committed."""
    repo = make_toy_repo(dest)
    (repo / "toyop" / "ops" / "dispatch.py").write_text(TOY_DISPATCH)
    (repo / "toyop" / "ops" / "toy" / "blocked.py").write_text(TOY_BLOCKED.replace("{verify}", verify))
    fast = repo / "toyop" / "ops" / "toy" / "fast.py"
    edit(fast, "import torch\n", "import torch\n\nfrom toyop.ops.dispatch import dispatch\n"
                                 "from toyop.ops.toy import blocked  # noqa: F401 - registers the backend\n")
    edit(fast, "def toy_attn(", "@dispatch(\"toy\")\ndef toy_attn(")
    return commit_all(repo)


@pytest.fixture(scope="session")
def prepared_toy(tmp_path_factory) -> Path:
    repo = make_toy_repo(tmp_path_factory.mktemp("toy") / "toy")
    for op in ("toy_attn", "toy_log"):
        r = flaloop(repo, "init", op, "--shapes", "B2_T64_H2_D16", "--modes", "fwd,fwdbwd")
        assert r.code == 0, r.stderr
    return repo


@pytest.fixture
def toy(prepared_toy, tmp_path) -> Path:
    return fresh_copy(prepared_toy, tmp_path / "toy")


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


# -- processes, through /proc -------------------------------------------------------------------

def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")  # a zombie has finished running


def descendants(pid: int) -> list[int]:
    """Every living process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) and st[0] not in ("Z", "X"):
            children.setdefault(st[1], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_for(cond, timeout: float, step: float = 0.1):
    """Poll `cond` until it returns something truthy (returned) or `timeout` s pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(step)
