"""Shapes nobody times (bench/unseen.py, bench/warmup.check_unseen): a candidate right on every
bench cell and wrong on small shapes that only a project's tests have (undoing FLA's fix #988 read
FASTER 1.10x on B8_T1024_H8_D64 while wrong on B1-T64-H2-D32) is blocked by `flaloop bench`
itself as unseen-shape-differs, naming the shape and the worst tensor.

The plants are in a copy of examples/minifla, run by the real CLI with the Triton interpreter, and
no static rule reads them (`flaloop audit` is clean): nothing kept in module state, no comparison
of a shape with a literal; the wrong result comes from arithmetic on the shape alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from support.cli import flaloop
from support.repos import OP, edit, make_dispatched_repo

from flaloop.bench import record as record_mod
from flaloop.bench import unseen
from flaloop.bench.model import BenchConfig, Cell
from flaloop.report.terminal import print_bench

CHUNK = Path("minifla/ops/linear_attn/chunk.py")
# the bench cells are the contract's one shape (B1_T64_H2_D32), fwd only: the unseen shapes run both modes anyway
QUICK = ["--device", "cpu", "--modes", "fwd", "--min-pairs", "6", "--max-pairs", "8", "--cell-seconds", "20",
         "--rounds", "1"]
MINIFLA_SHAPES = {  # examples/minifla/benchmarks/ops/registry.py
    "B1_T64_H2_D32": {"B": 1, "T": 64, "H": 2, "D": 32}, "B2_T100_H2_D16": {"B": 2, "T": 100, "H": 2, "D": 16},
    "B8_T1024_H8_D64": {"B": 8, "T": 1024, "H": 8, "D": 64}, "B4_T2048_H16_D64": {"B": 4, "T": 2048, "H": 16, "D": 64},
    "B2_T4096_H16_D128": {"B": 2, "T": 4096, "H": 16, "D": 128},
}

# Each is right on the bench's B1_T64_H2_D32 (its differential check passes there) and wrong elsewhere.
PLANTS = {
    # the loop bound rounded down: the chunk that holds the tail of the sequence is never swept, so
    # the output is right only when T is a multiple of the chunk (32), as the bench's T=64 is
    "tail-chunk-dropped": ("NT=triton.cdiv(max_len, BT), BT=BT, BK=BK, BV=BV,\n        USE_INITIAL_STATE",
                           "NT=max_len // BT, BT=BT, BK=BK, BV=BV,\n        USE_INITIAL_STATE"),
    # as a miscompile of small tiles would be: wrong when heads x head dim is below the bench's 2 x 32,
    # by arithmetic on the shape (1 >> 0 is 1 there, 0 from 64 up), never a comparison
    "small-heads-scaled": ("    BV = min(64, block_size(V))\n",
                           "    BV = min(64, block_size(V))\n    lanes = H * K\n"
                           "    scale = scale * (1.0 + 0.5 * (1 >> (lanes // 64)))\n"),
}
# a different but correct tiling: chunks of 16 timesteps, V in blocks of at most 32
HONEST = [("CHUNK_SIZE = 32", "CHUNK_SIZE = 16"), ("    BV = min(64, block_size(V))\n", "    BV = min(32, block_size(V))\n")]


def bench(repo: Path, *args: str):
    r = flaloop(repo, "bench", OP, "--json", *QUICK, *args)
    assert r.stdout.strip(), r.stderr[-3000:]
    return r, r.json


def audit_is_clean(repo: Path) -> None:
    r = flaloop(repo, "audit", OP, "--json")
    assert r.code == 0 and r.json["findings"] == [], r.stdout  # no static rule reads the plant


# -- the draw ---------------------------------------------------------------------------------------


# -- the warm-up over scripted workers ------------------------------------------------------------------


# -- the real CLI on minifla --------------------------------------------------------------------------

@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_candidate_wrong_only_on_shapes_nobody_times_is_blocked_naming_the_shape(repo, plant):
    edit(repo / CHUNK, *PLANTS[plant])
    audit_is_clean(repo)
    r, rec = bench(repo)
    assert r.code == 1, r.stderr[-3000:]
    for cell in rec["cells"]:  # right on the bench's own shape: the differential check passes there
        assert cell["diff"]["match"] is True, cell["diff"]
        assert cell["status"] == "blocked" and cell["reason"] == "guard: unseen-shape-differs (run stopped)"
        assert cell["pairs"] == []
    found = [f for f in rec["guard"]["findings"] if f["rule"] == "unseen-shape-differs"]
    assert found and all(f["blocking"] for f in found)
    u = rec["unseen"]
    differs = {f"{s['name']}/{m}" for s in u["shapes"] for m, v in s["modes"].items() if v["status"] == "differs"}
    assert differs and {f["where"] for f in found} == {f"unseen {d}" for d in differs}
    assert all("candidate differs from base: out0" in f["message"] for f in found)  # the worst tensor, named
    assert u["differ"] == len(differs) < u["checked"]  # not every shape: the class is narrow


def test_an_honest_retiling_passes_and_the_record_holds_seed_shapes_and_seconds(repo):
    for old, new in HONEST:
        edit(repo / CHUNK, old, new)
    audit_is_clean(repo)
    r, rec = bench(repo)
    assert r.code == 0, r.stderr[-3000:]
    assert rec["guard"]["findings"] == [] and all(c["status"] == "ok" for c in rec["cells"])
    u = rec["unseen"]
    assert u["off"] is None and u["seed"] == 0 and u["n"] == 4 and u["modes"] == ["fwd", "fwdbwd"]
    assert (u["checked"], u["differ"], u["skipped"]) == (8, 0, 0)
    assert 0 < u["seconds"] < rec["wall_s"] and u["share"] == pytest.approx(u["seconds"] / rec["wall_s"], abs=1e-3)
    # the shapes are the draw the seed gives for these cells and shape configs: the finding could be reproduced
    cells = [Cell.from_dict(c["cell"]) for c in rec["cells"]]
    again = unseen.plan(BenchConfig.from_dict(rec["config"]), MINIFLA_SHAPES, cells, {})["shapes"]
    assert [{k: s[k] for k in ("name", "shape", "seqlens")} for s in u["shapes"]] == again
    for s in u["shapes"]:
        for v in s["modes"].values():
            assert v["status"] == "match" and v["worst"]["rel_rms"] <= u["tol"] and v["seconds"] > 0
    assert [w for w, _ in rec["timeline"]].index("unseen shapes checked") < [w for w, _ in rec["timeline"]].index(
        "round 1: workers ready")
    # the one line a person reads, from the record as stored
    console = Console(record=True, width=200)
    print_bench(record_mod.read(rec["path"]), console)
    line = next(x for x in console.export_text().splitlines() if x.startswith("unseen shapes:"))
    assert line == (f"unseen shapes: 8 checked, 0 differ, {u['seconds']:.1f} s ({u['share']:.0%} of the run), seed 0")
    print(json.dumps({"unseen_seconds": u["seconds"], "share": u["share"], "wall_s": rec["wall_s"]}))


def test_a_wrong_result_cannot_be_allowed(repo):
    for rule in ("unseen-shape-differs", "differs-from-base"):
        r = flaloop(repo, "audit", OP, "--allow", rule, "--why", "the small shapes do not matter to us")
        assert r.code == 2 and "cannot be allowed" in r.stdout + r.stderr, r.stdout + r.stderr


# -- a backend the unseen shapes miss, on the toy op through the real CLI ------------------------------

TOY_SHAPES = {"B2_T64_H2_D16": {"B": 2, "T": 64, "H": 2, "D": 16},  # tests/support/toy's registry
              "B1_T128_H2_D32": {"B": 1, "T": 128, "H": 2, "D": 32}}


@pytest.mark.parametrize("verify, covered", [("q.shape[-1] >= 32", True), ("q.shape[1] >= 64", False)],
                         ids=["keyed-on-the-head-dim", "keyed-on-T"])
def test_a_backend_that_declines_the_small_shapes_is_checked_on_the_cells_head_dims_or_said(tmp_path, verify, covered):
    repo = make_dispatched_repo(tmp_path / "toy", verify)
    cell = TOY_SHAPES["B1_T128_H2_D32"]
    # a seed whose two shapes both have head dims below 32, so that the first draw misses the backend
    seed = next(s for s in range(100) if all(x["shape"]["D"] < 32 for x in unseen.draw(
        TOY_SHAPES, n=2, seed=s, avoid=[cell, *TOY_SHAPES.values()])))
    assert flaloop(repo, "init", "toy_attn", "--shapes", "B1_T128_H2_D32", "--modes", "fwd").code == 0
    r = flaloop(repo, "bench", "toy_attn", "--aa", "--json", "--device", "cpu", "--modes", "fwd", "--min-pairs", "6",
                "--max-pairs", "6", "--rounds", "1", "--cell-seconds", "20", "--unseen-shapes", "2",
                "--unseen-seed", str(seed))
    assert r.code == 0, r.stderr[-3000:]
    u = r.json["unseen"]
    first, on_path = u["shapes"][:2], u["shapes"][2:]
    assert all(v["served"] == {"base": [], "cand": []} for x in first for v in x["modes"].values())
    assert u["on_path_because"] == ["toy.toy_attn -> blocked"]
    assert len(on_path) == 2 and all(x["on_path"] and x["shape"]["D"] == 32 for x in on_path)
    served = {k for x in on_path for v in x["modes"].values() for k in v["served"]["cand"]}
    warnings = [f for f in r.json["guard"]["findings"] if f["rule"] == "unseen-off-path"]
    if covered:
        assert served == {"toy.toy_attn -> blocked"} and "off_path" not in u and not warnings
    else:
        assert served == set() and u["off_path"] == ["toy.toy_attn -> blocked"]
        assert len(warnings) == 1 and not warnings[0]["blocking"]


