"""Ops outside the registry: an op declared in flaloop.toml goes init -> bench -> a verdict in a repo
that has a registry, and a declaration the bench could not build from is refused at init (exit 2)
with the flaloop.toml key to fix."""

from __future__ import annotations

import json

from support.bench import QUICK
from support.cli import flaloop
from support.repos import git, make_repo

TOY_GATE = '''

def toy_gate(x, g, b, w, scale=1.0, half=None, cu_seqlens=None):
    # finite only where the declaration's transforms and ties hold: b = -x, g in (0.5, 1)
    assert half == x.shape[1] // 2, half
    assert w.dtype == torch.float32 and not w.requires_grad and tuple(w.shape) == (x.shape[2],)
    o = (-(x.float() * b.float())).log() + (g.float() - 0.5).log().unsqueeze(-1) + w[:, None] * scale
    return o.to(x.dtype), None
'''

TOY_TOML = '''
[ops.toy_gate]
import_path = "toyop.ops.toy.fast"
test_file = "tests/ops/test_toy.py"
extra_kwargs = { scale = 0.5 }
shape_kwargs = { half = "T // 2" }

[ops.toy_gate.shapes]
small = { B = 2, T = 16, H = 2, D = 8 }
packed = { H = 2, D = 8, seqlens = [5, 11] }

[ops.toy_gate.inputs]
x = { shape = "B, T, H, D" }
g = { shape = ["B", "T", "H"], transform = ["sigmoid", "scale:0.5", "add:0.5"] }
b = { from = "x", transform = "neg" }
w = { shape = "H", dtype = "float32", requires_grad = false }
'''


def test_an_op_declared_in_flaloop_toml_is_benched_in_a_repo_with_a_registry(toy):
    """toy_gate is in no registry; its inputs, shapes (one packed), ties, transforms, dtypes and
    keyword arguments are declared in flaloop.toml. Each is load-bearing: the op asserts or goes
    non-finite where one is not applied."""
    fast = toy / "toyop/ops/toy/fast.py"
    fast.write_text(fast.read_text() + TOY_GATE)
    (toy / "flaloop.toml").write_text(TOY_TOML)
    commit_all_again(toy)
    r = flaloop(toy, "init", "toy_gate", "--modes", "fwd", "--json")
    assert r.code == 0, r.stderr
    assert r.json["shapes"] == ["small", "packed"]
    r = flaloop(toy, "bench", "toy_gate", "--json", "--aa", *QUICK)
    assert r.code == 0, r.stderr
    rec = r.json
    cells = {c["cell"]["shape_name"]: c for c in rec["cells"]}
    assert {n: c["status"] for n, c in cells.items()} == {"small": "ok", "packed": "ok"}, \
        {n: c.get("reason") for n, c in cells.items()}
    assert cells["packed"]["cell"]["seqlens"] == [5, 11] and cells["packed"]["cell"]["shape"]["T"] == 16
    assert "cu_seqlens" in cells["packed"]["setup"]["base"]["extra_kwargs"]
    # the bench reads the declaration at the base, as it reads the base's registry: undoing the tie
    # in the working tree (which would take the op outside its domain) changes nothing measured
    (toy / "flaloop.toml").write_text(TOY_TOML.replace('b = { from = "x", transform = "neg" }', 'b = { like = "x" }'))
    r = flaloop(toy, "bench", "toy_gate", "--json", "--aa", *QUICK, "--shapes", "small")
    assert r.code == 0 and r.json["cells"][0]["status"] == "ok", r.stderr


def commit_all_again(repo) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "declared op")


# one bad declaration through the CLI; the rest of the keys in tests/unit/test_opdecl.py, in-process
BAD = [('x = { shape = "B, T,, D" }', "[ops.naive_linear_attn.inputs] x.shape does not parse")]


def test_bad_declarations_and_an_op_with_nothing_to_bench_are_refused_at_init(tmp_path):
    """minifla has a registry; the op is not in it. Each bad declaration is exit 2 naming the key;
    no declaration at all (and no recorded calls) is exit 2 with the table to add, as are a
    declaration the base commit lacks and an entry point that does not import."""
    repo = make_repo(tmp_path / "minifla")
    head = ('[ops.naive_linear_attn]\nimport_path = "minifla.ops.linear_attn.naive"\n'
            'test_file = "tests/ops/test_linear_attn.py"\n')
    for inputs, named in BAD:
        (repo / "flaloop.toml").write_text(head + "[ops.naive_linear_attn.inputs]\n" + inputs + "\n")
        r = flaloop(repo, "init", "naive_linear_attn", "--json")
        assert r.code == 2 and named in r.json["error"], (inputs, r.stdout, r.stderr)
    (repo / "flaloop.toml").write_text(head)
    r = flaloop(repo, "init", "naive_linear_attn", "--json")
    assert r.code == 2, r.stderr
    assert "declares no bench inputs, the registry benchmarks/ops/registry.py has no entry" in r.json["error"]
    assert "profile/naive_linear_attn-opt/gate/calls.json" in r.json["error"]
    assert "[ops.naive_linear_attn.inputs]" in r.json["hint"] and 'shape = "B, T, H, D"' in r.json["hint"]
    (repo / "flaloop.toml").write_text(head + 'func_name = "no_such_fn"\n'
                                       + '[ops.naive_linear_attn.inputs]\nq = { shape = "B, T, H, D" }\n')
    # the bench reads the declaration at the base: one only in the working tree is refused at init
    r = flaloop(repo, "init", "naive_linear_attn", "--json")
    assert r.code == 2 and "declares no op naive_linear_attn in flaloop.toml" in r.json["error"], r.stdout
    assert "commit the [ops.naive_linear_attn] declaration" in r.json["hint"]
    commit_all_again(repo)
    r = flaloop(repo, "init", "naive_linear_attn", "--json")
    assert r.code == 2 and "func_name" in r.json["hint"] and "[ops.naive_linear_attn]" in r.json["hint"], r.stdout
    assert json.loads(r.stdout)["ok"] is False


def test_an_op_that_declares_no_inputs_is_benched_from_the_calls_its_test_recorded(toy):
    """No registry entry, no [ops.NAME.inputs]: the cells are the largest recorded calls of one
    kind (the same keyword values), taken from calls.json beside the base gate's baseline."""
    (toy / "flaloop.toml").write_text('[ops.toy_rec]\nimport_path = "toyop.ops.toy"\nfunc_name = "toy_attn"\n'
                                      'test_file = "tests/ops/test_toy.py"\n')
    commit_all_again(toy)

    def t(*shape):
        return {"tensor": {"shape": list(shape), "dtype": "bfloat16", "requires_grad": True}}
    calls = [{"fn": "toyop.ops.toy.fast:toy_attn", "count": 2, "args": [t(1, 40, 2, 8)] * 3, "kwargs": {}},
             {"fn": "toyop.ops.toy.fast:toy_attn", "count": 2, "args": [t(1, 17, 2, 8)] * 3,
              "kwargs": {"scale": {"value": 0.3}}},
             {"fn": "toyop.ops.toy.fast:toy_attn", "count": 1, "args": [t(1, 5, 2, 8)] * 3, "kwargs": {}}]
    gate = toy / "profile/toy_rec-opt/gate"
    gate.mkdir(parents=True)
    (gate / "calls.json").write_text(json.dumps({"schema": 1, "package": "toyop", "calls": calls}))
    r = flaloop(toy, "init", "toy_rec", "--modes", "fwd", "--json")
    assert r.code == 0, r.stderr
    assert r.json["shapes"] == ["call0_1x40x2x8", "call2_1x5x2x8"]
    r = flaloop(toy, "bench", "toy_rec", "--json", "--aa", *QUICK, "--shapes", "call2_1x5x2x8")
    assert r.code == 0, r.stderr
    (cell,) = r.json["cells"]
    assert cell["status"] == "ok" and cell["cell"]["shape"]["q_1"] == 5, cell.get("reason")
