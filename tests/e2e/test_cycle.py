"""Cycle time without losing trust: a gate of an unchanged tree state is reused (and only then), a
quick bench is labelled a signal, and with several GPUs verify runs the gate beside the bench and
withdraws the bench when the gate goes red."""

from __future__ import annotations

import json

from support.cli import flaloop
from support.repos import edit

FAST = "toyop/ops/toy/fast.py"
# the unseen-shapes check is off here (it has its own tests, tests/e2e/test_unseen.py): the suite's time
QUICK = ["--device", "cpu", "--min-pairs", "6", "--max-pairs", "8", "--cell-seconds", "20", "--rounds", "1", "--unseen-shapes", "0"]


def test_a_green_gate_of_the_same_tree_state_is_reused_and_only_then(toy):
    first = flaloop(toy, "gate", "toy_attn", "--json")
    assert first.code == 0, first.stderr
    assert first.json["reused_from"] is None
    again = flaloop(toy, "gate", "toy_attn", "--json")
    assert again.code == 0 and again.json["reused_from"] == first.json["started"]
    assert "reused" in flaloop(toy, "gate", "toy_attn").stdout
    forced = flaloop(toy, "gate", "toy_attn", "--json", "--regate")
    assert forced.code == 0 and forced.json["reused_from"] is None
    # anything the gate depends on changes: it runs again
    assert flaloop(toy, "gate", "toy_attn", "--json", env={"TOY_SETTING": "1"}).json["reused_from"] is None
    edit(toy / FAST, "def toy_log(q):", "# a comment is a change too\ndef toy_log(q):")
    assert flaloop(toy, "gate", "toy_attn", "--json").json["reused_from"] is None
    # a red gate is never reused
    edit(toy / FAST, "return o.to(q.dtype), None", "return (o * 2).to(q.dtype), None")
    assert flaloop(toy, "gate", "toy_attn", "--json").code == 1
    red_again = flaloop(toy, "gate", "toy_attn", "--json")
    assert red_again.code == 1 and red_again.json["reused_from"] is None


def test_a_quick_bench_is_one_round_and_labelled_a_signal(toy):
    r = flaloop(toy, "bench", "toy_attn", "--quick", "--device", "cpu", "--modes", "fwd", "--json")
    assert r.code == 0, r.stderr
    rec = r.json
    assert rec["signal"] is True and rec["config"]["rounds"] == 1 and rec["config"]["half_width"] == 0.01
    assert len(rec["rounds"]) == 1
    human = flaloop(toy, "bench", "toy_attn", "--quick", "--device", "cpu", "--modes", "fwd")
    assert "SIGNAL ONLY (--quick)" in human.stdout


def test_verify_with_two_gpus_runs_the_gate_beside_the_bench(toy):
    r = flaloop(toy, "verify", "toy_attn", "--gpus", "0,1", "--workers", "2", "--modes", "fwd", "--json", *QUICK)
    assert r.code == 0, r.stderr[-3000:]
    doc = r.json
    assert "verify on 2 GPUs: the gate on 0 (2 xdist workers), the bench on 1 at the same time" in r.stderr
    assert doc["gate"]["green"] and set(doc["gate"]["run"]["workers"].values()) == {"0"}
    assert doc["bench"]["gpu"] == "1" and doc["bench"]["unverified"] is False
    assert doc["bench"]["gate"]["green"] is True  # the record names the gate that ran beside it
    saved = json.loads(open(doc["bench"]["path"]).read())
    assert saved["gate"]["green"] is True


def test_a_red_gate_withdraws_the_bench_running_beside_it(toy):
    edit(toy / FAST, "return o.to(q.dtype), None", "return (o * 2).to(q.dtype), None")
    r = flaloop(toy, "verify", "toy_attn", "--gpus", "0,1", "--workers", "2", "--modes", "fwd", "--json", *QUICK)
    assert r.code == 1, r.stderr[-3000:]
    assert r.json["bench"] is None and r.json["gate"]["green"] is False
    assert "no benchmark result is shown on a red gate" in r.stderr


def test_a_lean_import_is_checked_against_the_real_one(toy):
    """`--import lean` skips package __init__ files the op does not name; a real import of both
    trees runs beside it, and numeric settings that differ between the two block the run."""
    from support.repos import commit_all

    args = ["bench", "toy_attn", "--aa", "--base", "HEAD", "--import", "lean", "--modes", "fwd", "--json", *QUICK]
    r = flaloop(toy, *args)
    assert r.code == 0, r.stderr[-2000:]
    rec = r.json
    assert rec["workers"]["base"]["import_mode"] == "lean" and rec["workers"]["base"]["lazy_packages_ran"] == []
    assert rec["lean_check"]["differs"] == [] and set(rec["lean_check"]["reference_pids"]) == {"base", "cand"}
    assert rec["lean_check"]["kernels_compared_on"] == rec["cells"][0]["cell"]["id"]
    assert "lean import checked against the real one" in [w for w, _ in rec["timeline"]]
    # the package's __init__ (which the op never asks for a name) switches a setting on at import
    init = toy / "toyop/__init__.py"
    init.write_text('import os\nos.environ["FLA_TOY_FAST_MATH"] = "1"\n')
    commit_all(toy)
    r = flaloop(toy, *args)
    assert r.code == 1, r.stderr[-2000:]
    rec = r.json
    rules = {f["rule"] for f in rec["guard"]["findings"] if f["blocking"]}
    assert rules == {"lean-import-differs"} and "FLA_TOY_FAST_MATH" in rec["lean_check"]["differs"][0]
    assert {c["verdict"] for c in rec["cells"]} == {"BLOCKED"}


def test_a_lean_run_whose_every_cell_is_blocked_in_the_warm_up_still_checks_the_import(toy):
    """No cell reaches a round (the candidate is wrong): no measuring pair is taken, and the lean
    import is held against the real one with the warm-up pair's settings."""
    edit(toy / FAST, "return o.to(q.dtype), None", "return (o * 1.5).to(q.dtype), None")
    r = flaloop(toy, "bench", "toy_attn", "--import", "lean", "--modes", "fwd", "--json", *QUICK)
    assert r.code == 1, r.stderr[-2000:]
    rec = r.json
    assert {c["verdict"] for c in rec["cells"]} == {"BLOCKED"} and rec["rounds"] == []
    # the warm-up pair's word on where the op came from: the candidate's own checkout (a worktree of
    # the snapshotted working tree), not the base's
    cand_file = rec["workers"]["cand"]["op_module_file"]
    assert "/cand/" in cand_file and cand_file != rec["workers"]["base"]["op_module_file"]
    assert rec["lean_check"]["differs"] == [] and set(rec["lean_check"]["reference_pids"]) == {"base", "cand"}


