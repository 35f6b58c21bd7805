"""The flaloop.toml op declaration (flaloop/task/opdecl.py) and the recorded calls (flaloop/task/opcalls.py):
pure, in-process, over hand-written fixtures; and the worker's build of a declaration's inputs."""

from __future__ import annotations

import pytest

from flaloop.core.errors import UsageError
from flaloop.task import opcalls, opdecl

SHAPES = {"small": {"B": 2, "T": 16, "H": 2, "D": 8}}


def decl(inputs: dict, **entry) -> dict:
    return opdecl.normalize("op", {"import_path": "pkg.op", "inputs": inputs, **entry}, SHAPES)


def refused(inputs: dict, **entry) -> UsageError:
    with pytest.raises(UsageError) as exc:
        decl(inputs, **entry)
    return exc.value


def test_shapes_parse_to_expressions_over_the_dimensions():
    assert opdecl.parse_shape("B, T, H * D") == ["B", "T", ["*", "H", "D"]]
    assert opdecl.parse_shape(["B", 4, "cdiv(T, 64)", "max(H, 2) // 2"]) == \
        ["B", 4, ["cdiv", "T", 64], ["//", ["max", "H", 2], 2]]
    assert opdecl.parse_shape("T") == ["T"]
    assert opdecl.parse_shape("-H + 1") == [["+", ["neg", "H"], 1]]
    for bad in ("B, T,, D", "B ** 2", "H.x", "f(T)", "B, 1.5", "__import__('os')", "cdiv(T)"):
        with pytest.raises(ValueError):
            opdecl.parse_shape(bad)


def test_transforms_chain_and_unknown_ones_are_named():
    assert opdecl.parse_transform("logsigmoid") == [["logsigmoid"]]
    assert opdecl.parse_transform(["sigmoid", "scale:-0.6", "clamp:-0.6:-1e-6"]) == \
        [["sigmoid"], ["scale", -0.6], ["clamp_min", -0.6], ["clamp_max", -1e-6]]
    for bad in ("logsigmod", "scale", "scale:x", "neg:a", "clamp:1"):
        with pytest.raises(ValueError):
            opdecl.parse_transform(bad)
    e = refused({"g": {"shape": "B, T, H", "transform": "logsigmod"}})
    assert "[ops.op.inputs] g.transform" in e.message and "logsigmoid" in e.hint


def test_every_bad_key_is_refused_with_the_key_named():
    cases = [
        ({"q": {"shape": "B, T,, D"}}, {}, "[ops.op.inputs] q.shape does not parse"),
        ({"q": {"shape": "B, T, H, E"}}, {}, "[ops.op.shapes] is not given, and the registry's shape small lacks E"),
        ({"q": {"shape": "B, T, H, D"}, "b": {"from": "zz"}}, {}, "[ops.op.inputs] b.from names 'zz'"),
        ({"b": {"like": "q"}, "q": {"shape": "B"}}, {}, "[ops.op.inputs] b.like names 'q'"),
        ({"q": {"shape": "B", "like": "x"}}, {}, "needs exactly one of shape, like, from"),
        ({"q": {}}, {}, "needs exactly one of shape, like, from"),
        ({"q": {"shape": "B", "dtype": "int8"}}, {}, "[ops.op.inputs] q.dtype"),
        ({"q": {"shape": "B", "requires_grad": "no"}}, {}, "[ops.op.inputs] q.requires_grad"),
        ({"q": {"shape": "B", "shap": "T"}}, {}, "unknown key(s) shap"),
        ({"q": {"shape": "B", "range": [3, 1]}}, {}, "[ops.op.inputs] q.range"),
        ({"q": "B, T"}, {}, "[ops.op.inputs] q must be a table"),
        ({"q": {"shape": "B"}}, {"shape_kwargs": {"n": "T /"}}, "[ops.op] shape_kwargs.n does not parse"),
        ({"q": {"shape": "B"}}, {"shapes": {"s": {"B": 0}}}, "[ops.op.shapes] s.B must be a positive int"),
        ({"q": {"shape": "B"}}, {"shapes": {"s": {"B": 2, "seqlens": [3, 4]}}}, "[ops.op.shapes] s.B must be 1"),
        ({"q": {"shape": "B"}}, {"shapes": {}}, "[ops.op.shapes] names no shape"),
        ({"q": {"shape": "B"}}, {"extra_kwargs": {"q": 1}}, "[ops.op] extra_kwargs.q"),
        ({"q": {"shape": "B"}}, {"dim_constraints": {"D": 64}}, "dim_constraints.D must list ints"),
        ({"q": {"shape": "B"}}, {"skip_backward": "yes"}, "[ops.op] skip_backward must be a bool"),
        ({}, {}, "[ops.op] inputs declares no input"),
    ]
    for inputs, entry, named in cases:
        e = refused(inputs, **entry)
        assert named in e.message, (inputs, entry, e.message)
        assert e.hint, named
    e = refused({"q": {"shape": "B, T, H, E"}}, shapes={"s": {"B": 1, "T": 4, "H": 1, "D": 2}})
    assert "[ops.op.shapes] s lacks E" in e.message and "E = 16" in e.hint
    with pytest.raises(UsageError) as exc:  # no shapes named and no registry to take them from
        opdecl.normalize("op", {"import_path": "p", "inputs": {"q": {"shape": "B"}}}, None)
    assert "[ops.op.shapes] is not given" in exc.value.message


def test_a_declaration_normalizes_for_the_worker_and_reads_as_a_registry_entry():
    d = decl({"q": {"shape": "B, T, H, D"}, "g": {"shape": "B, T, H", "transform": "logsigmoid"},
              "b": {"from": "q", "transform": "neg"}, "w": {"shape": "H * D", "dtype": "float32",
                                                            "requires_grad": False}},
             extra_kwargs={"scale": 0.5}, shape_kwargs={"n": "T // 4"}, category="gate",
             shapes={"s": {"B": 1, "T": 8, "H": 2, "D": 4}, "p": {"H": 2, "D": 4, "seqlens": [3, 5]}})
    assert d["dims"] == ["B", "D", "H", "T"] and d["shape_kwargs"] == {"n": ["//", "T", 4]}
    assert d["inputs"]["b"] == {"dtype": "default", "requires_grad": True, "from": "q", "transform": [["neg"]]}
    view = opdecl.registry_view(d)
    assert list(view["inputs"]) == ["q", "g", "b", "w"] and view["inputs"]["q"]["shape_fn"] == "shape_BTHD"
    assert view["default_shapes"]["p"]["seqlens"] == [3, 5] and view["category"] == "gate"


# -- recorded calls ------------------------------------------------------------------------------

def T(shape, dtype="bfloat16", grad=True):
    return {"tensor": {"shape": shape, "dtype": dtype, "requires_grad": grad}}


def call(fn, args=(), count=1, **kwargs):
    return {"fn": fn, "count": count, "args": list(args), "kwargs": kwargs}


PARAMS = ["q", "k", "v", "g", "scale", "initial_state", "cu_seqlens"]
FN = "pkg.ops.gla.chunk:chunk_gla"


def from_calls(calls, **kw):
    return opcalls.declaration({"schema": 1, "package": "pkg", "calls": calls}, name="chunk_gla",
                               import_path="pkg.ops.gla", func_name="chunk_gla", parameters=PARAMS, **kw)


def test_the_largest_recorded_calls_of_one_kind_become_the_cells():
    small = [T([1, 16, 2, 8]) for _ in range(4)]
    big = [T([2, 64, 2, 8]) for _ in range(4)]
    mid = [T([1, 32, 2, 8]) for _ in range(4)]
    calls = [
        call(FN, small, scale={"value": 0.5}),
        call("pkg.ops.other:chunk_other", [T([8, 999, 8, 64])] * 4),  # another op's call: never a cell
        call(FN, big, scale={"value": 0.5}, count=3),
        call(FN, small, scale={"value": 0.5}),                          # a repeat of call 0's shapes
        call(FN, mid, scale={"value": 0.5}),
        call(FN, [T([4, 128, 4, 8])] * 4, scale={"value": 0.25}),       # largest, but of another kind
        call(FN, [T([9, 9, 9, 9])] * 3, initial_state={"opaque": "Cache"}),  # cannot be rebuilt
    ]
    d = from_calls(calls, max_cells=3)
    # the group of the largest call (scale 0.25) holds one call; kinds are never mixed
    assert list(d["default_shapes"]) == ["call5_4x128x4x8"] and d["extra_kwargs"] == {"scale": 0.25}
    d = from_calls(calls[:5], max_cells=2)
    assert list(d["default_shapes"]) == ["call2_2x64x2x8", "call4_1x32x2x8"]
    assert d["default_shapes"]["call2_2x64x2x8"]["q_1"] == 64
    assert d["inputs"]["q"] == {"shape": ["q_0", "q_1", "q_2", "q_3"], "dtype": "default", "requires_grad": True}
    assert d["recorded"]["calls"] == [2, 4] and d["recorded"]["counts"] == [3, 1]
    assert from_calls(calls[:5])["recorded"]["calls"] == [2, 4, 0]
    assert "6" in from_calls(calls)["recorded"]["skipped"]
    # what the worker needs of it: an entry of the registry's form, shape configs the contract names
    view = opdecl.registry_view(d)
    assert list(view["inputs"]) == ["q", "k", "v", "g"] and view["default_shapes"] == d["default_shapes"]


def test_recorded_calls_keep_dtypes_kwargs_lists_and_varlen():
    c = call("pkg.ops.gla:chunk_gla", [T([1, 40, 2, 8]), T([1, 40, 2, 8]), T([1, 40, 2, 8])],
             g=T([1, 40, 2, 8], "float32", False), initial_state={"value": None},
             cu_seqlens=T([4], "int64", False), extra={"seq": [T([2, 3])] * 2, "kind": "list"},
             flags={"seq": [{"value": 1}, {"value": 2}], "kind": "tuple"})
    d = from_calls([c])
    (name, dims), = d["default_shapes"].items()
    assert dims["seqlens"] == [14, 13, 13] and "cu_seqlens" not in d["inputs"]
    assert d["inputs"]["g"]["dtype"] == "float32" and d["inputs"]["g"]["requires_grad"] is False
    assert d["inputs"]["extra"]["unbind"] == 0 and dims["extra_0"] == 2 and dims["extra_1"] == 2
    assert d["extra_kwargs"] == {"initial_state": None, "flags": [1, 2]}
    assert d["output_is_tuple"] is None  # nobody described the return: the worker decides by its type


def test_recorded_calls_that_give_no_cell_say_why():
    with pytest.raises(ValueError, match="records no call of pkg.ops.gla.chunk_gla .it records pkg.x:f"):
        from_calls([call("pkg.x:f", [T([1])])])
    with pytest.raises(ValueError, match="records no call at all"):
        from_calls([])
    with pytest.raises(ValueError, match="can be rebuilt: call 0: q is an object of type Cache"):
        from_calls([call(FN, [{"opaque": "Cache"}])])
    with pytest.raises(ValueError, match="8 positional arguments, the signature names 7"):
        from_calls([call(FN, [T([1])] * 8)])
    with pytest.raises(ValueError, match="schema 1"):
        opcalls.declaration({"schema": 2, "calls": []}, name="x", import_path="p", func_name="x", parameters=[])


# -- the worker's side ---------------------------------------------------------------------------

def test_the_worker_builds_a_declarations_inputs_as_declared():
    torch = pytest.importorskip("torch")
    from flaloop.inside.worker.declared import DeclaredRegistry
    from flaloop.inside.worker.inputs import CellSpec

    d = decl({"x": {"shape": "B, T, H * D"}, "g": {"shape": "B, T, H", "transform": ["sigmoid", "scale:0.5", "add:0.5"]},
              "b": {"from": "x", "transform": "neg"}, "o": {"like": "g"},
              "idx": {"shape": "cdiv(T, 4)", "dtype": "int32", "range": [2, 5]},
              "res": {"shape": "3, B, D", "unbind": 0, "requires_grad": False}},
             shape_kwargs={"n": "T // 2"}, shapes={"s": {"B": 2, "T": 10, "H": 3, "D": 4}})
    cfg = DeclaredRegistry(d).get_op("op")

    def fn(x, g, b, o, idx, res, n, cu_seqlens=None):
        return x

    spec = CellSpec({"id": "c", "shape": {"B": 2, "T": 10, "H": 3, "D": 4}, "dtype": "float32"}, cfg, fn)
    spec.check()
    kw = spec.make_set(0, {}, torch.device("cpu")).kwargs
    assert kw["x"].shape == (2, 10, 12) and kw["x"].requires_grad
    assert torch.equal(kw["b"].detach(), -kw["x"].detach()) and kw["b"].is_leaf
    assert kw["g"].shape == kw["o"].shape == (2, 10, 3) and bool(((kw["g"] > 0.5) & (kw["g"] < 1)).all())
    assert kw["idx"].dtype == torch.int32 and kw["idx"].shape == (3,) and bool(((kw["idx"] >= 2) & (kw["idx"] < 5)).all())
    assert isinstance(kw["res"], list) and len(kw["res"]) == 3 and kw["res"][0].shape == (2, 4)
    assert kw["n"] == 5
    with pytest.raises(KeyError):
        DeclaredRegistry(d).get_op("other")


def test_the_shape_guard_knows_the_sizes_of_declared_shapes():
    from flaloop.guard.static import declared_shape_ints

    toml = (b'[ops.x]\nimport_path = "a"\n[ops.x.shapes]\nsmall = { B = 2, T = 96, H = 3 }\n'
            b'packed = { H = 4, seqlens = [33, 63] }\n[ops.y]\nimport_path = "b"\n')
    assert declared_shape_ints(toml) == {2, 96, 3, 4, 33, 63}
    assert declared_shape_ints(None) == set() and declared_shape_ints(b"[ops.x\n") == set()


def test_positional_arguments_bind_to_the_positional_parameters_only():
    from flaloop.task.target import argument_names

    params = [{"name": "q", "kind": "POSITIONAL_OR_KEYWORD"}, {"name": "rest", "kind": "VAR_POSITIONAL"},
              {"name": "scale", "kind": "KEYWORD_ONLY"}, {"name": "kw", "kind": "VAR_KEYWORD"}]
    assert argument_names(params) == ["q"]
    with pytest.raises(ValueError, match="2 positional arguments, the signature names 1"):
        opcalls.declaration({"schema": 1, "calls": [call(FN, [T([2]), T([2])])]}, name="chunk_gla",
                            import_path="pkg.ops.gla", func_name="chunk_gla", parameters=argument_names(params))


def test_cells_of_declared_shapes_packed_ones_included():
    from flaloop.bench.model import make_cells

    shapes = {"s": {"B": 2, "T": 8, "H": 1}, "p": {"H": 1, "seqlens": [3, 5]}, "r": {"q_0": 2, "q_1": 5}}
    cells = make_cells(shapes, ["s", "p"], ["fwd"], "bfloat16", False)
    assert [(c.shape_name, c.shape, c.seqlens) for c in cells] == [
        ("s", {"B": 2, "T": 8, "H": 1}, None), ("p", {"H": 1, "B": 1, "T": 8}, (3, 5))]
    assert shapes["p"]["seqlens"] == [3, 5]  # the shape configs are not edited
    with pytest.raises(UsageError, match="the shape r has no B or T"):
        make_cells(shapes, ["r"], ["fwd"], "bfloat16", True)
