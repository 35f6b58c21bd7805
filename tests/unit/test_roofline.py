"""The roofline formulas against hand computations, the family choice, the ceilings cache and
the annotation of a bench record."""

from __future__ import annotations

import pytest

from flaloop import stats
from flaloop.bench import roofline
from flaloop.bench.roofline import FAMILIES, Ceilings, annotate, cell_cost, family_for
from flaloop.guard import timing

BF16 = 2


def shape(B, T, H, D):
    return {"B": B, "T": T, "H": H, "D": D}


def test_linear_attention_fwd_and_fwdbwd_by_hand():
    fam = FAMILIES["linear"]
    # B8_T1024_H8_D64: N = 8*1024 = 8192 tokens; q, k, v, o each N*H*D*2 bytes
    qkv = 8192 * 8 * 64 * BF16  # 8,388,608
    c = cell_cost(fam, shape(8, 1024, 8, 64), "fwd")
    assert c.bytes == 3 * qkv + qkv  # read q, k, v; write o
    # per head: kv=2 state products of 2*K*V per token; ck=cv=1 triangular, C*K per token (C=64)
    per_head = 2 * 2 * 64 * 64 * 8192 + (1 * 64 + 1 * 64) * (8192 * 64)
    assert c.flops == 8 * per_head
    c2 = cell_cost(fam, shape(8, 1024, 8, 64), "fwdbwd")
    # backward: read q, k, v and dO, write dq, dk, dv
    assert c2.bytes == c.bytes + (3 * qkv + qkv) + 3 * qkv
    bwd_per_head = 5 * 2 * 64 * 64 * 8192 + (3 * 64 + 2 * 64) * (8192 * 64)
    assert c2.flops == 8 * (per_head + bwd_per_head)

    # B1_T8192_H96_D128: N = 8192, D = 128
    x = 8192 * 96 * 128 * BF16
    c = cell_cost(fam, shape(1, 8192, 96, 128), "fwd")
    assert c.bytes == 4 * x
    assert c.flops == 96 * (2 * 2 * 128 * 128 * 8192 + (128 + 128) * 8192 * 64)


def test_gla_counts_its_gate_from_the_registry_entry():
    entry = {"name": "chunk_gla", "category": "elem_gate", "inputs": {
        "q": {"shape_fn": "shape_BTHD"}, "k": {"shape_fn": "shape_BTHD"}, "v": {"shape_fn": "shape_BTHD"},
        "g": {"shape_fn": "shape_BTHD", "dtype": "default", "requires_grad": True}}}
    fam = family_for(entry)
    assert fam.name == "gla"
    # B4_T2048_H16_D128: every input and the output are N*H*D = 8192*16*128 elements
    x = 4 * 2048 * 16 * 128 * BF16
    assert cell_cost(fam, shape(4, 2048, 16, 128), "fwd").bytes == 4 * x + x       # q, k, v, g; o
    assert cell_cost(fam, shape(4, 2048, 16, 128), "fwdbwd").bytes == (5 * x) + (5 * x) + 4 * x
    # simple GLA (head_gate): the gate is [B, T, H]
    simple = family_for({"name": "chunk_simple_gla", "category": "head_gate", "inputs": {
        "q": {"shape_fn": "shape_BTHD"}, "k": {"shape_fn": "shape_BTHD"}, "v": {"shape_fn": "shape_BTHD"},
        "g": {"shape_fn": "shape_BTH"}}})
    # B2_T16384_H16_D128: N = 32768
    n = 2 * 16384
    c = cell_cost(simple, shape(2, 16384, 16, 128), "fwd")
    assert c.bytes == 3 * n * 16 * 128 * BF16 + n * 16 * BF16 + n * 16 * 128 * BF16
    assert c.flops == 16 * (2 * 2 * 128 * 128 * n + (128 + 128) * n * 64)


def test_delta_rule_by_hand():
    fam = FAMILIES["delta"]
    # B8_T1024_H8_D64 fwd: the worked example of docs/ROOFLINE.md
    c = cell_cost(fam, shape(8, 1024, 8, 64), "fwd")
    assert c.bytes == 3 * 8_388_608 + 131_072 + 8_388_608 == 33_685_504
    assert c.flops == 8 * (3 * 2 * 64 * 64 * 8192 + (3 * 64 + 2 * 64) * 8192 * 64) == 2_952_790_016
    # B8_T2048_H32_D256 fwdbwd: N = 16384
    n, h, d = 16384, 32, 256
    x, beta = n * h * d * BF16, n * h * BF16
    c = cell_cost(fam, shape(8, 2048, 32, 256), "fwdbwd")
    fwd = 3 * x + beta + x
    bwd = (3 * x + beta) + x + (3 * x + beta)  # inputs again, dO; dq, dk, dv, dbeta
    assert c.bytes == fwd + bwd
    fwd_f = 3 * 2 * d * d * n + (3 * d + 2 * d) * n * 64
    bwd_f = 8 * 2 * d * d * n + (8 * d + 5 * d) * n * 64
    assert c.flops == h * (fwd_f + bwd_f)


def test_gated_delta_rule_by_hand():
    fam = family_for({"name": "chunk_gdn", "category": "gate_beta"})
    assert fam.name == "gated_delta"
    # B4_T4096_H64_D128 fwd: q, k, v [N,H,D]; g, beta [N,H]; N = 16384
    n, h, d = 16384, 64, 128
    c = cell_cost(fam, shape(4, 4096, 64, 128), "fwd")
    assert c.bytes == 3 * n * h * d * 2 + 2 * n * h * 2 + n * h * d * 2
    assert c.flops == h * (3 * 2 * d * d * n + 5 * d * n * 64)
    # B1_T8192_H96_D128 fwdbwd
    n, h = 8192, 96
    ins = 3 * n * h * d * 2 + 2 * n * h * 2
    out = n * h * d * 2
    c = cell_cost(fam, shape(1, 8192, 96, 128), "fwdbwd")
    assert c.bytes == (ins + out) + (ins + out + ins)
    assert c.flops == h * ((6 * d * d * n + 5 * d * n * 64) + (16 * d * d * n + 13 * d * n * 64))


def test_softmax_attention_is_quadratic_with_the_causal_half():
    fam = family_for({"name": "parallel_attn", "category": "attn"})
    # B8_T1024_H8_D64: each causal L x L x D matmul is L^2*D; fwd has 2, bwd 5
    c = cell_cost(fam, shape(8, 1024, 8, 64), "fwd")
    assert c.flops == 8 * 8 * 2 * 1024 * 1024 * 64
    assert c.bytes == 4 * 8 * 1024 * 8 * 64 * BF16
    c = cell_cost(fam, shape(2, 16384, 16, 128), "fwdbwd")
    assert c.flops == 2 * 16 * 7 * 16384 * 16384 * 128
    x = 2 * 16384 * 16 * 128 * BF16
    assert c.bytes == 4 * x + (4 * x + 3 * x)


def test_attention_over_layers_reads_every_source_once_and_is_memory_bound():
    # FLA's fused_attnres at its registry shape L8_B1_T8K_D2K: query and rms_weight [D], 8 sources [B, T, D]
    entry = {"name": "fused_attnres", "category": "fused_attnres",
             "inputs": {"query": {"shape_fn": "shape_D"}, "residuals": {"shape_fn": "shape_LBTD"},
                        "rms_weight": {"shape_fn": "shape_D"}}}
    fam = family_for(entry)
    assert [(s.name, s.dims) for s in fam.inputs] == [("query", "D"), ("residuals", "LBTD"), ("rms_weight", "D")]
    L, n, d = 8, 8192, 2048
    cell = {"L": L, "B": 1, "T": n, "H": 1, "D": d}
    ins, out = (L * n * d + 2 * d) * BF16, n * d * BF16
    c = cell_cost(fam, cell, "fwd")
    assert c.bytes == ins + out and c.flops == 6 * L * n * d and c.detail["sources"] == L
    c = cell_cost(fam, cell, "fwdbwd")
    assert c.bytes == (ins + out) + (ins + out + ins) and c.flops == 16 * L * n * d
    assert c.flops / c.bytes < 10  # far below the H200's ~190 FLOP/B ridge: the bandwidth floor binds


def test_varlen_cells_count_each_sequence_and_its_partial_chunk():
    lens = [100, 28]  # chunks of 64+36 and 28: sum of c^2 = 64^2 + 36^2 + 28^2
    tri = 64 * 64 + 36 * 36 + 28 * 28
    assert roofline.chunk_square_sum(lens) == tri
    c = cell_cost(FAMILIES["linear"], shape(1, 128, 2, 64), "fwd", seqlens=lens)
    assert c.flops == 2 * (2 * 2 * 64 * 64 * 128 + (64 + 64) * tri)
    s = cell_cost(FAMILIES["softmax"], shape(1, 128, 2, 64), "fwd", seqlens=lens)
    assert s.flops == 2 * 2 * 64 * (100 * 100 + 28 * 28)


def test_states_count_only_when_passed():
    fam = FAMILIES["linear"]
    plain = cell_cost(fam, shape(2, 128, 4, 64), "fwd")
    with_states = cell_cost(fam, shape(2, 128, 4, 64), "fwd", states=True)
    assert with_states.bytes - plain.bytes == 2 * (2 * 4 * 64 * 64 * 4)  # read h0, write hT, fp32


def test_family_choice_category_first_then_name():
    assert family_for({"name": "chunk_linear_attn", "category": "simple_qkv"}).name == "linear"
    assert family_for({"name": "chunk_delta_rule", "category": "beta"}).name == "delta"
    assert family_for({"name": "flash_attn", "category": "flash_attn"}).name == "softmax"
    # a category outside the model has none, whatever the name says
    assert family_for({"name": "chunk_rwkv7", "category": "rwkv"}) is None
    assert family_for({"name": "my_attnres", "category": "mhc"}) is None
    assert family_for({"name": "fused_attnres", "category": "fused_attnres"}).name == "attnres"
    assert family_for({"name": "my_fused_attnres"}).name == "attnres"  # before the softmax pattern
    # no category: the name decides, most specific first
    assert family_for({"name": "my_chunk_gated_delta_rule"}).name == "gated_delta"
    assert family_for({"name": "chunk_linear_attn"}).name == "linear"
    assert family_for({"name": "toy_attn"}).name == "softmax"
    assert family_for({"name": "hgrn"}) is None
    # an unknown shape helper keeps the family's own inputs
    fam = family_for({"name": "x", "category": "beta", "inputs": {"q": {"shape_fn": "shape_BTHS"}}})
    assert [s.name for s in fam.inputs] == ["q", "k", "v", "beta"]


class _Annotated:
    """A typed run record made from a plain one; `annotate` works on it, the assertions read its JSON."""

    def __init__(self, d: dict):
        from flaloop.bench.record import RunRecord

        self.rec = RunRecord.from_dict({"op": "op", "created": "", "base": {"commit": "b" * 40},
                                        "candidate": {"commit": "c" * 40}, **d})

    def __getitem__(self, key):
        return self.rec.to_dict()[key]


def _record(base_ms: float, cand_ms: float) -> _Annotated:
    summ = {"base": {"median": base_ms}, "cand": {"median": cand_ms}}
    summ = {side: {**stats.summarize([1.0]).to_dict(), **v} for side, v in summ.items()}
    cell = {"id": "B8_T1024_H8_D64/fwd", "shape_name": "B8_T1024_H8_D64", "shape": shape(8, 1024, 8, 64),
            "mode": "fwd", "dtype": "bfloat16", "seqlens": None}
    return _Annotated({"cells": [{"cell": cell, "status": "ok", "summary": summ},
                                 {"cell": {**cell, "id": "x/fwd", "shape_name": "x"}, "status": "failed",
                                  "summary": {}}]})


def test_annotate_adds_floor_percent_and_flags_above_100():
    ceil = Ceilings("cuda", "H200", "GPU-1", bandwidth_gbs=4300.0, peak_tflops=790.0, gemm_dtype="bfloat16")
    rec = _record(0.09, 0.05)
    annotate(rec.rec, ceil, FAMILIES["delta"])
    r = rec["cells"][0]["roofline"]
    assert r["bytes"] == 33_685_504 and r["flops"] == 2_952_790_016
    assert r["bound"] == "memory"
    assert r["floor_ms"] == pytest.approx(33_685_504 / 4300e9 * 1e3)
    assert r["pct_of_floor_base"] == pytest.approx(100 * r["floor_ms"] / 0.09)
    assert r["pct_of_floor_cand"] == pytest.approx(100 * r["floor_ms"] / 0.05)
    assert r["above_100"] is False
    assert rec["cells"][1]["roofline"]["pct_of_floor_cand"] is None
    assert rec["roofline"]["family"] == "delta" and rec["roofline"]["above_100"] == []
    # a candidate faster than the floor is flagged, never celebrated
    rec = _record(0.09, 0.005)
    annotate(rec.rec, ceil, FAMILIES["delta"])
    assert rec["cells"][0]["roofline"]["above_100"] is True
    assert rec["roofline"]["above_100"] == ["B8_T1024_H8_D64/fwd"]
    # compute-bound when the peak is low
    rec = _record(0.09, 0.08)
    annotate(rec.rec, Ceilings("cuda", "slow", None, 4300.0, 1.0, "bfloat16"), FAMILIES["delta"])
    assert rec["cells"][0]["roofline"]["bound"] == "compute"


def test_annotate_without_a_model_or_ceilings():
    rec = _record(0.09, 0.05)
    annotate(rec.rec, None, None)
    assert rec["roofline"]["family"] is None and rec["cells"][0]["roofline"] is None
    rec = _record(0.09, 0.05)
    annotate(rec.rec, None, FAMILIES["linear"])
    r = rec["cells"][0]["roofline"]
    assert r["bytes"] > 0 and r["floor_ms"] is None and r["above_100"] is False


def test_a_candidate_below_its_floor_blocks_as_below_floor_unless_the_floor_is_uncertain():
    from flaloop.bench.finish import _below_floor

    ceil = Ceilings("cuda", "H200", "GPU-1", bandwidth_gbs=4300.0, peak_tflops=790.0, gemm_dtype="bfloat16")
    rec = _record(0.09, 0.005)
    annotate(rec.rec, ceil, FAMILIES["delta"])
    rec.rec.cells[0].verdict = "FASTER"
    _below_floor(rec.rec, [])
    (f,) = rec["cells"][0]["findings"]
    assert f["rule"] == "below-floor" and f["severity"] == "block" and "measured 0.005 ms" in f["message"]
    assert rec["cells"][0]["verdict"] == "BLOCKED" and rec["guard"]["blocked"] and rec["summary"]["n_blocked"] == 1
    # an allowance recorded under the rule's earlier id still covers it
    rec = _record(0.09, 0.005)
    annotate(rec.rec, ceil, FAMILIES["delta"])
    rec.rec.cells[0].verdict = "FASTER"
    _below_floor(rec.rec, [{"rule": "implausible-speedup", "why": "the model ignores a cache this op keeps"}])
    assert rec["cells"][0]["verdict"] == "FASTER" and rec["cells"][0]["findings"][0]["allowed"]
    # a compute floor from a bf16 GEMM rate on an fp8 cell is no bound: named, not blocking
    assert timing.floor_uncertain(ceil.to_dict(), "compute", "float8_e4m3fn")
    assert timing.floor_uncertain(ceil.to_dict(), "memory", "float8_e4m3fn") is None
    assert timing.floor_uncertain(ceil.to_dict(), "compute", "float32") is None
    assert timing.floor_uncertain(None, "memory", "bfloat16") == "no measured ceilings"
