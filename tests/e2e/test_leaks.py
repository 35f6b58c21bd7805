"""Long runs don't leak, and the workspace stays bounded: benchmarks/leak_check.py with a small N,
and `flaloop clean` keeping what iterations cite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.cli import flaloop
from support.repos import ROOT


def test_benches_in_a_row_leave_no_process_fd_thread_worktree_or_temp_dir(toy):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "leak_check.py"), "--n", "3", "--json",
                           "--repo", str(toy), "--op", "toy_attn"], capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["leaks"] == [] and proc.returncode == 0, doc
    for k in ("processes", "fds", "threads", "worktrees", "tmp_entries"):
        assert doc["after"][k] <= doc["base"][k], (k, doc)
    assert doc["after"]["worktrees"] == 1  # the checkout itself
    assert len(list((toy / "profile/toy_attn-opt/runs").iterdir())) == 4  # every bench kept its record
    # no dump of a cell's outputs is left behind, and worker logs stay small
    ws = toy / "profile/toy_attn-opt"
    assert not list(ws.rglob("*.pt"))
    assert 0 < doc["per_run_bytes"] < 2_000_000


def _fake_run(ws: Path, name: str, size: int = 1000) -> Path:
    d = ws / "runs" / name
    d.mkdir(parents=True)
    (d / "record.json").write_text(json.dumps({"kind": "bench", "pad": "x" * size}))
    return d


def test_clean_keeps_the_newest_and_every_record_an_iteration_cites(toy):
    ws = toy / "profile/toy_attn-opt"
    names = [f"20260101T00000{i}Z-bench" for i in range(6)]
    for n in names:
        _fake_run(ws, n)
    (ws / "iters").mkdir()
    (ws / "iters" / "0001.json").write_text(json.dumps(
        {"vs_base": {"record": str(ws / "runs" / names[1] / "record.json")}, "vs_best": None}))
    (ws / "OPT_LOG.md").write_text("| 1 | keep |\n")
    (ws / "gate").mkdir(exist_ok=True)
    for i in range(3):
        (ws / "gate" / f"gate-20260101T00000{i}Z.log").write_text("log\n")
    r = flaloop(toy, "clean", "toy_attn", "--keep", "2", "--dry-run", "--json")
    assert r.code == 0, r.stderr
    assert len(r.json["removed"]) == 4 and all((ws / p).exists() for p in r.json["removed"])  # dry run
    r = flaloop(toy, "clean", "toy_attn", "--keep", "2", "--json")
    assert r.code == 0, r.stderr
    left = sorted(p.name for p in (ws / "runs").iterdir())
    assert left == [names[1], names[4], names[5]]
    assert r.json["cited"] == [f"runs/{names[1]}"]
    assert sorted(r.json["removed"]) == ["gate/gate-20260101T000000Z.log"] + [f"runs/{names[i]}" for i in (0, 2, 3)]
    assert (ws / "iters" / "0001.json").is_file() and (ws / "OPT_LOG.md").is_file()
    assert (ws / "contract.json").is_file()
    assert r.json["usage"]["runs"] < r.json["usage_before"]["runs"] and r.json["freed_bytes"] > 3000
    assert r.json["usage"]["n_runs"] == 3 and r.json["usage"]["iters"] > 0
    human = flaloop(toy, "clean", "toy_attn", "--keep", "0")
    assert human.code == 0 and "removed 4 run record(s) and gate log(s)" in human.stdout and "1 of them cited" in human.stdout
    assert [p.name for p in (ws / "runs").iterdir()] == [names[1]]
