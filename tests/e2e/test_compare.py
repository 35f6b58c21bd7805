"""`flaloop compare A B` over two real run records, `--fail-on slower` on bench, compare and sweep,
`flaloop report --format github`, and the pull-request CI script (examples/ci/pr_check.py) on
examples/minifla with a recorded pull_request event (Triton interpreter)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from support.candidates import CHUNK, QUICK, SLOWER_CHUNK, branch
from support.cli import flaloop
from support.repos import GIT_ENV, OP, ROOT, edit, git

CI = ROOT / "examples" / "ci"
# more pairs than QUICK: an interval from four pairs on a shared 2-core CPU is wide
PAIRS = ["--min-pairs", "8", "--max-pairs", "10"]


def bench(repo: Path, *args: str):
    r = flaloop(repo, "bench", OP, "--json", *QUICK, *PAIRS, *args)
    return r, (json.loads(r.stdout) if r.stdout.strip() else {})


def compare(repo: Path, *args: str):
    r = flaloop(repo, "compare", *args, "--json")
    return r, (json.loads(r.stdout) if r.stdout.strip() else {})


def test_two_records_of_one_base_compare_with_intervals_and_a_slower_one_fails_ci(repo):
    # A: chunks of 64 (half the sequential steps: faster); B: chunks of 64 and a sleep per call (slower)
    edit(repo / CHUNK, "CHUNK_SIZE = 32", "CHUNK_SIZE = 64")
    r, a = bench(repo, "--fail-on", "slower")
    assert r.code == 0, r.stderr[-2000:]
    edit(repo / CHUNK, *SLOWER_CHUNK)
    r, b = bench(repo, "--fail-on", "slower")
    assert r.code == 1 and "--fail-on slower: SLOWER on B1_T64_H2_D32/fwd" in r.stderr, r.stderr[-2000:]
    assert b["cells"][0]["verdict"] == "SLOWER"  # the record is still written and printed
    a_dir, b_dir = Path(a["path"]).parent, Path(b["path"]).parent

    r, cmp = compare(repo, a["path"], str(b_dir))
    assert r.code == 0, r.stderr
    assert cmp["paired"] and cmp["same_machine"] and cmp["not_comparable"] == [] and cmp["cells_not_comparable"] == []
    (cell,) = cmp["cells"]
    assert cell["id"] == "B1_T64_H2_D32/fwd" and cell["basis"] == "paired"
    # B's speedup relative to A's, inside an interval built from both records' own intervals
    assert abs(cell["ratio"] - cell["b"]["speedup"] / cell["a"]["speedup"]) < 1e-9
    assert cell["ci_low"] < cell["ratio"] < cell["ci_high"] < 1 and cell["verdict"] == "SLOWER"
    assert cmp["geomean"]["verdict"] == "SLOWER" and cmp["slower"] == ["B1_T64_H2_D32/fwd", "geomean"]
    assert compare(repo, a["path"], b["path"], "--fail-on", "slower")[0].code == 1
    # the other way round B -> A is FASTER; run ids work as names; the table says the same
    human = flaloop(repo, "compare", b_dir.name, a_dir.name, "--op", OP, "--fail-on", "slower")
    assert human.code == 0 and "| FASTER |" in human.stdout and "Geomean of B vs A" in human.stdout, human.stdout

    # a record from another machine: listed as not comparable, no interval, no verdict
    other = b_dir.parent / (b_dir.name + "-other")
    shutil.copytree(b_dir, other)
    doc = json.loads((other / "record.json").read_text())
    doc["env"].update(device="cuda", device_name="NVIDIA H200", device_uuid="GPU-1234", driver="570.1")
    (other / "record.json").write_text(json.dumps(doc))
    r, cmp = compare(repo, str(a_dir), str(other / "record.json"), "--fail-on", "slower")
    assert r.code == 0, r.stderr  # nothing can be SLOWER without an interval
    why = {m["what"]: m["why"] for m in cmp["not_comparable"]}
    assert why.get("device") == "measured on different devices" and why.get("driver") == "different driver", why
    assert not cmp["same_machine"] and cmp["geomean"] is None
    assert cmp["cells"][0]["ci_low"] is None and cmp["cells"][0]["verdict"] is None
    assert "measured on different devices" in cmp["cells"][0]["note"]

    missing = flaloop(repo, "compare", a_dir.name, "20990101T000000Z-bench")
    assert missing.code == 2 and "no run record '20990101T000000Z-bench'" in missing.stderr
    assert a_dir.name in missing.stderr  # the hint names the records there are

    # the report of this tree state (B, a regression) as a pull-request comment
    r = flaloop(repo, "report", OP, "--format", "github")
    assert r.code == 0, r.stderr[-2000:]
    comment = (repo / "profile" / f"{OP}-opt" / "report" / "comment.md").read_text()
    assert comment.startswith("<!-- flaloop-report -->") and comment == r.stdout.rstrip("\n") + "\n"
    assert f"<details><summary><b>{OP}</b>: regression" in comment and "</details>" in comment
    assert "| `B1_T64_H2_D32/fwd` | **SLOWER** |" in comment and "Guard: no findings." in comment
    assert "\n- Gate: **" in comment  # the gate the claim stands on, whatever it was


def test_fail_on_slower_fails_a_sweep_with_a_slower_candidate(repo):
    branch(repo, "slow", CHUNK, *SLOWER_CHUNK)
    r = flaloop(repo, "sweep", OP, "--candidates", "slow", "--fail-on", "slower", "--json", *QUICK, *PAIRS)
    assert r.code == 1 and "--fail-on slower: SLOWER on slow:" in r.stderr, r.stderr[-2000:]
    sweep_dir = Path(json.loads(r.stdout)["path"]).parent
    plain = flaloop(repo, "report", "--sweep", str(sweep_dir))
    assert plain.code == 0 and "# Sweep: candidates of" in plain.stdout
    gh = flaloop(repo, "report", "--sweep", str(sweep_dir), "--format", "github")
    assert gh.code == 0 and "<details><summary><b>slow</b>: ok, SLOWER" in gh.stdout, gh.stdout
    assert "**slow SLOWER**" in gh.stdout
    assert flaloop(repo, "report").code == 2  # an op or --sweep: one of them


def pr_check(repo: Path, tmp_path: Path, base: str, head: str, *sweep_args: str):
    event = json.loads((CI / "event.json").read_text().replace("BASE_SHA", base).replace("HEAD_SHA", head))
    (tmp_path / "event.json").write_text(json.dumps(event))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(CI / "pr_check.py"), str(tmp_path / "event.json"), str(out),
                        "--repo", str(repo), "--", *sweep_args], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", **GIT_ENV})
    return p, out


def test_the_ci_script_comments_on_a_pull_request_of_minifla(repo, tmp_path):
    base = git(repo, "rev-parse", "HEAD").strip()
    edit(repo / CHUNK, "CHUNK_SIZE = 32", "CHUNK_SIZE = 64")
    git(repo, "commit", "-qam", "chunks of 64")
    head = git(repo, "rev-parse", "HEAD").strip()
    p, out = pr_check(repo, tmp_path, base, head, "--shapes", "B1_T64_H2_D32", *QUICK)
    assert p.returncode == 0, p.stderr[-2000:] + (out / "sweep.log").read_text()[-2000:]
    comment = (out / "comment.md").read_text()
    assert comment.startswith("<!-- flaloop-report -->") and "1 op(s) the change touches" in comment
    assert f"<details><summary><b>{OP}</b>: ok," in comment and "| `B1_T64_H2_D32/fwd` |" in comment
    assert "Gate: green" in comment and "Guard: no findings." in comment and f"`{head[:12]}`" in comment
    assert (out / "exit_code").read_text().strip() == "0" and json.loads((out / "sweep.json").read_text())["ok"]
    # a checkout that is not the pull request's head is not measured
    p, out = pr_check(repo, tmp_path, base, base)
    assert p.returncode == 2 and "not the pull request's head" in (out / "comment.md").read_text()
    # the workflow runs the script on the pull request's head with full history, and posts by the marker
    wf = yaml.safe_load((CI / "flaloop-pr.yml").read_text())
    assert "pull_request" in wf[True]  # YAML 1.1 reads the key `on` as True
    steps = wf["jobs"]["benchmark"]["steps"]
    assert steps[0]["with"]["fetch-depth"] == 0 and "head.sha" in steps[0]["with"]["ref"]
    assert any("pr_check.py" in s.get("run", "") for s in steps)
    assert any("<!-- flaloop-report -->" in s.get("run", "") and "gh api" in s.get("run", "") for s in steps)
