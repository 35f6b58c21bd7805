"""Shapes nobody times (bench/unseen.py, bench/warmup.check_unseen), in-process: the draw, the plan,
and the warm-up's checks run by a session over scripted fake workers (support/sessions.py): what the
base refuses is skipped, what the candidate gets wrong blocks, an A/A's difference is unstable, a
backend's verifier and a dtype's arithmetic are followed. The plants in a copy of examples/minifla,
run by the real CLI, are in tests/e2e/test_unseen.py."""

from __future__ import annotations

import pytest
from support.sessions import CELLS, FakeLauncher, Script

from flaloop.bench import unseen
from flaloop.bench.model import BenchConfig, Cell, cli_args
from flaloop.bench.session import Session
from flaloop.core.errors import UsageError
from flaloop.report.terminal import unseen_line

MINIFLA_SHAPES = {  # examples/minifla/benchmarks/ops/registry.py
    "B1_T64_H2_D32": {"B": 1, "T": 64, "H": 2, "D": 32}, "B2_T100_H2_D16": {"B": 2, "T": 100, "H": 2, "D": 16},
    "B8_T1024_H8_D64": {"B": 8, "T": 1024, "H": 8, "D": 64}, "B4_T2048_H16_D64": {"B": 4, "T": 2048, "H": 16, "D": 64},
    "B2_T4096_H16_D128": {"B": 2, "T": 4096, "H": 16, "D": 128},
}


def test_the_draw_spreads_over_every_dimension_and_misses_every_timed_shape():
    avoid = list(MINIFLA_SHAPES.values())
    shapes = unseen.draw(MINIFLA_SHAPES, n=4, seed=0, avoid=avoid)
    assert shapes == unseen.draw(MINIFLA_SHAPES, n=4, seed=0, avoid=avoid)  # the seed says it all
    assert shapes != unseen.draw(MINIFLA_SHAPES, n=4, seed=1, avoid=avoid)
    dims = [s["shape"] for s in shapes]
    assert all(list(d) == ["B", "T", "H", "D"] and d not in avoid for d in dims)
    assert len({tuple(d.values()) for d in dims}) == 4
    # every stratum of T: below a chunk (T=1 among them), one chunk and over one, off any multiple of 16,
    # and a small multiple
    ts = [d["T"] for d in dims]
    assert [any(t in stratum for t in ts) for stratum in unseen.T_STRATA] == [True] * 4
    assert sum(t % 16 != 0 for t in ts) == 3
    heads = {d["D"] for d in dims}
    assert heads & set(unseen.HEAD_POW2) and heads & set(unseen.HEAD_OTHER)
    assert {d["B"] for d in dims} == {d["H"] for d in dims} == {1, 2, 3}
    assert [s["name"] for s in shapes][0] == "B{B}-T{T}-H{H}-D{D}".format(**dims[0])

    # whatever the registry declares: FLA's extra L; K and V of different kinds; a constrained D; no
    # value above the largest the configs use
    fla = {"a": {"B": 1, "T": 8192, "H": 96, "D": 128, "L": 8, "K": 64, "V": 128},
           "b": {"B": 2, "T": 512, "H": 2, "D": 64, "L": 10, "K": 32, "V": 32}}
    drawn = [s["shape"] for s in unseen.draw(fla, n=4, seed=0, avoid=[], constraints={"D": [64, 128]})]
    assert all(list(d) == ["B", "T", "H", "D", "L", "K", "V"] for d in drawn)
    assert {d["D"] for d in drawn} <= {64, 128} and {d["L"] for d in drawn} <= {8, 10} and all(d["B"] <= 2 for d in drawn)
    assert all((d["K"] in unseen.HEAD_POW2) != (d["V"] in unseen.HEAD_POW2) for d in drawn)

    # varlen: every second shape a packed batch of tiny sequences
    packed = unseen.draw(MINIFLA_SHAPES, n=4, seed=0, avoid=avoid, varlen=True)
    assert [s["seqlens"] is not None for s in packed] == [False, True, False, True]
    for s in packed[1::2]:
        assert s["shape"]["B"] == 1 and s["shape"]["T"] == sum(s["seqlens"]) and max(s["seqlens"]) < 64
        assert s["name"].endswith("-seqlens" + "+".join(map(str, s["seqlens"])))


def test_the_plan_says_when_it_is_off_and_the_option_is_declared_once():
    cells = [Cell("B1_T64_H2_D32", MINIFLA_SHAPES["B1_T64_H2_D32"], "fwd")]
    on = unseen.plan(BenchConfig(), MINIFLA_SHAPES, cells, {})
    assert on["off"] is None and on["n"] == 4 and len(on["shapes"]) == 4 and on["seed"] == 0
    assert on["modes"] == ["fwd", "fwdbwd"] and on["tol"] == BenchConfig().diff_tol
    assert unseen.plan(BenchConfig(), MINIFLA_SHAPES, cells, {"skip_backward": True})["modes"] == ["fwd"]
    off = unseen.plan(BenchConfig(unseen_shapes=0), MINIFLA_SHAPES, cells, {})
    assert off["off"] == "--unseen-shapes 0" and off["shapes"] == []
    aa = unseen.plan(BenchConfig(aa=True), MINIFLA_SHAPES, cells, {})  # the baseline compiles them
    assert aa["off"] is None and aa["aa"] is True and aa["shapes"] == on["shapes"] and on["aa"] is False
    assert "quick A/A" in unseen.plan(BenchConfig(aa=True, signal=True), MINIFLA_SHAPES, cells, {})["off"]
    # for a backend that takes only the cells' head dims: the same draw with D pinned to the cells' 32
    assert len(on["on_path"]) == unseen.ON_PATH and all(x["shape"]["D"] == 32 for x in on["on_path"])
    assert not {x["name"] for x in on["on_path"]} & {x["name"] for x in on["shapes"]}
    assert cli_args(BenchConfig(unseen_shapes=0, unseen_seed=3)) == ["--unseen-shapes", "0", "--unseen-seed", "3"]
    with pytest.raises(UsageError, match="--unseen-shapes -1"):
        BenchConfig(unseen_shapes=-1).check()


class Unseen(Script):
    """REFUSED: the base will not take it; WRONG: the base finds the candidate's dump off in grad_q;
    FAILS: the candidate raises where the base computes; the rest agree."""

    def answer(self, worker, cmd, payload):
        reply = super().answer(worker, cmd, payload)
        cid = str((payload.get("cell") or {}).get("id") if cmd == "setup" else payload.get("cell"))
        if cmd == "setup" and cid.startswith("REFUSED") and worker.side == "base":
            return {"ok": False, "error": "ValueError: head dims above 256 are not supported"}
        if cmd == "dump" and cid.startswith("FAILS") and worker.side == "cand":
            return {"ok": False, "error": "RuntimeError: tile too small", "traceback": ""}
        if cmd == "compare" and cid.startswith("WRONG"):
            good = {"match": True, "rel_rms": 1e-4, "nonfinite_self": 0, "nonfinite_ref": 0, "shape": [1], "shape_ref": [1]}
            return {"ok": True, "match": False, "tol": 0.005,
                    "tensors": {"out0": good, "grad_q": {**good, "match": False, "rel_rms": 0.31}}}
        return reply


def test_the_warm_up_skips_what_the_base_refuses_and_blocks_what_the_candidate_gets_wrong(tmp_path):
    names = ["REFUSED-B1-T1-H1-D512", "OK-B2-T17-H3-D24", "WRONG-B3-T63-H2-D16", "FAILS-B1-T100-H1-D40",
             "DIES-B2-T2-H1-D16", "NEVER-B1-T7-H2-D48"]
    plan = {"n": 6, "seed": 7, "dtype": "bfloat16", "tol": 0.005, "modes": ["fwd", "fwdbwd"], "off": None,
            "shapes": [{"name": n, "shape": {"B": 1, "T": 8, "H": 1, "D": 4}, "seqlens": None} for n in names]}
    # the candidate's worker dies at DIES/fwd (its 8th dump: the first is the cell's differential check)
    script = Unseen(crash=("cand", "dump", 8))
    s = Session(op="op", cells=CELLS[:1], config=BenchConfig(device="cpu", probes=False, min_pairs=8, rounds=1),
                trees={"base": tmp_path / "b", "cand": tmp_path / "c"}, launcher=FakeLauncher(script),
                run_dir=tmp_path / "run", unseen=plan)
    out = s.run()
    u = out.unseen
    status = {(shp["name"].split("-")[0], mode): v["status"] for shp in u["shapes"] for mode, v in shp["modes"].items()}
    assert status == {**{(k, m): v for k, v in (("REFUSED", "skipped"), ("OK", "match"), ("WRONG", "differs"),
                                                ("FAILS", "differs")) for m in ("fwd", "fwdbwd")},
                      ("DIES", "fwd"): "differs"}
    assert (u["checked"], u["differ"], u["skipped"], u["seed"]) == (7, 5, 2, 7) and u["seconds"] >= 0
    assert u["stopped"] == "the candidate's worker died"
    assert "the base refuses it: ValueError: head dims above 256" in u["shapes"][0]["modes"]["fwd"]["why"]
    found = [f for f in out.run_findings if f.rule == "unseen-shape-differs"]
    assert len(found) == 5 and all(f.blocking for f in found)
    wrong = next(f for f in found if f.cell == "unseen WRONG-B3-T63-H2-D16/fwdbwd")
    assert "grad_q rel-RMS 0.31 (tol 0.005)" in wrong.message and "--unseen-seed 7" in wrong.message
    assert "--allow" not in wrong.fix  # a wrong result is never allowed
    assert any("the candidate fails where the base computes: RuntimeError: tile too small" in f.message for f in found)
    # the run is blocked before anything is timed; only the warm-up pair (workers 0 and 1) saw the shapes
    (res,) = out.results
    assert res.status == "blocked" and "unseen-shape-differs (run stopped)" in res.reason and res.pairs == []
    seen = [(n, side, c, p) for n, side, c, p in script.log if c in ("setup", "dump", "compare")
            and any(x in str(p.get("cell")) for x in names)]
    assert {n for n, *_ in seen} == {0, 1}
    # both sides set up (inputs only) and dump; the base judges the candidate's dump
    assert all(p["cell"]["check_only"] for _, _, c, p in seen if c == "setup")
    compares = [(side, p) for _, side, c, p in seen if c == "compare"]
    assert {side for side, _ in compares} == {"base"} and all(p["subject"].endswith("-cand.pt") for _, p in compares)
    # the base keeps its own results in memory (no file to wait for); nothing of the base's, and no
    # comparison, is ever asked of the candidate, in the cells' checks or the shapes'
    assert all(p.get("hold") and "path" not in p for _, side, c, p in seen if c == "dump" and side == "base")
    cand = [(c, p) for _, side, c, p in script.log if side == "cand"]
    assert cand and not [c for c, p in cand if c == "compare" or {"ref", "subject", "shared", "subject_shared"} & set(p)]
    assert "unseen shapes checked" in [w for w, _ in out.timeline]


def test_an_aa_checks_the_shapes_base_against_base_and_a_difference_there_is_unstable_not_a_finding(tmp_path):
    names = ["OK-B2-T17-H3-D24", "WRONG-B3-T63-H2-D16"]
    plan = {"n": 2, "seed": 0, "dtype": "bfloat16", "tol": 0.005, "modes": ["fwd"], "off": None, "aa": True,
            "shapes": [{"name": n, "shape": {"B": 1, "T": 8, "H": 1, "D": 4}, "seqlens": None} for n in names]}
    s = Session(op="op", cells=CELLS[:1], config=BenchConfig(device="cpu", probes=False, min_pairs=8, rounds=1, aa=True),
                trees={"base": tmp_path / "b", "cand": tmp_path / "b"}, launcher=FakeLauncher(Unseen()),
                run_dir=tmp_path / "run", unseen=plan)
    out = s.run()
    u = out.unseen
    assert (u["checked"], u["differ"], u["unstable"]) == (2, 0, 1)
    wrong = u["shapes"][1]["modes"]["fwd"]
    assert wrong["status"] == "unstable" and wrong["why"].startswith("the base differs from itself: ")
    assert not [f for f in out.run_findings if f.rule == "unseen-shape-differs"]
    assert out.results[0].status != "blocked"


class Dispatched(Script):
    """FLA's Gluon AttnRes backend in miniature: it serves the cells and the unseen shapes whose name
    ends in -D2048 (its verifier wants wide rows), FLA's Triton path (no backend: nothing logged) the rest."""

    SNAP = {"attnres": {"registered": {"gluon": "FLA_ATTNRES_GLUON"}, "served": ["fused_attnres -> gluon"],
                        "rejected": []}}
    OFF = {"attnres": {"registered": {"gluon": "FLA_ATTNRES_GLUON"}, "served": [],
                       "rejected": ["fused_attnres -> gluon"]}}

    def answer(self, worker, cmd, payload):
        reply = super().answer(worker, cmd, payload)
        if cmd == "setup" and not (payload.get("cell") or {}).get("check_only"):
            return {**reply, "backends": self.SNAP}
        if cmd == "dump":
            return {**reply, "backends": self.SNAP if str(payload.get("cell")).endswith("-D2048/" + payload["cell"].split("/")[-1])
                    else self.OFF}
        return reply


def dispatched_session(tmp_path, on_path: list[str]):
    shape = {"B": 1, "T": 8, "H": 1, "D": 4}
    plan = {"n": 2, "seed": 0, "dtype": "bfloat16", "tol": 0.005, "modes": ["fwd", "fwdbwd"], "off": None,
            "shapes": [{"name": n, "shape": shape, "seqlens": None} for n in ("L8-B1-T17-D24", "L8-B2-T63-D16")],
            "on_path": [{"name": n, "shape": shape, "seqlens": None} for n in on_path]}
    s = Session(op="op", cells=CELLS[:1], config=BenchConfig(device="cpu", probes=False, min_pairs=8, rounds=1),
                trees={"base": tmp_path / "b", "cand": tmp_path / "c"}, launcher=FakeLauncher(Dispatched()),
                run_dir=tmp_path / "run", unseen=plan)
    return s.run()


def test_shapes_a_backends_verifier_sends_elsewhere_are_followed_by_shapes_with_the_cells_head_dims(tmp_path):
    out = dispatched_session(tmp_path, ["L8-B1-T7-D2048", "L8-B2-T33-D2048"])
    u = out.unseen
    assert [(x["name"], bool(x.get("on_path"))) for x in u["shapes"]] == [
        ("L8-B1-T17-D24", False), ("L8-B2-T63-D16", False), ("L8-B1-T7-D2048", True), ("L8-B2-T33-D2048", True)]
    assert u["on_path_because"] == ["attnres.fused_attnres -> gluon"] and "off_path" not in u
    assert u["shapes"][0]["modes"]["fwd"]["served"] == {"base": [], "cand": []}
    assert u["shapes"][2]["modes"]["fwdbwd"]["served"] == {"base": ["attnres.fused_attnres -> gluon"],
                                                         "cand": ["attnres.fused_attnres -> gluon"]}
    assert u["checked"] == 8 and not [f for f in out.run_findings if f.rule.startswith("unseen")]
    assert out.results[0].status != "blocked"
    assert "2 drawn with the cells' head dims, since attnres.fused_attnres -> gluon served none" in unseen_line(u)


def test_when_no_unseen_shape_runs_the_cells_backend_the_record_and_a_warning_say_so(tmp_path):
    out = dispatched_session(tmp_path, ["L8-B1-T7-D1024"])  # the verifier refuses these too
    u = out.unseen
    assert u["on_path_because"] == u["off_path"] == ["attnres.fused_attnres -> gluon"]
    (f,) = [f for f in out.run_findings if f.rule == "unseen-off-path"]
    assert not f.blocking and "attnres.fused_attnres -> gluon" in f.message and "other code than the code timed" in f.message
    assert out.results[0].status != "blocked"  # nothing wrong was seen: only nothing relevant was checked
    assert "none ran attnres.fused_attnres -> gluon, which the cells ran" in unseen_line(u)
    assert dispatched_session(tmp_path / "none", []).unseen["off_path"] == ["attnres.fused_attnres -> gluon"]


class Narrowed(Script):
    """The base finds the candidate's results within --diff-tol yet `rel` off (relative RMS), on the
    cell's warm-up (`where` "cell"), its kept timed calls ("timed") or the unseen shape ("unseen");
    everything else agrees."""

    def __init__(self, rel: float, where: str):
        super().__init__()
        self.rel, self.where = rel, where

    def answer(self, worker, cmd, payload):
        reply = super().answer(worker, cmd, payload)
        if cmd == "probe":  # the timed calls are checked with the probes on: none of them reports anything
            return {"ok": True, "probes": {}}
        if cmd == "selfcheck":
            return {"ok": True, "match": True, "checks": {}}
        on_cell = str(payload.get("cell")) == "S1/fwd"
        here = "unseen" if not on_cell else "timed" if payload.get("kept") else "cell"
        if cmd == "compare" and here == self.where:
            t = {"match": True, "rel_rms": self.rel, "nonfinite_self": 0, "nonfinite_ref": 0, "shape": [1],
                 "shape_ref": [1]}
            return {"ok": True, "match": True, "tol": 0.005, "tensors": {"out0": t}}
        return reply


@pytest.mark.parametrize("where", ["cell", "timed", "unseen"])
@pytest.mark.parametrize("dtype, rel, blocked", [("float32", 1.6e-3, True), ("float32", 4e-7, False),
                                                 ("float16", 1.6e-3, True), ("float16", 2.5e-4, False),
                                                 ("bfloat16", 4e-3, False)])
def test_a_difference_within_the_tolerance_but_beyond_the_dtypes_arithmetic_is_precision_narrowed(
        tmp_path, where, dtype, rel, blocked):
    cell = Cell("S1", {"B": 1, "T": 8, "H": 1, "D": 4}, "fwd", dtype)
    plan = {"n": 1, "seed": 0, "dtype": dtype, "tol": 0.005, "modes": ["fwd"], "off": None,
            "shapes": [{"name": "OK-B1-T9-H1-D4", "shape": {"B": 1, "T": 9, "H": 1, "D": 4}, "seqlens": None}]}
    s = Session(op="op", cells=[cell], config=BenchConfig(device="cpu", probes=where == "timed", min_pairs=8, rounds=1),
                trees={"base": tmp_path / "b", "cand": tmp_path / "c"}, launcher=FakeLauncher(Narrowed(rel, where)),
                run_dir=tmp_path / "run", unseen=plan)
    out = s.run()
    (res,) = out.results
    found = [f for f in [*res.findings, *out.run_findings] if f.rule == "precision-narrowed"]
    assert bool(found) is blocked and all(f.blocking for f in found)
    assert (res.status == "blocked") is blocked
    if blocked:
        (f,) = found
        assert f"out0 rel-RMS {rel:.3g}" in f.message and dtype in f.message and "--diff-tol 0.005" in f.message
        assert f.cell == ("unseen OK-B1-T9-H1-D4/fwd" if where == "unseen" else "S1/fwd")
        assert (res.pairs == []) is (where != "timed")  # the warm-up's check blocks before any timing
        assert (out.unseen.get("narrowed") == 1) is (where == "unseen")
