"""Fixtures and hooks of the whole suite; the helpers they use are in tests/support/."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.cli import flaloop
from support.repos import INIT_ARGS, OP, fresh_copy, make_repo, make_toy_repo

# the toy repo's files (its own tests/ and conftest.py among them) are copied into tmp, never collected
collect_ignore = ["support"]


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


# The test modules longest first, those over 10 s (each module's span on one xdist worker under
# `-n 3` on the 2-core machine CI runs on, 11-123 s: docs/lab/2026-12-04-cpu.md R31). Each xdist
# worker takes the next module when it is free (`--dist loadscope --no-loadscope-reorder`, the
# Makefile), so these start first and the short modules fill the end, where one worker would
# otherwise finish a long module alone. A module not named here keeps its place after them,
# tests/unit/ last.
LONGEST_FIRST = ["e2e/test_gate.py", "e2e/test_bench.py", "e2e/test_sweep.py", "e2e/test_sweep_ray_ops.py",
                 "e2e/test_sanitize.py", "e2e/test_loop.py", "redteam/test_gate_tamper.py", "e2e/test_bad_input.py",
                 "e2e/test_cycle.py", "e2e/test_l2.py", "e2e/test_forkserver.py", "e2e/test_mcp.py",
                 "redteam/test_timed_calls.py", "e2e/test_robust.py", "e2e/test_compare.py", "e2e/test_worker.py",
                 "e2e/test_cli.py", "e2e/test_cand_env.py", "e2e/test_unseen.py", "e2e/test_tuning_rounds.py",
                 "redteam/test_test_calls.py", "e2e/test_guard_selfcheck.py", "e2e/test_model_check.py",
                 "e2e/test_report.py", "e2e/test_leaks.py", "e2e/test_guard_static.py", "e2e/test_cli_conventions.py",
                 "e2e/test_declared_ops.py", "e2e/test_backends.py", "redteam/test_precision_shortcuts.py",
                 "e2e/test_contention.py", "redteam/test_options.py", "unit/test_stats.py", "e2e/test_guard_probes.py",
                 "redteam/test_patched_harness.py"]


def _module_rank(item) -> tuple[int, int]:
    rel = Path(str(item.path)).relative_to(Path(__file__).parent).as_posix()
    if rel in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(rel)
    return (2 if rel.startswith("unit/") else 1), 0


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: a module's tests keep their order
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


@pytest.fixture(scope="session")
def prepared_repo(tmp_path_factory) -> Path:
    """minifla as a git repo with a contract and a cached gate baseline: copy it, don't edit it."""
    repo = make_repo(tmp_path_factory.mktemp("prepared") / "minifla")
    r = flaloop(repo, "init", OP, *INIT_ARGS)
    assert r.code == 0, r.stderr
    r = flaloop(repo, "gate", OP, "--json")
    assert r.code == 0, r.stdout + r.stderr
    # the test's calls this gate at the base recorded, kept beside the repo: a bench replays them
    # only in a copy that asks for them (`with_test_calls`), so that other tests pay nothing for them
    calls = repo / "profile" / f"{OP}-opt" / "gate" / "calls.json"
    shutil.move(calls, repo.parent / "calls.json")
    return repo


@pytest.fixture
def repo(prepared_repo, tmp_path) -> Path:
    return fresh_copy(prepared_repo, tmp_path / "minifla")


@pytest.fixture(scope="session")
def prepared_candidates(prepared_repo, tmp_path_factory) -> Path:
    """The prepared repo with four sweep candidates on branches (support/candidates.py): copy it, don't edit it."""
    from support.candidates import make_candidates

    return make_candidates(fresh_copy(prepared_repo, tmp_path_factory.mktemp("candidates") / "minifla"))


@pytest.fixture
def candidates(prepared_candidates, tmp_path) -> Path:
    return fresh_copy(prepared_candidates, tmp_path / "minifla")


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


@pytest.fixture
def other_job():
    """A real process of this machine standing for another user's job on the GPU: its pid."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()
