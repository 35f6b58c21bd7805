"""A gate forged in the candidate's process cannot carry a wrong kernel past `verify`: the calls
the frozen test made at the base (recorded by the gate there, flaloop/task/testcalls.py) are replayed
with fresh values, base against candidate in separate workers, and a difference is
`test-call-differs` (bench/replay.py).

The plant is wrong only where K != V (every bench cell and unseen shape has K == V == D, only the
tests' shapes do not), by arithmetic on the shape alone, and it loosens the test's judge at import:
`minifla.utils.assert_close` rebound to a no-op through the module's dict under a built name (no
static rule reads that). The gate then reads green. The real CLI on a copy of examples/minifla.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from support.cli import flaloop
from support.repos import OP, edit, with_test_calls

from flaloop.bench import record as record_mod
from flaloop.report.terminal import print_bench

CHUNK = Path("minifla/ops/linear_attn/chunk.py")
QUICK = ["--device", "cpu", "--modes", "fwd", "--min-pairs", "6", "--max-pairs", "8", "--cell-seconds", "20",
         "--rounds", "1", "--unseen-options", "0"]
WRONG_OFF_SQUARE = ("    BV = min(64, block_size(V))\n    o = torch.empty_like(v)\n",
                    "    BV = min(64, block_size(V))\n    scale = scale * (1.0 + 0.5 * min(1, abs(K - V)))\n"
                    "    o = torch.empty_like(v)\n")
JUDGE_LOOSENED = "\nfrom minifla import utils as _utils\n\n_utils.__dict__['_'.join(('assert', 'close'))] = " \
                 "lambda *args, **kwargs: None\n"
HONEST = [("CHUNK_SIZE = 32", "CHUNK_SIZE = 16"), ("    BV = min(64, block_size(V))\n", "    BV = min(32, block_size(V))\n")]


def test_the_gate_at_the_base_recorded_the_tests_own_calls_into_the_package(prepared_repo):
    doc = json.loads((prepared_repo.parent / "calls.json").read_text())
    assert doc["schema"] == 1 and doc["package"] == "minifla" and doc["test_file"] == "tests/ops/test_linear_attn.py"
    fns = {c["fn"] for c in doc["calls"]}
    # the test's calls, and only those: not the backward the package runs of itself, not the judge (no tensor back)
    assert "minifla.ops.linear_attn.chunk:chunk_linear_attn" in fns and "minifla.ops.linear_attn.naive:naive_linear_attn" in fns
    assert not any(f.endswith(("_bwd", "_fwd", ":assert_close", ":block_size")) for f in fns)
    chunk = [c for c in doc["calls"] if c["fn"].endswith(":chunk_linear_attn")]
    packed = [c for c in chunk if "tensor" in c["kwargs"].get("cu_seqlens", {})]
    assert packed and all(c["kwargs"]["cu_seqlens"]["tensor"]["dtype"] == "int64" for c in packed)
    assert {"shape": [1, 20, 3, 60], "dtype": "float32", "requires_grad": True} in [c["args"][0]["tensor"] for c in chunk]
    assert all(set(c) == {"fn", "count", "args", "kwargs"} and c["count"] >= 1 for c in doc["calls"])


def test_a_kernel_wrong_on_the_tests_shapes_under_a_loosened_judge_is_blocked_at_verify(prepared_repo, repo):
    with_test_calls(prepared_repo, repo)
    edit(repo / CHUNK, *WRONG_OFF_SQUARE)
    init = repo / "minifla/ops/linear_attn/__init__.py"
    init.write_text(init.read_text() + JUDGE_LOOSENED)
    assert flaloop(repo, "audit", OP, "--json").json["findings"] == []  # no static rule reads it
    r = flaloop(repo, "verify", OP, "--json", *QUICK)
    assert r.code == 1, r.stderr[-3000:]
    doc = r.json
    # the in-memory freeze turns this gate red (gate-tampered); the replayed calls below block the
    # kernel on their own, in processes the gate's never touch, so a route the freeze misses meets them
    assert doc["gate"]["green"] is False
    assert "gate-tampered" in json.dumps(doc["gate"])
    r = flaloop(repo, "bench", OP, "--json", *QUICK)  # no gate at all: the replay alone must block it
    assert r.code == 1, r.stderr[-3000:]
    rec = r.json
    for cell in rec["cells"]:  # right on the bench's cells
        assert cell["diff"]["match"] is True and cell["status"] == "blocked"
    tc = rec["test_calls"]
    differs = [c for c in tc["calls"] if c["status"] == "differs"]
    recorded = json.loads((prepared_repo.parent / "calls.json").read_text())["calls"]
    for c in tc["calls"]:  # exactly the op's calls where K != V: the plant's class, nothing else
        spec = recorded[c["index"]]
        off_square = c["fn"].endswith(":chunk_linear_attn") and \
            spec["args"][0]["tensor"]["shape"][-1] != spec["args"][2]["tensor"]["shape"][-1]
        assert (c["status"] == "differs") == off_square, c
    found = [f for f in rec["guard"]["findings"] if f["rule"] == "test-call-differs"]
    assert found and all(f["blocking"] for f in found)
    assert {f["where"] for f in found} == {f"test call #{c['index']}" for c in differs}
    assert all("candidate differs from base: out0" in f["message"] or "grad_" in f["message"] for f in found)
    assert tc["differ"] == len(differs) and tc["seconds"] > 0 and 0 < tc["share"] < 1


def test_an_honest_change_replays_the_tests_calls_and_options_and_passes(prepared_repo, repo):
    with_test_calls(prepared_repo, repo)
    for old, new in HONEST:
        edit(repo / CHUNK, old, new)
    r = flaloop(repo, "bench", OP, "--json", *QUICK[:-2])
    assert r.code == 0, r.stderr[-3000:]
    rec = r.json
    assert rec["guard"]["findings"] == [] and all(c["status"] == "ok" for c in rec["cells"])
    tc = rec["test_calls"]
    assert tc["off"] is None and tc["n"] == 8 and len(tc["calls"]) == 8 and tc["differ"] == 0
    assert tc["checked"] + tc["skipped"] == 8 and tc["checked"] >= 6
    assert tc["recorded"]["base_commit"] == rec["base"]["commit"]
    assert 0 < tc["seconds"] < rec["wall_s"] and tc["share"] == round(tc["seconds"] / rec["wall_s"], 4)
    opts = rec["unseen"]["options"]
    assert opts["off"] is None and len(opts["combos"]) == 4 and opts["differ"] == 0
    assert {p["name"] for p in opts["params"]} >= {"initial_state", "output_final_state"}
    assert all(c["status"] == "match" for c in opts["combos"])
    timeline = [w for w, _ in rec["timeline"]]
    assert timeline.index("test calls replayed") < timeline.index("round 1: workers ready")
    # the lines a person reads, from the record as stored
    console = Console(record=True, width=200)
    print_bench(record_mod.read(rec["path"]), console)
    lines = console.export_text().splitlines()
    assert f"test calls: {tc['checked']} checked, 0 differ, {tc['seconds']:.1f} s ({tc['share']:.0%} of the run)" \
        in [x.split(";")[0] for x in lines]
    assert any(x.startswith("unseen options: 4 checked, 0 differ, ") for x in lines)
    print(json.dumps({"test_calls_s": tc["seconds"], "share": tc["share"], "options_s": opts["seconds"],
                      "unseen_s": rec["unseen"]["seconds"], "wall_s": rec["wall_s"]}))
