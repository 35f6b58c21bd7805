"""The guard's dynamic probes, as the bench runs them: each planted cheat, in two disguises, is
caught by its probe id. Each cheat is a tree of the worker-test target whose op misbehaves; a base
worker and one worker per cheat run the real protocol (setup, the mutated-inputs dump/compare,
probe) and `flaloop.guard.dynamic` judges the two reports, as the session does."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.worker import REGISTRY, Driver, cell

from flaloop.guard import dynamic as judge

torch = pytest.importorskip("torch")

HEADER = '''import os
import threading
import time

import torch
import triton
import triton.language as tl

SCALE = 1.0


@triton.jit
def _row_kernel(q, k, v, o, scale, D: tl.constexpr):
    i = tl.program_id(0)
    offs = i * D + tl.arange(0, D)
    s = tl.sum(tl.load(q + offs) * tl.load(k + offs), axis=0) * scale
    tl.store(o + offs, s * tl.load(v + offs))


def _triton(q, k, v, scale):
    o = torch.empty_like(v)
    _row_kernel[(q.numel() // q.shape[-1],)](q, k, v, o, scale, D=q.shape[-1])
    return o


def _ref(q, k, v, scale):
    return (q * k).sum(-1, keepdim=True) * v * scale


def toy_gate(q, k, v, g, cu_seqlens=None):
    return (q * k).sum(-1, keepdim=True) * v * g.exp().unsqueeze(-1), None


def toy_ident(x):
    return x.clone()


def toy_varlen(x, cu_seqlens=None):
    return x * 2.0, cu_seqlens.clone()
'''

BASE = '''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    return _triton(q, k, v, 1.0 if scale is None else scale), None
'''

# name -> (op module source after HEADER, package __init__ source, the probe id that must catch it)
CHEATS = {
    # outputs cached by pointer / by identity and shape: stale after an in-place change of the inputs
    "cache-by-pointer": ('''
_CACHE = {}


def toy_op(q, k, v, scale=None, cu_seqlens=None):
    key = q.data_ptr()
    if key not in _CACHE:
        _CACHE[key] = _triton(q, k, v, 1.0 if scale is None else scale)
    return _CACHE[key], None
''', "", "inputs-mutated"),
    "warm-up-detection": ('''
_SEEN = {"n": 0, "out": None}


def toy_op(q, k, v, scale=None, cu_seqlens=None):
    _SEEN["n"] += 1
    if _SEEN["n"] > 12 and _SEEN["out"] is not None and _SEEN["out"].shape == v.shape:
        return _SEEN["out"], None  # the harness has stopped checking by now, surely
    _SEEN["out"] = _triton(q, k, v, 1.0 if scale is None else scale)
    return _SEEN["out"], None
''', "", "inputs-mutated"),
    # memory never written: correct only when the allocator hands back the right leftovers
    "unwritten-tail": ('''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    full = _triton(q, k, v, 1.0 if scale is None else scale)
    o = torch.empty_like(v)
    o[:, :-1] = full[:, :-1]
    return o, None
''', "", "unwritten-output"),
    "unwritten-new-empty": ('''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    full = _triton(q, k, v, 1.0 if scale is None else scale)
    o = v.new_empty(v.shape)
    o[..., 1:] = full[..., 1:]
    return o, None
''', "", "unwritten-output"),
    # work finished after the call returned
    "deferred-thread": ('''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    full = _triton(q, k, v, 1.0 if scale is None else scale)
    o = torch.zeros_like(v)
    threading.Thread(target=lambda: (time.sleep(0.05), o.copy_(full))).start()
    return o, None
''', "", "deferred-work"),
    "lazy-subclass": ('''

class Lazy(torch.Tensor):
    pass


def toy_op(q, k, v, scale=None, cu_seqlens=None):
    return _triton(q, k, v, 1.0 if scale is None else scale).as_subclass(Lazy), None
''', "", "output-subclass"),
    # compute handed to a library instead of the op's own kernel
    "einsum-instead": ('''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    s = torch.einsum('bthd,bthd->bth', q, k).unsqueeze(-1)
    return s * v * (1.0 if scale is None else scale), None
''', "", "no-own-kernel"),
    "matmul-helper": ('''
from toyop.ops.helpers import fast_path


def toy_op(q, k, v, scale=None, cu_seqlens=None):
    return fast_path(q, k, v, 1.0 if scale is None else scale), None
''', "", "library-compute"),
    # global numeric settings and environment changed at import
    "tf32-flag": (BASE + "\ntorch.backends.cuda.matmul.allow_tf32 = True\n", "", "numeric-settings"),
    "triton-f32-env": (BASE, "import os\nos.environ['TRITON_F32_DEFAULT'] = 'tf32'\n", "numeric-settings"),
    "matmul-precision": (BASE, "import torch\ntorch.set_float32_matmul_precision('medium')\n", "numeric-settings"),
    # a race: two calls disagree
    "racy-noise": ('''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    o = _triton(q, k, v, 1.0 if scale is None else scale)
    return o + 0.05 * o.abs().mean() * torch.randn_like(o), None
''', "", "nondeterministic"),
    "racy-parity": ('''
_N = [0]


def toy_op(q, k, v, scale=None, cu_seqlens=None):
    _N[0] += 1
    o = _triton(q, k, v, 1.0 if scale is None else scale)
    return (o * 1.02 if _N[0] % 2 else o), None
''', "", "nondeterministic"),
    # an output that is an input's storage
    "output-is-input": ('''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    o = _triton(q, k, v, 1.0 if scale is None else scale)
    v.data.copy_(o)
    return v, None
''', "", "output-aliases-input"),
    "output-views-input": ('''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    o = _triton(q, k, v, 1.0 if scale is None else scale)
    buf = q.detach().view(-1)
    buf.copy_(o.reshape(-1))
    return buf.view_as(o), None
''', "", "output-aliases-input"),
}

HELPERS = '''import torch


def fast_path(q, k, v, scale):
    s = torch.matmul(q.unsqueeze(-2), k.unsqueeze(-1)).squeeze(-1)
    return s * v * scale
'''

# A patched timer, in the package __init__ and in the op's module: caught at import (hello).
TIMER_CHEATS = {
    "perf-counter-in-init": (BASE, "import time\n_real = time.perf_counter\ntime.perf_counter = lambda: _real() * 0.8\n"),
    "event-in-op-module": (BASE + '''
_orig = torch.cuda.Event.elapsed_time
torch.cuda.Event.elapsed_time = lambda self, end: 0.8 * _orig(self, end)
''', ""),
}

HONEST = {
    "algebraic-rewrite": '''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    s = 1.0 if scale is None else scale
    return _triton(q, k, v * s, 1.0), None
''',
    "comment-and-rename": '''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    # the row kernel does all the work
    factor = 1.0 if scale is None else scale
    return _triton(q, k, v, factor), None
''',
}


def make_tree(root, op_src: str, init_src: str = ""):
    (root / "benchmarks" / "ops").mkdir(parents=True)
    (root / "benchmarks" / "ops" / "registry.py").write_text(REGISTRY)
    pkg = root / "toyop" / "ops" / "scale"
    pkg.mkdir(parents=True)
    (root / "toyop" / "__init__.py").write_text(init_src)
    (root / "toyop" / "ops" / "__init__.py").write_text("")
    (root / "toyop" / "ops" / "helpers.py").write_text(HELPERS)
    (pkg / "__init__.py").write_text(HEADER + op_src)
    return root


CELL = cell("c", mode="fwd", dtype="float32", seed=1)


def report(w: Driver, tmp, name: str, base: Driver | None = None) -> tuple[dict, dict | None]:
    """A side's probes; with `base`, its mutated results dumped and judged by the base (warmup.exchange)."""
    w.ok("setup", cell=CELL)
    r = w.ok("probe", cell="c")
    w.ok("dump", cell="c", mutated=True, path=str(tmp / f"{name}-mutated.pt"))
    if base is None:
        return r["probes"], None
    with _BASE:  # one base worker judges every candidate
        judged = base.ok("compare", cell="c", mutated=True, ref=str(tmp / "base-mutated.pt"),
                         subject=str(tmp / f"{name}-mutated.pt"), tol=0.005)
    return r["probes"], judged


_BASE = threading.Lock()


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """{name: (findings, hello)} for every cheat and honest change, judged against one base."""
    tmp = tmp_path_factory.mktemp("probes")
    trees = {"base": make_tree(tmp / "base", BASE)}
    for name, (src, init, _) in CHEATS.items():
        trees[name] = make_tree(tmp / name, src, init)
    for name, (src, init) in TIMER_CHEATS.items():
        trees[name] = make_tree(tmp / name, src, init)
    for name, src in HONEST.items():
        trees[name] = make_tree(tmp / name, src)
    # forked by a warm fork server, as a bench's workers are by default
    workers = {name: Driver(t, "toy_op", "base" if name == "base" else "cand", forked=True) for name, t in trees.items()}
    try:
        base_hello = workers["base"].ok("hello")
        base, _ = report(workers["base"], tmp, "base")

        def judge_one(name: str) -> list:
            w = workers[name]
            hello = w.ok("hello")
            found = judge.integrity(base_hello.get("integrity") or [], hello.get("integrity") or [])
            if name not in TIMER_CHEATS:
                cand, mutated = report(w, tmp, name, workers["base"])
                found += judge.cell_findings("c", base, cand, mutated, diff_tol=0.005)
            return found

        # one thread per worker process: their setups and probes overlap
        names = [n for n in workers if n != "base"]
        with ThreadPoolExecutor(4) as pool:
            out = dict(zip(names, pool.map(judge_one, names), strict=True))
        yield out
    finally:
        for w in workers.values():  # EOF to all first: they exit in parallel
            if not w.p.stdin.closed:
                w.p.stdin.close()
        for w in workers.values():
            w.close()


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_each_planted_cheat_is_caught_by_its_probe(judged, name):
    rules = {f.rule for f in judged[name] if f.blocking}
    assert CHEATS[name][2] in rules, json.dumps([f.to_dict() for f in judged[name]], indent=1)


@pytest.mark.parametrize("name", sorted(TIMER_CHEATS))
def test_a_patched_timer_is_caught_at_import_and_named(judged, name):
    (f,) = [f for f in judged[name] if f.rule == "timer-patched"]
    assert f.blocking and "replaced" in f.message and "toyop" in f.message


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_changes_raise_no_finding(judged, name):
    assert judged[name] == [], [f.to_dict() for f in judged[name]]


# a graph that copies a result kept from the last eager call instead of computing: the replay
# writes every output (the graph proof passes on the inputs it was captured on), and runs no kernel
# of the op's own
GRAPH_ESCAPE = '''

def toy_op(q, k, v, scale=None, cu_seqlens=None):
    kept = vars(q).get("_" + "last")
    if torch.cuda.is_current_stream_capturing() and kept is not None:
        o = torch.empty_like(v)
        o.copy_(kept)
        return o, None
    o = _triton(q, k, v, 1.0 if scale is None else scale)
    vars(q)["_" + "last"] = o.detach().clone()
    return o, None
'''


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_work_missing_from_the_captured_graph_is_a_graph_escape_and_fails_the_self_check(tmp_path):
    trees = {"base": make_tree(tmp_path / "base", BASE), "cand": make_tree(tmp_path / "cand", GRAPH_ESCAPE)}
    workers = {side: Driver(t, "toy_op", side, device="cuda") for side, t in trees.items()}
    spec = cell("g", mode="fwd", dtype="float32", seed=1, shape={"B": 4, "T": 256, "H": 4, "D": 64})
    try:
        probes, checks = {}, {}
        for side, w in workers.items():
            w.ok("hello")
            r = w.ok("setup", cell={**spec, "reference": True})
            assert r["timer"] == "cuda_graph", r  # the proof passed: the copy writes every output
            probes[side] = w.ok("probe", cell="g")["probes"]
            w.ok("sample", cell="g", n=3)
            checks[side] = w.ok("selfcheck", cell="g", tol=0.005)
        assert probes["base"]["graph"]["checked"] and not probes["base"]["graph"]["missing"]
        assert "_row_kernel" in probes["cand"]["graph"]["missing"]
        found = judge.cell_findings("g", probes["base"], probes["cand"], None, diff_tol=0.005)
        assert "graph-escape" in {f.rule for f in found if f.blocking}, [f.to_dict() for f in found]
        assert checks["base"]["match"] is True
        assert checks["cand"]["checks"]["replay-mutated"]["match"] is False  # the kept result, stale
    finally:
        for w in workers.values():
            w.close()
