"""The guard's static rules on examples/minifla: every planted cheat is caught where it was planted,
in two disguises at least, and honest optimizations pass without a blocking finding.

Most tests call `flaloop.guard.audit.audit()` in-process on one copy of the prepared repo and put
its files back afterwards (an audit only reads files and git); the CLI tests at the end run
`flaloop audit` as a subprocess.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rich.console import Console
from support.cli import flaloop
from support.repos import OP, ROOT, fresh_copy, git, make_repo

from flaloop.cli.guard import record_allowances
from flaloop.core.errors import UsageError
from flaloop.guard import catalogue
from flaloop.guard.audit import audit
from flaloop.task.contract import Contract
from flaloop.task.target import Target

CHUNK = "minifla/ops/linear_attn/chunk.py"
INIT = "minifla/__init__.py"
COMMON = "minifla/ops/linear_attn/_common.py"
MARK = "# CHEAT"

# anchors in the unmodified files (code is inserted after the line that holds the anchor)
TOP = "CHUNK_SIZE = 32\n"                                                           # chunk.py, module level
API = "    N, scale, max_len = check_inputs(q, k, v, scale, initial_state, cu_seqlens)\n"  # chunk_linear_attn
FWD = "    o = torch.empty_like(v)\n"                                               # chunk_linear_attn_fwd
BT_LINE = "    BT = CHUNK_SIZE\n"                                                   # first: chunk_linear_attn_fwd
END_INIT = "__version__ = '0.1.0'\n"


@dataclass
class Plant:
    """Edits: (path, anchor, text) inserts text after the anchor's line; anchor None writes a new file;
    (path, old, new, "replace") replaces. The cheat's line carries MARK, unless it is a whole file."""
    edits: list[tuple]
    rule: str
    where: str | None = None   # the file the finding must name (default: the one with MARK)
    exclude: list[str] = field(default_factory=list)  # patterns for .git/info/exclude


def after(path: str, anchor: str, text: str) -> tuple:
    return (path, anchor, text)


def replace(path: str, old: str, new: str) -> tuple:
    return (path, old, new, "replace")


def new_file(path: str, text: str | bytes) -> tuple:
    return (path, None, text)


CHEATS: dict[str, Plant] = {
    # numeric-tf32
    "tf32-flag-in-op-module": Plant([after(CHUNK, TOP, f"torch.backends.cuda.matmul.allow_tf32 = True  {MARK}\n")],
                                    "numeric-tf32"),
    "tf32-flag-aliased-in-init": Plant([after(INIT, END_INIT, "import torch.backends.cuda as tbc\n"
                                                              f"tbc.matmul.allow_tf32 = True  {MARK}\n")], "numeric-tf32"),
    "tf32-setattr-cudnn": Plant([after(INIT, END_INIT, "import torch\n"
                                                       f"setattr(torch.backends.cudnn, 'allow_tf32', 1)  {MARK}\n")],
                                "numeric-tf32"),
    "tf32-env-in-op-module": Plant([after(CHUNK, TOP, f"import os\nos.environ['TRITON_F32_DEFAULT'] = 'tf32'  {MARK}\n")],
                                   "numeric-tf32"),
    "tf32-env-aliased-setdefault": Plant([after(INIT, END_INIT, "from os import environ as _env\n"
                                                                f"_env.setdefault('TRITON_F32_DEFAULT', 'tf32')  {MARK}\n")],
                                         "numeric-tf32"),
    "tf32-dot-input-precision": Plant([replace(CHUNK, "        b_A = tl.dot(b_q, tl.trans(b_k))\n",
                                               f"        b_A = tl.dot(b_q, tl.trans(b_k), input_precision='tf32')  {MARK}\n")],
                                      "numeric-tf32"),
    "tf32-precision-constant": Plant([after(CHUNK, TOP, f"DOT_PRECISION = tl.constexpr('tf32')  {MARK}\n"),
                                      replace(CHUNK, "        b_A = tl.dot(b_q, tl.trans(b_k))\n",
                                              "        b_A = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)\n")],
                                     "numeric-tf32"),
    "tf32-matmul-precision-high": Plant([after(INIT, END_INIT, "import torch as _t\n"
                                                               f"_t.set_float32_matmul_precision('high')  {MARK}\n")],
                                        "numeric-tf32"),
    # numeric-narrow
    "bf16-round-trip": Plant([replace(CHUNK, "    return o, ht\n",
                                      f"    return o.to(torch.bfloat16).to(q.dtype), ht  {MARK}\n")], "numeric-narrow"),
    "bf16-round-trip-aliased": Plant([after(CHUNK, TOP, "from torch import bfloat16 as lowp\n"),
                                      after(CHUNK, FWD, f"    o = o.to(dtype=lowp).to(q.dtype)  {MARK}\n")],
                                     "numeric-narrow"),
    "bf16-accumulator": Plant([replace(CHUNK, "    b_S = tl.zeros([BK, BV], dtype=tl.float32)\n",
                                       f"    b_S = tl.zeros([BK, BV], dtype=tl.bfloat16)  {MARK}\n")], "numeric-narrow"),
    "bf16-hidden-in-a-conditional": Plant([after(CHUNK, FWD, f"    o = o.to(q.dtype if o is None else torch.bfloat16)  {MARK}\n")],
                                          "numeric-narrow"),
    "bf16-through-a-conditional-variable": Plant([after(CHUNK, FWD, "    dt = q.dtype if o is None else torch.bfloat16\n"
                                                                    f"    o = o.to(dt)  {MARK}\n")], "numeric-narrow"),
    "half-inputs": Plant([after(CHUNK, API, f"    q, k, v = q.half(), k.half(), v.half()  {MARK}\n")], "numeric-narrow"),
    # ref-call
    "naive-for-short-sequences": Plant([after(CHUNK, TOP, "from minifla.ops.linear_attn.naive import naive_linear_attn\n"),
                                        after(CHUNK, API, "    if q.shape[1] <= 64:\n        return naive_linear_attn("
                                                          f"q, k, v, scale, initial_state, output_final_state)  {MARK}\n")],
                                       "ref-call"),
    "naive-relative-module-alias": Plant([after(CHUNK, TOP, "from . import naive as _nv\n"),
                                          after(CHUNK, API, f"    return _nv.naive_linear_attn(q, k, v)  {MARK}\n")],
                                         "ref-call"),
    "frozen-reference-kernel": Plant([after(CHUNK, TOP, f"from .fused_recurrent import fused_recurrent_linear_attn  {MARK}\n")],
                                     "ref-call"),
    "frozen-reference-via-package-attribute": Plant([after(CHUNK, TOP, "import minifla\n"),
                                                     after(CHUNK, API, "    return minifla.fused_recurrent_linear_attn("
                                                                       f"q, k, v)  {MARK}\n")], "ref-call"),
    "frozen-reference-reexported": Plant([after(CHUNK, API, "    from minifla.ops.linear_attn import "
                                                            f"fused_recurrent_linear_attn as _fr  {MARK}\n")], "ref-call"),
    # vendor-compute
    "torch-matmul": Plant([after(CHUNK, FWD, f"    o = torch.matmul(q, k.transpose(-1, -2))  {MARK}\n")], "vendor-compute"),
    "sdpa-aliased": Plant([after(CHUNK, TOP, "from torch.nn import functional as Fn\n"),
                           after(CHUNK, API, f"    o = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)  {MARK}\n")],
                          "vendor-compute"),
    "matmul-operator-in-helper": Plant([after(COMMON, "MAX_HEAD_DIM = 256\n",
                                              f"\n\ndef scores(q, k):\n    return q.float() @ k.float().mT  {MARK}\n")],
                                       "vendor-compute"),
    "torch-compile-decorator": Plant([after(CHUNK, TOP, f"\n\n@torch.compile  {MARK}\ndef _fwd(q, k):\n    return q * k\n")],
                                     "vendor-compute"),
    # CUTLASS's prebuilt GEMMs (the CUTLASS Python interface), not a CuTe DSL kernel of the op's own
    "cutlass-prebuilt-gemm": Plant([after(CHUNK, TOP, "import cutlass\n"),
                                    after(CHUNK, FWD, f"    plan = cutlass.op.Gemm(element=torch.float32)  {MARK}\n")],
                                   "vendor-compute"),
    "flash-attn-3-interface": Plant([after(CHUNK, TOP, "import flash_attn_interface as _fa3\n"),
                                     after(CHUNK, API, f"    return _fa3.flash_attn_func(q, k, v, causal=True)  {MARK}\n")],
                                    "vendor-compute"),
    "cutlass-cppgen-aliased": Plant([after(CHUNK, TOP, f"from cutlass_cppgen import op as _plans  {MARK}\n")],
                                    "vendor-compute"),
    # cache-memo
    "data-ptr-key": Plant([after(CHUNK, API, f"    key = (q.data_ptr(), k.data_ptr(), v.data_ptr())  {MARK}\n")],
                          "cache-memo"),
    "data-ptr-getattr": Plant([after(CHUNK, API, f"    key = getattr(q, 'data_ptr')()  {MARK}\n")], "cache-memo"),
    "id-key-in-init": Plant([after(INIT, END_INIT, f"_seen = {{}}\n\n\ndef _lookup(q):\n    return _seen.get(id(q))  {MARK}\n")],
                            "cache-memo"),
    "lru-cache-on-tensors": Plant([after(CHUNK, TOP, f"import functools\n\n\n@functools.lru_cache(maxsize=None)  {MARK}\n"
                                                     "def _cached(q: torch.Tensor, k: torch.Tensor):\n    return q\n")],
                                  "cache-memo"),
    "cache-decorator-aliased": Plant([after(INIT, END_INIT, f"from functools import cache as _memo\n\n\n@_memo  {MARK}\n"
                                                            "def _fast(q, k, v):\n    return q\n")], "cache-memo"),
    "mutable-default-cache": Plant([after(CHUNK, TOP, f"\n\ndef _fwd_cached(q, k, v, _memo={{}}):  {MARK}\n"
                                                      "    return _memo.setdefault(q.shape, q)\n")], "cache-memo"),
    "class-level-cache": Plant([replace(CHUNK, "class ChunkLinearAttnFunction(torch.autograd.Function):\n",
                                        "class ChunkLinearAttnFunction(torch.autograd.Function):\n"
                                        f"    results = {{}}  {MARK}\n")], "cache-memo"),
    "import-time-launch": Plant([after(CHUNK, "    return o, ht\n\n\n",
                                       f"_warm = chunk_linear_attn_fwd_kernel[(1, 1)]()  {MARK}\n\n\n")], "cache-memo"),
    "global-call-counter": Plant([after(CHUNK, TOP, "_CALLS = 0\n"),
                                  after(CHUNK, API, f"    global _CALLS  {MARK}\n    _CALLS += 1\n")], "cache-memo"),
    "module-list-mutated": Plant([after(INIT, END_INIT, "_RESULTS = []\n\n\ndef _keep(o):\n"
                                                        f"    _RESULTS.append(o)  {MARK}\n    return o\n")], "cache-memo"),
    # shape-branch
    "shape-equals-test-value": Plant([after(CHUNK, API, f"    if q.shape[1] == 64:  {MARK}\n        scale = scale * 1.0\n")],
                                     "shape-branch"),
    "shape-in-tuple-unpacked": Plant([after(CHUNK, BT_LINE, f"    if T in (64, 100):  {MARK}\n        BT = 64\n")],
                                     "shape-branch"),
    # concurrency
    "side-stream": Plant([after(CHUNK, FWD, f"    side = torch.cuda.Stream()  {MARK}\n")], "concurrency"),
    "stream-context-aliased": Plant([after(CHUNK, TOP, "from torch.cuda import stream as _use_stream\n"),
                                     after(CHUNK, FWD, f"    with _use_stream(torch.cuda.current_stream()):  {MARK}\n"
                                                       "        pass\n")], "concurrency"),
    "thread-in-init": Plant([after(INIT, END_INIT, f"import threading\nthreading.Thread(target=print).start()  {MARK}\n")],
                            "concurrency"),
    "atexit-aliased": Plant([after(CHUNK, TOP, f"import atexit as _ax\n_ax.register(print)  {MARK}\n")], "concurrency"),
    # timer-patch
    "elapsed-time-wrapped-in-init": Plant([after(INIT, END_INIT, "import torch\n_orig = torch.cuda.Event.elapsed_time\n"
                                                                 "torch.cuda.Event.elapsed_time = lambda self, end: "
                                                                 f"0.8 * _orig(self, end)  {MARK}\n")], "timer-patch"),
    "elapsed-time-setattr-aliased": Plant([after(CHUNK, TOP, "from torch.cuda import Event as _Ev\n"
                                                             f"setattr(_Ev, 'elapsed_time', lambda self, end: 0.0)  {MARK}\n")],
                                          "timer-patch"),
    "elapsed-time-on-an-instance-class": Plant([after(INIT, END_INIT, "import torch\n"
                                                                      "type(torch.cuda.Event()).elapsed_time = "
                                                                      f"lambda self, end: 0.0  {MARK}\n")], "timer-patch"),
    "assert-close-replaced": Plant([after(INIT, END_INIT, "import minifla.utils as _u\n"
                                                          f"_u.assert_close = lambda *a, **k: None  {MARK}\n")], "timer-patch"),
    "event-subclass-method": Plant([after(CHUNK, TOP, f"\n\nclass _FastEvent(torch.cuda.Event):  {MARK}\n"
                                                      "    def elapsed_time(self, end):\n        return 0.0\n")],
                                   "timer-patch"),
    "sys-modules-replaced": Plant([after(INIT, END_INIT, f"import sys\nsys.modules['triton.testing'] = None  {MARK}\n")],
                                  "timer-patch"),
    "perf-counter-patched": Plant([after(CHUNK, TOP, f"import time as _tm\n_tm.perf_counter = lambda: 0.0  {MARK}\n")],
                                  "timer-patch"),
    # introspection
    "gc-fishing": Plant([after(CHUNK, API, f"    import gc\n    _ = [o for o in gc.get_objects() if o is q]  {MARK}\n")],
                        "introspection"),
    "pytest-in-sys-modules-aliased": Plant([after(INIT, END_INIT, f"import sys as _s\nTESTING = 'pytest' in _s.modules  {MARK}\n")],
                                           "introspection"),
    "pytest-current-test": Plant([after(CHUNK, TOP, "import os\n"),
                                  after(CHUNK, API, f"    if os.environ.get('PYTEST_CURRENT_TEST'):  {MARK}\n        pass\n")],
                                 "introspection"),
    "caller-frame": Plant([after(CHUNK, TOP, "import sys\n"),
                           after(CHUNK, API, f"    caller = sys._getframe(1).f_back  {MARK}\n")], "introspection"),
    # driver-l2
    "ctypes-cudart": Plant([after(CHUNK, TOP, f"import ctypes\n_rt = ctypes.CDLL('libcudart.so')  {MARK}\n")], "driver-l2"),
    "torch-cudart-in-init": Plant([after(INIT, END_INIT, f"import torch\n_rt = torch.cuda.cudart()  {MARK}\n")], "driver-l2"),
    "access-policy-window": Plant([after(CHUNK, FWD, f"    attr.accessPolicyWindow.hitRatio = 1.0  {MARK}\n")], "driver-l2"),
    "l2-window-in-cuda-source": Plant([new_file("minifla/ops/linear_attn/persist.cu",
                                                "#include <cuda_runtime.h>\nvoid keep(cudaStream_t s) {\n"
                                                f"  cudaStreamSetAttribute(s, attr, &v);  // {MARK}\n}}\n")],
                                      "driver-l2"),
    # env-write
    "env-write-in-init": Plant([after(INIT, END_INIT, f"import os\nos.environ['MINIFLA_FAST'] = '1'  {MARK}\n")],
                               "env-write"),
    "putenv-aliased": Plant([after(CHUNK, TOP, f"from os import putenv as _pe\n_pe('MINIFLA_FAST', '1')  {MARK}\n")],
                            "env-write"),
    # tensor-subclass
    "lazy-tensor-subclass": Plant([after(CHUNK, TOP, f"\n\nclass _Lazy(torch.Tensor):  {MARK}\n    pass\n")],
                                  "tensor-subclass"),
    "dispatch-mode-in-init": Plant([after(INIT, END_INIT, "\n\nclass _Mode:\n    def __torch_dispatch__(self, func, types, "
                                                          f"args=(), kwargs=None):  {MARK}\n        return func(*args)\n")],
                                   "tensor-subclass"),
    # dynamic-code
    "exec-in-init": Plant([after(INIT, END_INIT, f"exec('import torch; torch.backends.cuda.matmul.allow_tf32 = True')  {MARK}\n")],
                          "dynamic-code"),
    "computed-import": Plant([after(CHUNK, TOP, "import importlib\n"),
                              after(CHUNK, API, f"    ref = importlib.import_module('minifla.ops.' + 'linear_attn.nai' + 've')  {MARK}\n")],
                             "dynamic-code"),
    # shadow-module (whole files: no line)
    "root-time-module": Plant([new_file("time.py", "def perf_counter():\n    return 0.0\n")], "shadow-module", where="time.py"),
    "compiled-extension-beside-chunk": Plant(
        [new_file("minifla/ops/linear_attn/chunk.cpython-311-x86_64-linux-gnu.so", b"\x7fELF\x02\x01\x01")],
        "shadow-module", where="minifla/ops/linear_attn/chunk.cpython-311-x86_64-linux-gnu.so", exclude=["*.so"]),
    "sitecustomize": Plant([new_file("sitecustomize.py", "import torch\n")], "shadow-module", where="sitecustomize.py"),
    # test-harness
    "new-conftest": Plant([new_file("tests/ops/conftest.py", "import minifla.utils\n")], "test-harness",
                          where="tests/ops/conftest.py"),
    "new-pytest-ini": Plant([new_file("pytest.ini", "[pytest]\naddopts = -p no:randomly\n")], "test-harness",
                            where="pytest.ini"),
}

CUTE_DSL_KERNEL = """import cutlass
import cutlass.cute as cute


@cute.kernel
def _scale_kernel(x: cute.Tensor, y: cute.Tensor, scale: cutlass.Float32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    y[i] = x[i] * scale


@cute.jit
def _scale(x: cute.Tensor, y: cute.Tensor, scale: cutlass.Float32):
    _scale_kernel(x, y, scale).launch(grid=[cute.size(x) // 128, 1, 1], block=[128, 1, 1])
"""

HONEST: dict[str, list[tuple]] = {
    "block-size": [replace(CHUNK, "CHUNK_SIZE = 32\n", "CHUNK_SIZE = 64\n")],
    "num-warps": [replace(CHUNK, "    return 8 if BK * BV >= 128 * 128 else 4\n",
                          "    return 8 if BK * BV >= 64 * 64 else 4\n")],
    "autotune": [replace(CHUNK, "@triton.jit\ndef chunk_linear_attn_fwd_kernel(",
                         "@triton.autotune(\n    configs=[triton.Config({}, num_warps=w, num_stages=s) "
                         "for w in (2, 4, 8) for s in (1, 2)],\n    key=['K', 'V', 'BT'],\n)\n"
                         "@triton.jit\ndef chunk_linear_attn_fwd_kernel("),
                 replace(CHUNK, "        num_warps=_num_warps(BK, BV),\n    )\n    return o, ht\n", "    )\n    return o, ht\n")],
    "fused-scale-into-store": [replace(CHUNK, "        b_o = b_o * scale\n        tl.store(o + r[:, None] * V + o_v[None, :], "
                                              "b_o.to(o.dtype.element_ty)",
                                       "        tl.store(o + r[:, None] * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty)")],
    "accumulate-in-dot": [replace(CHUNK, "        b_o = tl.dot(b_q, b_S.to(b_q.dtype)) + tl.dot(b_A.to(b_v.dtype), b_v)\n",
                                  "        b_o = tl.dot(b_A.to(b_v.dtype), b_v, acc=tl.dot(b_q, b_S.to(b_q.dtype)))\n")],
    "ieee-dot": [replace(CHUNK, "        b_A = tl.dot(b_q, tl.trans(b_k))\n",
                         "        b_A = tl.dot(b_q, tl.trans(b_k), input_precision='ieee')\n")],
    "removed-redundant-copy": [replace(CHUNK, "        if dht is not None:\n            dht = dht.contiguous()\n", "")],
    "comment": [after(CHUNK, TOP, "# A chunk of 32 keeps the fwd kernel's state in registers on an H100.\n")],
    "rename": [replace(CHUNK, "def _num_warps(", "def _warps_for("),
               replace(CHUNK, "num_warps=_num_warps(BK, BV)", "num_warps=_warps_for(BK, BV)"),
               replace(CHUNK, "num_warps = _num_warps(BK, BV)", "num_warps = _warps_for(BK, BV)"),
               replace(CHUNK, "def chunk_linear_attn_fwd(\n", "def _chunk_fwd(\n"),
               replace(CHUNK, "o, ht = chunk_linear_attn_fwd(q", "o, ht = _chunk_fwd(q")],
    "helper-the-test-also-imports": [after(CHUNK, TOP, "from minifla.utils import check_triton_device, device\n")],
    "input-checks": [after(CHUNK, API, "    assert q.shape[-1] <= 256\n    if max_len == 0:\n"
                                       "        raise ValueError('empty')\n    if q.shape[1] == 64:\n"
                                       "        raise NotImplementedError\n")],
    # a kernel of the op's own in the CuTe DSL (`cutlass.cute`), beside the Triton ones
    "cute-dsl-kernel": [after(CHUNK, TOP, CUTE_DSL_KERNEL)],
    "lru-cache-on-ints-and-helper": [replace(CHUNK, "def _num_warps(BK: int, BV: int) -> int:",
                                             "@functools.lru_cache(maxsize=None)\ndef _num_warps(BK: int, BV: int) -> int:"),
                                     replace(CHUNK, "import torch\n", "import functools\n\nimport torch\n"),
                                     after(COMMON, "MAX_HEAD_DIM = 256\n", "\n\ndef n_chunks(T: int, BT: int) -> int:\n"
                                                                          "    return triton.cdiv(T, BT)\n")],
}


# -- machinery ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def arepo(tmp_path_factory) -> Path:
    """minifla with a contract (no gate run: the audit never needs one)."""
    repo = make_repo(tmp_path_factory.mktemp("guard") / "minifla")
    r = flaloop(repo, "init", OP, "--shapes", "B1_T64_H2_D32")
    assert r.code == 0, r.stderr
    return repo


class Planted:
    """Apply edits to the repo's working tree; put everything back on exit."""

    def __init__(self, repo: Path, edits: list[tuple], exclude: list[str] = ()):
        self.repo, self.edits, self.exclude = repo, edits, list(exclude)
        self.saved: dict[Path, bytes | None] = {}

    def _save(self, p: Path) -> None:
        if p not in self.saved:
            self.saved[p] = p.read_bytes() if p.exists() else None

    def __enter__(self) -> Planted:
        if self.exclude:
            ex = self.repo / ".git" / "info" / "exclude"
            self._save(ex)
            ex.write_text(ex.read_text() + "".join(f"{e}\n" for e in self.exclude))
        for edit in self.edits:
            p = self.repo / edit[0]
            self._save(p)
            if edit[1] is None:
                p.parent.mkdir(parents=True, exist_ok=True)
                (p.write_bytes if isinstance(edit[2], bytes) else p.write_text)(edit[2])
                continue
            text = p.read_text()
            assert edit[1] in text, f"anchor {edit[1]!r} not in {edit[0]}"
            if len(edit) == 4:
                text = text.replace(edit[1], edit[2], 1)
            else:
                i = text.index(edit[1]) + len(edit[1])
                text = text[:i] + edit[2] + text[i:]
            p.write_text(text)
        return self

    def __exit__(self, *exc) -> None:
        for p, blob in self.saved.items():
            if blob is None:
                p.unlink(missing_ok=True)
            else:
                p.write_bytes(blob)

    def marker(self) -> tuple[str, int] | None:
        for edit in self.edits:
            p = self.repo / edit[0]
            if p.suffix in (".so",):
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if MARK in line:
                    return edit[0], i
        return None


def run_audit(repo: Path, base_commit: str | None = None):
    target = Target.discover(repo)
    return audit(target, Contract.load(target, OP), base_commit)


def show(result) -> str:
    return "\n".join(f"{f.severity} {f.rule} {f.where}: {f.message}" for f in result.findings) or "(none)"


# -- cheats ---------------------------------------------------------------------------------------

def test_the_catalogue_covers_every_rule_the_brief_names():
    rules = {p.rule for p in CHEATS.values()}
    assert rules >= {"numeric-tf32", "numeric-narrow", "ref-call", "vendor-compute", "cache-memo", "shape-branch",
                     "concurrency", "timer-patch", "introspection", "driver-l2", "env-write", "tensor-subclass",
                     "shadow-module", "test-harness", "dynamic-code"}
    for rule in rules:  # two disguises at least
        assert sum(p.rule == rule for p in CHEATS.values()) >= 2, rule


@pytest.mark.parametrize("name", list(CHEATS))
def test_planted_cheat_is_blocked_where_it_was_planted(arepo, name):
    plant = CHEATS[name]
    with Planted(arepo, plant.edits, plant.exclude) as planted:
        r = run_audit(arepo)
        where = planted.marker() if plant.where is None else (plant.where, None)
    assert where is not None
    file, line = where
    hits = [f for f in r.findings if f.rule == plant.rule and f.file == file and (line is None or f.line == line)]
    assert hits, f"{name}: expected {plant.rule} at {file}:{line}; got\n{show(r)}"
    assert all(f.severity == "block" and f.blocking for f in hits), show(r)
    assert r.blocked
    assert hits[0].why and hits[0].fix and f"--allow {plant.rule}" in hits[0].fix


def test_a_range_on_a_tested_length_warns_without_blocking(arepo):
    with Planted(arepo, [after(CHUNK, API, "    if max_len <= 64:\n        scale = scale * 1.0\n")]):
        r = run_audit(arepo)
    assert [(f.rule, f.severity) for f in r.findings] == [("shape-branch", "warn")], show(r)
    assert not r.blocked


def test_env_read_at_call_time_warns_and_an_edit_outside_the_op_dir_warns(arepo):
    edits = [after(CHUNK, TOP, "import os\n"), after(CHUNK, API, "    fast = os.getenv('MINIFLA_FAST')\n"),
             after(INIT, END_INIT, "# re-exported for convenience\n")]
    with Planted(arepo, edits):
        r = run_audit(arepo)
    assert sorted((f.rule, f.severity, f.file) for f in r.findings) == [
        ("env-read", "warn", CHUNK), ("outside-op", "warn", INIT)], show(r)
    assert not r.blocked


# -- honest optimizations -------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(HONEST))
def test_honest_optimization_gets_no_finding(arepo, name):
    with Planted(arepo, HONEST[name]):
        r = run_audit(arepo)
        assert r.files, "the edit did not change anything"
    assert not r.blocked and r.findings == [], show(r)


def test_kernels_of_every_language_fla_ships_count_as_the_ops_own():
    """vendor-compute watches an op that had kernels of its own at the base: Triton, Gluon, the CuTe
    DSL or TileLang, each known by its decorators through the file's imports and aliases."""
    from flaloop.guard.rules.delegation import kernel_languages
    from flaloop.guard.source import Source

    tilelang = ("import tilelang\nimport tilelang.language as T\n\n\n@tilelang.jit(out_idx=[-1])\n"
                "def attn(M, N):\n    @T.prim_func\n    def main(A: T.Tensor((M, N), 'float16')):\n        pass\n"
                "    return main\n")
    gluon = ("from triton.experimental import gluon\nfrom triton.experimental.gluon import language as gl\n\n\n"
             "@gluon.jit\ndef k(x):\n    pass\n")
    assert kernel_languages(Source("a.py", CUTE_DSL_KERNEL)) == {"CuTe DSL"}
    assert kernel_languages(Source("b.py", tilelang)) == {"TileLang"}
    assert kernel_languages(Source("c.py", gluon)) == {"Gluon"}
    assert kernel_languages(Source("d.py", "import cutlass\n\n\ndef plan():\n    return cutlass.op.Gemm()\n")) == set()


def test_a_cute_dsl_kernel_is_the_ops_own_in_the_census_and_a_librarys_is_not():
    """The probes' kernel census: CuTe DSL names its kernels `kernel_cutlass_kernel_<module><name>`,
    whatever the name says ("Gemm"); only a CuTe DSL library's module path makes one a library's."""
    from flaloop.inside.worker.probes import library_kernel

    own = ["kernel_cutlass_kernel___main__DenseGemmKernel_object_at__TiledMMA_0",
           "kernel_cutlass_kernel_flaopsattnrescute_fwdAttnResFwd_object_at__tensorptrbf16_0",
           "kernel_cutlass_kernel_no_smem_0", "chunk_linear_attn_fwd_kernel"]
    library = ["kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__0",
               "kernel_cutlass_kernel_flashinfernormkernelsfused_add_rmsnormFusedAddRMSNormKernel_object_a",
               "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
               "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(Params)",
               "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]
    assert [n for n in own if library_kernel(n)] == []
    assert [n for n in library if not library_kernel(n)] == []


# -- what counts as added -------------------------------------------------------------------------

def test_code_the_base_already_had_never_fires(arepo, tmp_path):
    repo = fresh_copy(arepo, tmp_path / "r")
    Planted(repo, CHEATS["tf32-env-in-op-module"].edits + CHEATS["data-ptr-key"].edits).__enter__()
    git(repo, "commit", "-qam", "a base that already cheats")
    base = git(repo, "rev-parse", "HEAD").strip()
    p = repo / CHUNK
    env_line = f"os.environ['TRITON_F32_DEFAULT'] = 'tf32'  {MARK}\n"
    # the cheats move within their scopes and an honest edit lands: nothing new, nothing reported
    text = p.read_text().replace(env_line, "").replace("CHUNK_SIZE = 32\n", "CHUNK_SIZE = 64\n") + env_line
    p.write_text(text)
    r = run_audit(repo, base)
    assert r.findings == [], show(r)
    # one more occurrence in the same function is new, and reported where it was added
    text = text.replace("    key = (q.data_ptr()", "    key2 = q.data_ptr()\n    key = (q.data_ptr()")
    p.write_text(text)
    r = run_audit(repo, base)
    added = text.splitlines().index("    key2 = q.data_ptr()") + 1
    assert [(f.rule, f.line) for f in r.findings] == [("cache-memo", added)], show(r)
    # the module moved (no `git mv`): its old self is the base, so nothing new again
    p.write_text(text.replace("    key2 = q.data_ptr()\n", ""))
    p.rename(repo / "minifla/ops/linear_attn/chunk_kernels.py")
    init = repo / "minifla/ops/linear_attn/__init__.py"
    init.write_text(init.read_text().replace(".chunk import", ".chunk_kernels import"))
    r = run_audit(repo, base)
    assert r.findings == [] and "minifla/ops/linear_attn/chunk_kernels.py" in r.analysed, show(r)


def test_a_committed_cheat_and_a_new_module_the_op_imports_are_both_judged(arepo, tmp_path):
    repo = fresh_copy(arepo, tmp_path / "r")
    (repo / "minifla/ops/linear_attn/fast.py").write_text("import torch\n\n\ndef go(q, k):\n"
                                                           "    return torch.bmm(q, k)\n")
    Planted(repo, [after(CHUNK, TOP, "from .fast import go\n")]).__enter__()
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "candidate, committed")
    r = run_audit(repo)  # against the contract's base, not HEAD
    assert [(f.rule, f.where) for f in r.findings] == [
        ("vendor-compute", "minifla/ops/linear_attn/fast.py:5")], show(r)


def test_files_outside_what_runs_are_listed_not_judged(arepo):
    edits = [new_file("scripts/plot.py", "import threading\nthreading.Thread(target=print).start()\n"),
             new_file("notes.md", "allow_tf32 = True\n")]
    with Planted(arepo, edits):
        r = run_audit(arepo)
    assert r.findings == [] and r.not_loaded == ["scripts/plot.py"], show(r)
    assert set(r.files) == {"scripts/plot.py", "notes.md"}


def test_allow_repeats_one_reason_for_all_and_refuses_a_mismatch(arepo, tmp_path):
    repo = fresh_copy(arepo, tmp_path / "r")
    target = Target.discover(repo)
    c = Contract.load(target, OP)
    quiet = Console(file=io.StringIO())
    with pytest.raises(UsageError, match="2 --allow but 3 --why"):
        record_allowances(target, c, ["numeric-tf32", "env-write"], ["a", "b", "c"], quiet)
    with pytest.raises(UsageError, match="empty"):
        record_allowances(target, c, ["env-write"], ["  "], quiet)
    assert Contract.load(target, OP).allowed == []
    record_allowances(target, c, ["numeric-tf32", "env-write"], ["the spec says TF32 and sets it"], quiet)
    record_allowances(target, c, ["env-write"], ["reworded"], quiet)  # replaces the earlier entry
    allowed = Contract.load(target, OP).allowed
    assert [(a["rule"], a["why"]) for a in allowed] == [("numeric-tf32", "the spec says TF32 and sets it"),
                                                       ("env-write", "reworded")]
    assert "ALLOWED: guard rule env-write" in quiet.file.getvalue()


def test_every_rule_has_its_section_in_guard_md():
    doc = (ROOT / "docs" / "GUARD.md").read_text()
    headings = {line[3:].split(" ")[0] for line in doc.splitlines() if line.startswith("## ")}
    assert set(catalogue.RULES) <= headings, set(catalogue.RULES) - headings
    assert "## Dynamic probes" in doc.splitlines()


def test_old_contracts_load_without_allowances():
    data = {"op": "x", "import_path": "p.x", "func_name": "x", "entry_file": "p/x.py", "signature": "x()",
            "parameters": [], "base_ref": "HEAD", "base_commit": "0" * 40, "test_file": "t.py", "frozen": []}
    assert Contract.from_dict(data).allowed == []


# -- the CLI --------------------------------------------------------------------------------------

def test_cli_exit_codes_json_table_and_a_recorded_allowance(arepo, tmp_path):
    repo = fresh_copy(arepo, tmp_path / "r")
    Planted(repo, CHEATS["tf32-flag-in-op-module"].edits).__enter__()
    line = next(i for i, s in enumerate((repo / CHUNK).read_text().splitlines(), 1) if MARK in s)
    r = flaloop(repo, "audit", OP, "--json")
    assert r.code == 1, r.stderr
    doc = r.json
    assert doc["blocked"] and doc["counts"]["block"] == 1
    (f,) = doc["findings"]
    assert (f["rule"], f["severity"], f["where"], f["blocking"]) == ("numeric-tf32", "block", f"{CHUNK}:{line}", True)
    human = flaloop(repo, "audit", OP)
    assert human.code == 1
    for text in ("numeric-tf32", f"{CHUNK}:{line}", "BLOCK", "TF32", "--allow numeric-tf32"):
        assert text in human.stdout, human.stdout

    contract_path = repo / "profile" / f"{OP}-opt" / "contract.json"
    before = contract_path.read_text()
    no_why = flaloop(repo, "audit", OP, "--allow", "numeric-tf32")
    assert no_why.code == 2 and "--why" in no_why.stderr
    unknown = flaloop(repo, "audit", OP, "--allow", "numeric-tf33", "--why", "x")
    assert unknown.code == 2 and "did you mean numeric-tf32" in unknown.stderr
    assert contract_path.read_text() == before  # nothing recorded by a refused allowance

    allowed = flaloop(repo, "audit", OP, "--allow", "numeric-tf32", "--why", "the spec asks for TF32 | on fp32", "--json")
    assert allowed.code == 0, allowed.stdout + allowed.stderr
    assert "ALLOWED: guard rule numeric-tf32" in allowed.stderr
    (f,) = allowed.json["findings"]
    assert f["allowed"] == "the spec asks for TF32 | on fp32" and not f["blocking"] and not allowed.json["blocked"]
    entry = json.loads(contract_path.read_text())["allowed"]
    assert [(e["rule"], e["why"]) for e in entry] == [("numeric-tf32", "the spec asks for TF32 | on fp32")]
    assert entry[0]["added"]
    draft = (repo / "profile" / f"{OP}-opt" / "docs" / "draft.md").read_text()
    assert "## Allowed guard exceptions" in draft and "`numeric-tf32` | the spec asks for TF32 \\| on fp32" in draft
    later = run_audit(repo)  # the contract's allowance applies from now on
    assert [(f.rule, f.allowed, f.blocking) for f in later.findings] == [
        ("numeric-tf32", "the spec asks for TF32 | on fp32", False)] and not later.blocked
