"""Bad input gets a clear message and exit code 2; list and init do what the README says."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from support.cli import flaloop
from support.repos import OP, git, make_repo


def test_list_reads_the_registry_in_the_targets_python(tmp_path):
    repo = make_repo(tmp_path / "r")
    r = flaloop(repo, "list", "--json")
    assert r.code == 0, r.stderr
    ops = {o["name"]: o for o in r.json["ops"]}
    assert ops[OP]["import_path"] == "minifla.ops.linear_attn"
    assert ops[OP]["test_file"] == "tests/ops/test_linear_attn.py" and ops[OP]["test_file_exists"]
    assert "B1_T64_H2_D32" in ops[OP]["shapes"]  # the names `--shapes` takes
    human = flaloop(repo, "list")
    assert OP in human.stdout and "tests/ops/test_linear_attn.py" in human.stdout and "B1_T64_H2_D32" in human.stdout


def test_a_bench_of_the_commit_an_iteration_gated_names_that_gate(tmp_path):
    from flaloop.bench.run import gated_by_loop
    from flaloop.core import git as git_mod
    from flaloop.task.target import Target

    repo = make_repo(tmp_path / "r")
    target, head = Target.discover(str(repo)), git(repo, "rev-parse", "HEAD").strip()
    iters = repo / "profile" / f"{OP}-opt" / "iters"
    iters.mkdir(parents=True)
    git_mod.ensure_ignored(repo, f"profile/{OP}-opt")  # as init does: the workspace is no change of the tree
    gate = {"green": True, "signal_only": False, "counts": {"passed": 3}, "k_expr": None}
    (iters / "0001.json").write_text(json.dumps({"iter": 1, "status": "keep", "commit": head, "direction": "d",
                                                 "best_before": None, "created": "2026-01-01T00:00:00Z",
                                                 "gate": gate}))
    got = gated_by_loop(target, OP, git_mod.tree_state(repo))
    assert got["green"] and got["reused_from"] == "iteration 1 of the loop" and got["counts"] == {"passed": 3}
    (repo / "README.md").write_text("edited\n")  # another tree state: no gate of it
    assert gated_by_loop(target, OP, git_mod.tree_state(repo)) is None


def test_init_writes_contract_and_draft_with_the_frozen_set(tmp_path):
    repo = make_repo(tmp_path / "r")
    r = flaloop(repo, "init", OP, "--target", "1.3x", "--shapes", "B1_T64_H2_D32", "--langs", "triton,cuda",
                "--input", "k=l2norm", "--json")
    assert r.code == 0, r.stderr
    c = r.json
    frozen = {f["path"]: f["reason"] for f in c["frozen"]}
    assert set(frozen) >= {"tests/ops/test_linear_attn.py", "tests/conftest.py",
                           "minifla/ops/linear_attn/naive.py", "minifla/ops/linear_attn/fused_recurrent.py",
                           "minifla/utils.py"}
    assert frozen["minifla/utils.py"] == "defines assert_close"
    assert "minifla/ops/linear_attn/chunk.py" not in frozen  # the kernel under optimization
    assert c["entry_file"] == "minifla/ops/linear_attn/chunk.py"
    assert c["signature"].startswith("chunk_linear_attn(q")
    assert c["base_commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert c["target_speedup"] == 1.3 and c["input_overrides"] == {"k": "l2norm"}
    ws = repo / "profile" / f"{OP}-opt"
    draft = (ws / "docs" / "draft.md").read_text()
    for field in ("Op and entry point", "Target", "Allowed languages", "Validation command",
                  "Benchmark command", "Promotion criteria", "Frozen scope"):
        assert f"## {field}" in draft
    assert json.loads((ws / "contract.json").read_text())["op"] == OP
    # git ignores the workspace, so the user's status stays clean
    assert git(repo, "status", "--porcelain") == ""
    again = flaloop(repo, "init", OP)
    assert again.code == 2 and "--force" in again.stderr


def test_unknown_op_suggests_close_names(tmp_path):
    repo = make_repo(tmp_path / "r")
    r = flaloop(repo, "init", "chunk_linear_atn")
    assert r.code == 2
    assert "unknown op 'chunk_linear_atn'" in r.stderr and "did you mean chunk_linear_attn" in r.stderr
    # every other command too: a typo is named as one, never sent to write a contract for it
    assert flaloop(repo, "init", OP, "--shapes", "B1_T64_H2_D32").code == 0
    for cmd in (["status"], ["report"], ["stop", "--go"]):
        r = flaloop(repo, cmd[0], "chunk_linear_atn", *cmd[1:], "--json")
        assert r.code == 2 and "unknown op 'chunk_linear_atn'" in r.json["error"], (cmd, r.stdout)
        assert r.json["hint"].startswith(f"did you mean {OP}") and r.json["hint"].endswith(f"(ops with a contract: {OP})")
        assert "flaloop init chunk_linear_atn" not in r.stdout + r.stderr
    r = flaloop(repo, "status", "zzz", "--json")
    assert r.code == 2 and r.json["hint"].startswith("`flaloop list` names the ops")


def test_missing_test_file_says_how_to_set_test_file(tmp_path):
    repo = make_repo(tmp_path / "r")
    (repo / "tests" / "ops" / "test_linear_attn.py").unlink()
    r = flaloop(repo, "init", OP)
    assert r.code == 2 and "does not exist" in r.stderr and "test_file" in r.stderr


def test_not_a_git_repo(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    r = flaloop(plain, "list")
    assert r.code == 2 and "not inside a git repository" in r.stderr


def test_unknown_base_ref(tmp_path):
    repo = make_repo(tmp_path / "r")
    r = flaloop(repo, "init", OP, "--base", "no-such-branch", "--json")
    assert r.code == 2
    assert r.json["ok"] is False and "unknown base ref 'no-such-branch'" in r.json["error"]


def test_missing_registry(tmp_path):
    repo = make_repo(tmp_path / "r")
    shutil.rmtree(repo / "benchmarks")
    r = flaloop(repo, "list")
    assert r.code == 2 and "no op registry" in r.stderr and "flaloop.toml" in r.stderr


def test_ops_from_flaloop_toml_without_registry(tmp_path):
    repo = make_repo(tmp_path / "r")
    shutil.rmtree(repo / "benchmarks")
    (repo / "flaloop.toml").write_text('[ops.linattn]\nimport_path = "minifla.ops.linear_attn"\n'
                                       'func_name = "chunk_linear_attn"\n'
                                       'test_file = "tests/ops/test_linear_attn.py"\n')
    r = flaloop(repo, "list", "--json")
    assert r.code == 0, r.stderr
    assert r.json["ops"][0]["name"] == "linattn" and r.json["ops"][0]["source"] == "flaloop.toml"


def test_every_command_refuses_an_op_without_contract(tmp_path):
    repo = make_repo(tmp_path / "r")
    for cmd in (["gate", OP], ["bench", OP], ["verify", OP]):
        r = flaloop(repo, *cmd)
        assert r.code == 2, cmd
        assert f"flaloop init {OP}" in r.stderr


def test_init_force_over_a_loop_says_what_becomes_of_its_base(tmp_path):
    """A loop with a baseline: --force alone refuses to move the base; --keep-base keeps it (the loop
    goes on); --new-loop moves it, archives the old loop and says so."""
    repo = make_repo(tmp_path / "r")
    assert flaloop(repo, "init", OP, "--shapes", "B1_T64_H2_D32").code == 0
    ws = repo / "profile" / f"{OP}-opt"
    old = git(repo, "rev-parse", "HEAD").strip()
    (ws / "iters").mkdir()
    (ws / "iters" / "0000.json").write_text(json.dumps({"iter": 0, "status": "baseline", "commit": old, "direction": "baseline", "best_before": None}))
    (repo / "notes.txt").write_text("a kept change\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "kept")
    new = git(repo, "rev-parse", "HEAD").strip()

    r = flaloop(repo, "init", OP, "--force", "--target", "1.2x", "--json")
    assert r.code == 2 and f"has a baseline at {old[:12]}" in r.json["error"] and new[:12] in r.json["error"]
    assert "--keep-base" in r.json["hint"] and "--new-loop" in r.json["hint"]
    assert json.loads((ws / "contract.json").read_text())["base_commit"] == old  # untouched

    r = flaloop(repo, "init", OP, "--force", "--keep-base", "--target", "1.2x", "--json")
    assert r.code == 0 and r.json["base_commit"] == old and r.json["target_speedup"] == 1.2 and not r.json["new_loop"]
    assert (ws / "iters" / "0000.json").is_file()
    r = flaloop(repo, "init", OP, "--force", "--keep-base", "--base", "HEAD")
    assert r.code == 2 and "--keep-base keeps the loop's base" in r.stderr

    r = flaloop(repo, "init", OP, "--force", "--new-loop")
    assert r.code == 0 and f"the base moved from {old[:12]} to {new[:12]}: a new loop starts" in r.stdout
    assert json.loads((ws / "contract.json").read_text())["base_commit"] == new
    assert not (ws / "iters").exists() and list((ws / "archive").glob("*/iters/0000.json"))
    # no loop any more: --force alone replaces the contract as before
    assert flaloop(repo, "init", OP, "--force").code == 0


def test_frozen_edit_before_init_is_refused(tmp_path):
    repo = make_repo(tmp_path / "r")
    (repo / "tests" / "conftest.py").write_text("# edited\n")
    r = flaloop(repo, "init", OP)
    assert r.code == 2 and "tests/conftest.py" in r.stderr


def test_python_m_flaloop_and_console_script_agree():
    script = Path(sys.executable).parent / "flaloop"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "gate" in out.stdout
