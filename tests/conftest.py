"""Fixtures: real git repos made from examples/minifla, and flaloop run as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MINIFLA = ROOT / "examples" / "minifla"
OP = "chunk_linear_attn"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


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


def make_repo(dest: Path) -> Path:
    shutil.copytree(MINIFLA, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "base")
    return dest


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        return json.loads(self.stdout)


def flaloop(repo: Path, *args: str, env: dict | None = None, timeout: float = 600) -> Result:
    run_env = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
    for k in [k for k, v in run_env.items() if v is None]:
        del run_env[k]
    proc = subprocess.run([sys.executable, "-m", "flaloop", *args], cwd=repo, capture_output=True, text=True,
                          env=run_env, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def prepared_repo(tmp_path_factory) -> Path:
    """minifla as a git repo with a contract and a cached gate baseline: copy it, don't edit it."""
    repo = make_repo(tmp_path_factory.mktemp("prepared") / "minifla")
    r = flaloop(repo, "init", OP, "--target", "1.1x", "--shapes", "B1_T64_H2_D32")
    assert r.code == 0, r.stderr
    r = flaloop(repo, "gate", OP, "--json")
    assert r.code == 0, r.stdout + r.stderr
    return repo


@pytest.fixture
def repo(prepared_repo, tmp_path) -> Path:
    dest = tmp_path / "minifla"
    shutil.copytree(prepared_repo, dest, symlinks=True)
    return dest


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not found in {path}"
    path.write_text(text.replace(old, new, count))
