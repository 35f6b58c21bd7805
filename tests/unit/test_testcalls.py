"""The pure parts of the test's own calls (flaloop/task/testcalls.py), the options draw
(bench/options.py), the worker's rebuilding of a call (inside/worker/replay.py), the recorder's
structure of an argument (inside/scripts/flaloop_callrec.py) and the warm-up's judging of a replay
(bench/replay.py) over a scripted session. The real gate, bench and verify on minifla are in
tests/redteam/test_test_calls.py and tests/redteam/test_options.py."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from flaloop import inside
from flaloop.bench import options, replay
from flaloop.bench.measurement import Measurement
from flaloop.bench.model import BenchConfig
from flaloop.inside.worker import replay as worker_replay
from flaloop.task import testcalls

OP_FN = "minifla.ops.linear_attn.chunk:chunk_linear_attn"


def T(*shape, dtype="float32", grad=True):
    return {"tensor": {"shape": list(shape), "dtype": dtype, "requires_grad": grad}}


def V(x):
    return {"value": x}


# minifla's chunk_linear_attn, as target_query describes it
PARAMS = [{"name": n, "kind": "POSITIONAL_OR_KEYWORD", "default": d, "annotation": a, "doc": doc} for n, d, a, doc in [
    ("q", None, "torch.Tensor", "q (torch.Tensor): queries of shape `[B, T, H, K]`."),
    ("k", None, "torch.Tensor", None), ("v", None, "torch.Tensor", None),
    ("scale", "None", "float | None", "scale (float, Optional): multiplier on `q`"),
    ("initial_state", "None", "torch.Tensor | None", "initial_state (torch.Tensor, Optional): state `[N, H, K, V]`"),
    ("output_final_state", "False", "bool", None),
    ("cu_seqlens", "None", "torch.LongTensor | None", None),
    ("mode", "'chunk'", "Literal['chunk', 'fused']", None),
    ("eps", "1e-06", "float", None)]]
ENTRY = {"inputs": {"q": {}, "k": {}, "v": {}}, "extra_kwargs": {}}


def call(*args, fn=OP_FN, **kwargs):
    return {"fn": fn, "args": list(args), "kwargs": kwargs}


CALLS = [  # the tests' calls: one varlen, two plain, and one of the op's input checks with a wrong state on purpose
    call(T(2, 100, 2, 16), T(2, 100, 2, 16), T(2, 100, 2, 32), initial_state=T(2, 2, 16, 32), scale=V(0.25),
         output_final_state=V(True)),
    call(T(1, 20, 3, 60), T(1, 20, 3, 60), T(1, 20, 3, 40), initial_state=T(1, 3, 60, 40), scale=V(0.5),
         output_final_state=V(True)),
    call(T(1, 130, 2, 16), T(1, 130, 2, 16), T(1, 130, 2, 16), cu_seqlens=T(4, dtype="int64", grad=False),
         initial_state=T(3, 2, 16, 16), output_final_state=V(True)),
    call(T(2, 8, 1, 16, grad=False), T(2, 8, 1, 16, grad=False), T(2, 8, 1, 16, grad=False),
         initial_state=T(1, 1, 16, 16, grad=False)),
]


# -- the document ----------------------------------------------------------------------------------

def test_merge_counts_the_same_call_once_over_processes_and_sample_spreads_over_functions():
    a = {"calls": [{**CALLS[0], "count": 2}, {**call(T(4), fn="pkg.ref:naive"), "count": 1}]}
    b = {"calls": [{**CALLS[0], "count": 3}, {**CALLS[1], "count": 1}, {**call(T(5), fn="pkg.ref:naive"), "count": 1}]}
    doc = testcalls.merge([a, b], "minifla")
    assert doc["schema"] == 1 and doc["package"] == "minifla"
    assert [(c["fn"], c["count"]) for c in doc["calls"]] == [(OP_FN, 5), (OP_FN, 1), ("pkg.ref:naive", 1),
                                                             ("pkg.ref:naive", 1)]
    assert set(doc["calls"][0]) == {"fn", "count", "args", "kwargs"}
    s = testcalls.sample(doc, 3, 0, package="minifla", func_name="chunk_linear_attn")
    assert s == testcalls.sample(doc, 3, 0, package="minifla", func_name="chunk_linear_attn")
    assert s[0]["fn"] == OP_FN and {c["fn"] for c in s} == {OP_FN, "pkg.ref:naive"}  # the op's first, then in turns
    assert all(doc["calls"][c["index"]]["args"] == c["args"] for c in s)
    assert len(testcalls.sample(doc, 64, 0, package="minifla", func_name="chunk_linear_attn")) == 4
    assert testcalls.sample(doc, 0, 0, package="minifla", func_name="x") == []
    assert testcalls.describe(CALLS[0]).startswith("chunk_linear_attn(float32[2, 100, 2, 16]+grad, ")
    assert "scale=0.25" in testcalls.describe(CALLS[0])


def test_the_document_is_stored_beside_the_gate_and_read_only_for_its_test_file(tmp_path):
    doc = testcalls.merge([{"calls": [{**CALLS[0], "count": 1}]}], "minifla")
    p = testcalls.store(tmp_path, doc, base_commit="ab" * 20, test_file="tests/t.py")
    assert p == tmp_path / "gate" / "calls.json"
    assert testcalls.load(tmp_path, "tests/t.py")["base_commit"] == "ab" * 20
    assert testcalls.load(tmp_path, "tests/other.py") is None
    assert testcalls.load(tmp_path / "none", "tests/t.py") is None


def test_the_recorder_keeps_structure_never_values():
    spec = importlib.util.spec_from_file_location("callrec_under_test", inside.script("flaloop_callrec.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    x = torch.randn(2, 3, dtype=torch.bfloat16, requires_grad=True)
    assert mod.spec_of(x) == T(2, 3, dtype="bfloat16")
    assert mod.spec_of((1, None, [0.5, "a"])) == {"seq": [V(1), V(None), {"seq": [V(0.5), V("a")], "kind": "list"}],
                                                  "kind": "tuple"}
    assert mod.spec_of(float("nan")) == {"opaque": "float"} and mod.spec_of(torch.float32) == {"opaque": "dtype"}
    json.dumps(mod.spec_of((x, {"a": 1})))  # always JSON


# -- the options ----------------------------------------------------------------------------------

def test_options_are_the_signatures_bools_enums_optional_tensors_and_values_the_tests_pass():
    calls = options.op_calls({"calls": CALLS}, PARAMS, "minifla", "chunk_linear_attn")
    assert len(calls) == 4 and calls[0]["q"] == T(2, 100, 2, 16)  # positional arguments named by the signature
    opts, left = options.find(PARAMS, ENTRY, calls)
    by = {o["name"]: o for o in opts}
    assert set(by) == {"scale", "initial_state", "output_final_state", "mode"}  # q, k, v: the registry's; cu_seqlens: varlen
    assert by["output_final_state"]["values"] == [False, True]
    assert by["mode"]["kind"] == "enum" and by["mode"]["values"] == ["chunk", "fused"]
    assert by["initial_state"]["kind"] == "tensor" and by["scale"]["values"] == [None, 0.25, 0.5]
    assert left == [{"name": "eps", "why": "no value but its default is known (the tests pass none)"}]


def test_an_optional_tensors_shape_comes_from_the_tests_calls_then_the_docstring():
    calls = options.op_calls({"calls": CALLS}, PARAMS, "minifla", "chunk_linear_attn")
    (opt,) = [o for o in options.find(PARAMS, ENTRY, calls)[0] if o["name"] == "initial_state"]
    rule = options.tensor_rule(opt, PARAMS[4], calls, ENTRY, "bfloat16")
    # plain calls: N is q's batch, H q's heads, K and V the head dims (the call of a wrong state, outvoted)
    assert rule["plain"] == [{"param": "q", "axis": 0, "add": 0}, {"param": "q", "axis": 2, "add": 0},
                             {"param": "q", "axis": 3, "add": 0}, {"param": "v", "axis": 3, "add": 0}]
    assert rule["varlen"][0] == {"param": "cu_seqlens", "axis": 0, "add": -1}  # packed: the number of sequences
    assert rule["doc"] == ["N", "H", "K", "V"] and rule["dtype"] == "float32" and rule["requires_grad"] is True
    # no call passes it: the docstring's letters on the shape, N the number of sequences when packed
    bare = options.tensor_rule(opt, PARAMS[4], [], ENTRY, "bfloat16")
    assert bare["plain"] is None and bare["dtype"] == "bfloat16"
    assert options.shape_for(bare, {"B": 2, "T": 17, "H": 3, "D": 24}, None) == [2, 3, 24, 24]
    assert options.shape_for(bare, {"B": 1, "T": 9, "H": 3, "D": 24}, [4, 5]) == [2, 3, 24, 24]
    assert options.shape_for({**bare, "doc": ["N", "L"]}, {"B": 1, "T": 9, "H": 3, "D": 24}, None) is None


def test_combinations_put_every_option_off_its_default_first_and_name_the_tests_own():
    calls = options.op_calls({"calls": CALLS}, PARAMS, "minifla", "chunk_linear_attn")
    opts, _ = options.find(PARAMS, ENTRY, calls)
    got = options.combos(opts, calls, 8, seed=0)
    assert got == options.combos(opts, calls, 8, seed=0) and len(got) == 8
    default = {"scale": None, "initial_state": None, "output_final_state": False, "mode": "chunk"}
    assert got[0]["options"] == {"scale": 0.25, "initial_state": "tensor", "output_final_state": True, "mode": "fused"}
    alone = [{**default, k: v} for k, v in [("scale", 0.25), ("initial_state", "tensor"), ("output_final_state", True),
                                           ("mode", "fused")]]
    assert [c["options"] for c in got[1:5]] == alone
    assert all(c["options"] != default for c in got)
    tests = [c["options"] for c in got if c["tests"]]
    assert {**default, "scale": 0.25, "initial_state": "tensor", "output_final_state": True} in tests
    assert {**default, "initial_state": "tensor"} in tests  # the op's input check passes a state alone
    assert not got[0]["tests"] and not got[1]["tests"]
    assert len(options.combos(opts, calls, 2, seed=0)) == 2


def test_the_plan_pairs_each_combination_with_an_unseen_shape_or_says_why_not():
    cfg = BenchConfig(unseen_options=3)
    shapes = [{"name": "B1-T1-H2-D16", "shape": {"B": 1, "T": 1, "H": 2, "D": 16}, "seqlens": None},
              {"name": "B1-T9-H2-D24-seqlens4+5", "shape": {"B": 1, "T": 9, "H": 2, "D": 24}, "seqlens": [4, 5]}]
    p = options.plan(cfg, PARAMS, ENTRY, {"calls": CALLS}, shapes, package="minifla", func_name="chunk_linear_attn")
    assert [c["shape"]["name"] for c in p["combos"]] == ["B1-T1-H2-D16", "B1-T9-H2-D24-seqlens4+5", "B1-T1-H2-D16"]
    wire, why = options.wire_options(p["combos"][0], p["params"])
    assert why is None and wire["initial_state"]["tensor"]["shape"][0] == {"param": "q", "axis": 0, "add": 0}
    assert wire["output_final_state"] == {"value": True}
    assert options.plan(BenchConfig(unseen_options=0), PARAMS, ENTRY, None, shapes, package="m",
                        func_name="f")["off"] == "--unseen-options 0"
    # an optional tensor neither the tests nor the docstring give a shape: left out, and said
    params = [dict(p, doc=None) if p["name"] == "initial_state" else p for p in PARAMS]
    p = options.plan(cfg, params, ENTRY, None, shapes, package="minifla", func_name="chunk_linear_attn")
    assert {"name": "initial_state", "why": "no shape for it: the tests never pass it and its docstring gives none"} \
        in p["left_out"]
    assert all("initial_state" not in c["options"] for c in p["combos"])


# -- the worker's rebuilding of a call --------------------------------------------------------------

def test_a_call_is_rebuilt_from_its_structure_the_same_on_both_sides_with_valid_offsets():
    def fn(q, k, v, scale=None, cu_seqlens=None, flags=None):
        return q * (scale or 1.0) + k.sum() + v.mean(), k

    spec = call(T(1, 23, 2, 4), T(1, 23, 2, 4, dtype="bfloat16"), T(1, 23, 2, 4, grad=False), scale=V(0.5),
                cu_seqlens=T(4, dtype="int32", grad=False), flags={"seq": [V(True), V(2)], "kind": "tuple"})
    one, two = (worker_replay.Builder(torch.device("cpu"), 7) for _ in range(2))
    a1, k1 = worker_replay.build_test_call(fn, spec, one)
    a2, k2 = worker_replay.build_test_call(fn, spec, two)
    assert all(torch.equal(x, y) for x, y in zip(a1, a2, strict=True))
    assert a1[1].dtype == torch.bfloat16 and a1[0].requires_grad and not a1[2].requires_grad
    offs = k1["cu_seqlens"].tolist()
    assert k1["cu_seqlens"].dtype == torch.int32 and offs[0] == 0 and offs[-1] == 23 and offs == sorted(set(offs))
    assert k1["flags"] == (True, 2) and k1["scale"] == 0.5
    res = worker_replay.run(fn, a1, k1, one, backward=True)
    assert set(res) == {"out0", "out1", "grad_q", "grad_k"}  # backward through both outputs
    assert torch.equal(res["grad_k"], worker_replay.run(fn, a2, k2, two, backward=True)["grad_k"])
    with pytest.raises(ValueError, match="integer tensor"):
        worker_replay.build_test_call(fn, call(T(3, dtype="int64", grad=False)), worker_replay.Builder(
            torch.device("cpu"), 0))
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        worker_replay.build_test_call(fn, call(T(2), {"opaque": "dtype"}), worker_replay.Builder(torch.device("cpu"), 0))


# -- the warm-up's judging, over a scripted pair -----------------------------------------------------

class FakeSession:
    """What bench/replay.py asks of a Session: both sides replay into files, the base compares."""

    def __init__(self, tmp_path, replies, plan, aa=False):
        self.replies, self.test_calls, self.run_dir = replies, plan, tmp_path
        self.cfg = BenchConfig(diff_tol=1e-3)
        self.out = Measurement(results=[])
        self.results = [SimpleNamespace(status="pending")]
        self.workers = {"base": SimpleNamespace(dead=False), "cand": SimpleNamespace(dead=False)}
        self.found, self.broken, self.unseen, self.asked = [], None, None, []

    def blocked_run(self):
        return False

    def on_event(self, *a, **k):
        pass

    def add_run_findings(self, found):
        self.found += found

    def ask_both(self, cmd, timeout, payloads):
        self.asked.append((cmd, payloads))
        return {side: self.replies.pop(0) for side in payloads}

    def ask(self, side, cmd, timeout, **payload):
        return self.ask_both(cmd, timeout, {side: payload})[side]


def _compare(match, rel=0.0, nonfinite_ref=0):
    t = {"match": match, "rel_rms": rel, "max_abs": rel, "nonfinite_self": 0, "nonfinite_ref": nonfinite_ref,
         "shape": [2], "shape_ref": [2], "missing": None}
    return {"ok": True, "match": match, "tol": 1e-3, "tensors": {"out0": t}}


@pytest.mark.parametrize("aa", [False, True], ids=["candidate", "aa"])
def test_each_replayed_call_is_matched_skipped_or_a_finding_naming_it(tmp_path, aa):
    plan = {"n": 4, "seed": 0, "aa": aa, "off": None, "recorded": {"calls": 4}, "backward": True,
            "calls": [{**c, "index": i, "count": 1} for i, c in enumerate(CALLS)]}
    ok = {"ok": True}
    replies = [ok, ok, _compare(True),                                    # the same
               {"ok": False, "error": "ValueError: initial_state must be [N, H, K, V]"}, ok,  # the base refuses
               ok, {"ok": False, "error": "RuntimeError: boom"},           # the candidate fails
               ok, ok, _compare(False, rel=0.4)]                           # the candidate differs
    s = FakeSession(tmp_path, replies, plan)
    replay.check_test_calls(s)
    out = s.out.test_calls
    assert [c["status"] for c in out["calls"]] == ["match", "skipped", "differs" if not aa else "unstable",
                                                   "differs" if not aa else "unstable"]
    assert out["calls"][1]["why"] == "the base refuses it: ValueError: initial_state must be [N, H, K, V]"
    assert (out["checked"], out["skipped"], out["differ"]) == (3, 1, 0 if aa else 2)
    cmd, payloads = s.asked[0]
    assert cmd == "replay" and payloads["base"]["seed"] == payloads["cand"]["seed"]  # one seed, both sides
    assert payloads["base"]["path"] != payloads["cand"]["path"]
    assert s.asked[1][0] == "compare" and set(s.asked[1][1]) == {"base"}  # the base judges
    if aa:
        assert s.found == []
    else:
        assert [f.rule for f in s.found] == ["test-call-differs"] * 2 and all(f.blocking for f in s.found)
        assert "out0 rel-RMS 0.4" in s.found[1].message and "calls.json #3" in s.found[1].message
        assert s.found[1].message.startswith("chunk_linear_attn(float32[2, 8, 1, 16], ")
    assert out["seconds"] >= 0


def test_no_recorded_calls_turns_the_replay_off_and_says_how_to_record_them():
    from flaloop.bench.plan import test_calls_plan

    p = test_calls_plan(BenchConfig(), None, package="minifla", func_name="f", op="chunk_linear_attn")
    assert p["calls"] == [] and "`flaloop baseline chunk_linear_attn`" in p["off"]
    assert test_calls_plan(BenchConfig(test_calls=0), {"calls": []}, package="m", func_name="f", op="o")["off"] == \
        "--test-calls 0"
    assert "made no call" in test_calls_plan(BenchConfig(), testcalls.merge([], "m"), package="m", func_name="f",
                                             op="o")["off"]
    doc = testcalls.merge([{"calls": [{**c, "count": 1} for c in CALLS]}], "minifla")
    p = test_calls_plan(BenchConfig(test_calls=2), doc, package="minifla", func_name="chunk_linear_attn", op="o")
    assert p["off"] is None and len(p["calls"]) == 2 and p["recorded"]["calls"] == 4


def test_each_option_combination_runs_on_its_shape_or_is_skipped_and_a_difference_names_it(tmp_path):
    shapes = [{"name": "B1-T9-H2-D24-seqlens4+5", "shape": {"B": 1, "T": 9, "H": 2, "D": 24}, "seqlens": [4, 5]},
              {"name": "B1-T1-H2-D16", "shape": {"B": 1, "T": 1, "H": 2, "D": 16}, "seqlens": None}]
    # the tests pass a state on plain calls only and the docstring gives no shape: none for a packed call
    params = [dict(p, doc=None) if p["name"] == "initial_state" else p for p in PARAMS]
    plain = [c for c in CALLS if "cu_seqlens" not in c["kwargs"]]
    plan = options.plan(BenchConfig(unseen_options=3), params, ENTRY, {"calls": plain}, shapes, package="minifla",
                        func_name="chunk_linear_attn")
    ok = {"ok": True}
    s = FakeSession(tmp_path, [ok, ok, _compare(False, rel=0.3)], None)
    s.unseen = {"options": plan, "seed": 0, "aa": False, "modes": ["fwd", "fwdbwd"], "dtype": "bfloat16"}
    s.out.unseen = {"off": None, "seconds": 1.0}
    replay.check_options(s)
    out = s.out.unseen["options"]
    assert [c["shape"] for c in out["combos"]] == ["B1-T9-H2-D24-seqlens4+5", "B1-T1-H2-D16", "B1-T9-H2-D24-seqlens4+5"]
    assert [c["status"] for c in out["combos"]] == ["skipped", "differs", "skipped"]
    assert out["combos"][0]["why"].startswith("no shape for initial_state on a packed call")
    assert (out["checked"], out["differ"], out["skipped"]) == (1, 1, 2)
    (f,) = s.found
    assert f.rule == "unseen-option-differs" and f.blocking and "scale=0.25" in f.message
    assert "on B1-T1-H2-D16" in f.message
    cmd, payloads = s.asked[0]
    assert cmd == "replay" and payloads["base"]["cell"]["shape"] == {"B": 1, "T": 1, "H": 2, "D": 16}
    assert payloads["base"]["options"] == {"scale": {"value": 0.25}, "initial_state": {"value": None},
                                           "output_final_state": {"value": False}, "mode": {"value": "chunk"}}
    assert payloads["base"]["backward"] and payloads["base"]["seed"] == payloads["cand"]["seed"]
    assert s.out.unseen["seconds"] >= 1.0  # the options' seconds count in the unseen shapes'
