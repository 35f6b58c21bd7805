"""The guard's dynamic probes, run on every bench cell in both workers during the warm-up.

Each probe reports facts about this side; the session compares the two sides and turns
differences into findings (flaloop/guard/dynamic.py, docs/GUARD.md). The probes never run during
timing: they may patch allocators or wrap Triton's launcher, and undo it before returning.

  outputs      tensor subclasses, outputs sharing storage with inputs, values that change after
               the timed stream was synchronized (work deferred to another stream or thread)
  determinism  two calls on the same inputs, bit for bit or their largest relative difference
  poison       every allocation made during one call comes back NaN-filled (and, on a GPU, the
               allocator's free blocks too): outputs that stay non-finite were never written
  census       Triton launches, GPU kernels and library ops (GEMM, attention) of one call, how
               many streams the kernels ran on, and the kernels on streams other than the calling one
  numeric      torch backend flags, matmul precision, Triton's language knobs and the TRITON_*,
               FLA_*, TORCH_*, CUDA_* ... environment, after the first call
  l2           the persisting-L2 limit, the device's largest, and the current stream's access-policy
               window, each read on its own (GPU)
  graph        under the graph timer, the kernels one replay of the proven graph of k calls runs,
               per call, against the census's eager call: kernels launched outside the capture,
               or skipped while capturing, are missing from the replay (GPU)

The mutation probe (inputs changed in place, same pointers) is a variant of dump/compare: see
`BuiltCell.results_mutated`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import tempfile
import time

import torch

from .inputs import nonfinite
from .outputs import max_rel_diff, same_bits
from .timing import device_sync

ENV_PREFIXES = ('TRITON_', 'FLA_', 'TORCH_', 'PYTORCH_', 'CUDA_', 'NVIDIA_', 'CUBLAS', 'CUDNN', 'NCCL_', 'OMP_',
                'MKL_')
LIBRARY_OPS = {
    'aten::mm', 'aten::bmm', 'aten::matmul', 'aten::addmm', 'aten::baddbmm', 'aten::addbmm', 'aten::einsum',
    'aten::linear', 'aten::tensordot', 'aten::dot', 'aten::mv', 'aten::scaled_dot_product_attention',
    'aten::_scaled_dot_product_flash_attention', 'aten::_scaled_dot_product_efficient_attention',
    'aten::_scaled_dot_product_cudnn_attention', 'aten::_scaled_dot_product_attention_math',
    'aten::_flash_attention_forward', 'aten::_efficient_attention_forward',
}
LIBRARY_KERNEL = re.compile(r'gemm|cutlass|cublas|xmma|gemv|flash_fwd|flash_bwd|fmha|cudnn', re.I)
# A kernel compiled from the CuTe DSL is named `kernel_cutlass_kernel_` + its Python module's path
# without dots + its function or class (`kernel_cutlass_kernel_flashinfernormkernels...`). Such a
# kernel is the op's own unless that path is a library of CuTe DSL kernels (FlashAttention's
# `flash_attn.cute`, FlashInfer, QuACK); its own name ("...GemmKernel") says nothing.
CUTE_DSL_KERNEL = 'kernel_cutlass_kernel_'
CUTE_DSL_LIBRARY = re.compile(r'(_+main_+)?(flash_attncute|flashinfer|quack)', re.I)


def library_kernel(name: str) -> bool:
    """Whether a GPU kernel's name is a library's (cuBLAS, CUTLASS's prebuilt GEMMs, cuDNN, ...)."""
    if name.startswith(CUTE_DSL_KERNEL):
        return bool(CUTE_DSL_LIBRARY.match(name[len(CUTE_DSL_KERNEL):]))
    return bool(LIBRARY_KERNEL.search(name))


def _flags() -> dict:
    b = torch.backends
    probes = {
        'cuda.matmul.allow_tf32': lambda: b.cuda.matmul.allow_tf32,
        'cuda.matmul.allow_fp16_reduced_precision_reduction':
            lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        'cuda.matmul.allow_bf16_reduced_precision_reduction':
            lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        'cuda.matmul.fp32_precision': lambda: b.cuda.matmul.fp32_precision,
        'cudnn.allow_tf32': lambda: b.cudnn.allow_tf32,
        'cudnn.fp32_precision': lambda: b.cudnn.fp32_precision,
        'cudnn.benchmark': lambda: b.cudnn.benchmark,
        'cudnn.deterministic': lambda: b.cudnn.deterministic,
        'fp32_precision': lambda: b.fp32_precision,
        'float32_matmul_precision': torch.get_float32_matmul_precision,
        'deterministic_algorithms': torch.are_deterministic_algorithms_enabled,
        'default_dtype': lambda: str(torch.get_default_dtype()),
    }
    out = {}
    for name, read in probes.items():
        try:
            out[name] = str(read())
        except Exception:  # older or newer torch: the knob does not exist
            continue
    return out


def _triton_knobs() -> dict:
    import sys
    knobs = getattr(sys.modules.get('triton'), 'knobs', None)
    out = {}
    for ns in ('language', 'compilation', 'nvidia'):
        group = getattr(knobs, ns, None)
        try:
            items = group.knobs.items() if group is not None else ()
        except Exception:
            continue
        for k, v in items:
            if v is None or isinstance(v, (str, bool, int, float)):
                out[f'triton.knobs.{ns}.{k}'] = str(v)
    return out


def numeric_settings() -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    return {'flags': _flags(), 'triton': _triton_knobs(), 'env': env}


def outputs(cell) -> dict:
    """Subclasses, aliasing of inputs, and values that change once every stream has finished."""
    s = cell.sets[0]
    out = cell.call(s)
    named = cell.named(s, out)
    subclass = sorted(n for n, t in named.items() if type(t) not in (torch.Tensor, torch.nn.Parameter))
    in_storages = {t.untyped_storage().data_ptr() for t in s.tensors() if t.numel()}
    aliases = sorted(n for n, t in named.items() if t.numel() and t.untyped_storage().data_ptr() in in_storages)
    if cell.is_cuda:
        torch.cuda.current_stream().synchronize()  # what the timer waits for, and no more
    first = {n: t.detach().clone() for n, t in named.items()}
    time.sleep(0.2)  # a thread that finishes the output later has had time to (a loaded CPU included)
    if cell.is_cuda:
        device_sync()
    later = {n: t.detach() for n, t in named.items()}
    changed = sorted(n for n in first if not same_bits(first[n], later[n]))
    del out, named
    return {'subclass': subclass, 'aliases_input': aliases, 'changed_after_sync': changed}


def determinism(cell) -> dict:
    s = cell.sets[0]
    a = {n: t.clone() for n, t in cell.results(s).items()}
    b = cell.results(s)
    bitwise = set(a) == set(b) and all(same_bits(a[n], b[n]) for n in a)
    return {'bitwise': bitwise, 'max_rel_diff': 0.0 if bitwise else max_rel_diff(a, b)}


@contextlib.contextmanager
def _poisoned_allocations(cell):
    """NaN-fill every float tensor allocated through torch's Python allocators while active; on a GPU
    first leave NaN in the caching allocator's free blocks, which later allocations reuse."""
    def poison(t):
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            with torch.no_grad():
                t.fill_(float('nan'))
        return t

    if cell.is_cuda:
        try:
            free, _ = torch.cuda.mem_get_info()
            n = int(min(free // 2, max(4 * cell.set_bytes, 64 << 20)))
            blob = torch.empty(n // 4, dtype=torch.float32, device=cell.device).fill_(float('nan'))
            del blob
        except Exception:
            pass
    saved = {name: getattr(torch, name) for name in ('empty', 'empty_like', 'empty_strided')}
    had_new_empty = 'new_empty' in vars(torch.Tensor)
    real_new_empty = torch.Tensor.new_empty

    def wrap(fn):
        def poisoned(*args, **kwargs):
            return poison(fn(*args, **kwargs))
        return poisoned

    try:
        for name, fn in saved.items():
            setattr(torch, name, wrap(fn))
        torch.Tensor.new_empty = wrap(real_new_empty)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
        if had_new_empty:
            torch.Tensor.new_empty = real_new_empty
        else:
            del torch.Tensor.new_empty


def poison(cell) -> dict:
    s = cell.sets[0]
    with _poisoned_allocations(cell):
        res = cell.results(s)
    return {'nonfinite': {n: nonfinite(t) for n, t in res.items()}}


@contextlib.contextmanager
def _count_triton_launches(counts: dict):
    """Wrap the launchers of Triton's JIT and interpreter (class level, undone on exit)."""
    import sys
    classes = []
    for modname, clsname in (('triton.runtime.jit', 'JITFunction'), ('triton.runtime.interpreter', 'InterpretedFunction')):
        cls = getattr(sys.modules.get(modname), clsname, None)
        if cls is not None and 'run' in vars(cls):
            classes.append(cls)
    saved = {cls: vars(cls)['run'] for cls in classes}

    def wrap(run):
        def counted(self, *args, **kwargs):
            if not kwargs.get('warmup'):
                name = getattr(getattr(self, 'fn', None), '__name__', None) or repr(self)
                counts[name] = counts.get(name, 0) + 1
            return run(self, *args, **kwargs)
        return counted

    try:
        for cls, run in saved.items():
            cls.run = wrap(run)
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run


def _kernel_events(fn) -> list[dict]:
    """The GPU kernels `fn` ran, as the profiler's Kineto trace records them."""
    from torch.autograd.profiler import profile

    with tempfile.TemporaryDirectory(prefix='flaloop-census-') as tmp:
        trace = os.path.join(tmp, 'trace.json')
        with profile(use_cpu=True, use_device='cuda', use_kineto=True) as prof:
            fn()
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f).get('traceEvents', [])
    return [e for e in events if e.get('cat') == 'kernel']


def graph_census(cell) -> dict:
    """Kernels per call of one replay of the cell's proven graph (k calls), by name, beside the
    eager call's (one call on set 0, as `census` sees it)."""
    if not cell.is_cuda or cell.timer != 'cuda_graph' or cell.graph is None:
        return {'checked': False, 'why': 'no CUDA graph (eager or CPU timer)'}
    eager: dict = {}
    for e in _kernel_events(lambda: cell.results(cell.sets[0])):
        eager[e.get('name', '')] = eager.get(e.get('name', ''), 0) + 1

    def replay():
        from .timing import replay as run_graph
        run_graph(cell.graph)
        device_sync()

    replayed: dict = {}
    for e in _kernel_events(replay):
        replayed[e.get('name', '')] = replayed.get(e.get('name', ''), 0) + 1
    k = max(1, int(cell.k or 1))
    missing = {n: c for n, c in eager.items() if replayed.get(n, 0) < c * k}
    return {'checked': True, 'k': k, 'eager': eager, 'replay_per_call': {n: c / k for n, c in replayed.items()},
            'missing': missing}


# A kernel of a known name launched on the calling stream just before the call: the stream its
# trace event names is the one the timer's events are recorded on, so that kernels on any other
# stream are side work, however many streams there are (a plant that moves every kernel of the op
# onto one new stream runs on one stream, as the base does).
MARKER_KERNEL = 'spin_kernel'


def _mark_calling_stream(cell) -> bool:
    sleep = getattr(torch.cuda, '_sleep', None)
    if not cell.is_cuda or sleep is None:
        return False
    sleep(1)
    return True


def census(cell) -> dict:
    # The autograd profiler that torch.profiler.profile wraps, the same Kineto trace: the wrapper's
    # first start imports torch._inductor (for a cudagraphs setting), 1.2-2 s on a 2-core CPU in a
    # process whose op had not imported it, against 2 ms here.
    from torch.autograd.profiler import profile

    s = cell.sets[0]
    launches: dict = {}
    with tempfile.TemporaryDirectory(prefix='flaloop-census-') as tmp:
        trace = os.path.join(tmp, 'trace.json')
        with _count_triton_launches(launches), profile(use_cpu=True, use_device='cuda' if cell.is_cuda else None,
                                                       use_kineto=True) as prof:
            marked = _mark_calling_stream(cell)
            cell.results(s)
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f).get('traceEvents', [])
    return census_of(events, launches, marked)


def census_of(events: list[dict], launches: dict, marked: bool) -> dict:
    """The census's counts from one call's trace events; with `marked`, the first kernel named
    MARKER_KERNEL is the calling stream's marker, left out of the counts. Without the marker, the
    calling stream is the stream of the first kernel by start time."""
    ops: dict = {}
    kernels: dict = {}
    streams: dict = {}  # stream -> kernels
    calling = None
    for e in sorted(events, key=lambda e: e.get('ts') or 0):
        cat, name = e.get('cat'), e.get('name', '')
        if cat == 'kernel':
            stream = (e.get('args') or {}).get('stream')
            if marked and calling is None and MARKER_KERNEL in name:
                calling = stream
                continue
            kernels[name] = kernels.get(name, 0) + 1
            if stream is not None:
                streams[stream] = streams.get(stream, 0) + 1
                if calling is None and not marked:
                    calling = stream
        elif cat == 'cpu_op' and name in LIBRARY_OPS:
            ops[name] = ops.get(name, 0) + 1
    library_kernels = {k: n for k, n in kernels.items() if library_kernel(k)}
    own_kernels = sum(n for k, n in kernels.items() if k not in library_kernels)
    side = {str(st): n for st, n in streams.items() if calling is not None and st != calling}
    return {'triton_launches': launches, 'library_ops': ops, 'kernels': kernels, 'library_kernels': library_kernels,
            'own_gpu_kernels': own_kernels, 'n_streams': len(streams),
            'calling_stream': calling, 'calling_stream_by': 'marker' if marked and calling is not None else 'first kernel',
            'side_stream_kernels': side}


# -- persisting L2 (GPU): read through the CUDA runtime the process already loaded -------------------

class _AccessPolicyWindow(ctypes.Structure):
    _fields_ = [('base_ptr', ctypes.c_void_p), ('num_bytes', ctypes.c_size_t), ('hitRatio', ctypes.c_float),
                ('hitProp', ctypes.c_int), ('missProp', ctypes.c_int)]


class _StreamAttrValue(ctypes.Union):
    _fields_ = [('accessPolicyWindow', _AccessPolicyWindow), ('pad', ctypes.c_char * 64)]


CUDA_LIMIT_PERSISTING_L2 = 0x06
CUDA_STREAM_ATTR_ACCESS_POLICY_WINDOW = 1


CUDA_DEV_ATTR_MAX_PERSISTING_L2 = 108


def _cudart():
    with open('/proc/self/maps') as f:
        paths = {line.split()[-1] for line in f if 'libcudart' in line}
    for p in sorted(paths):
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    return None


def l2_persisting(cell) -> dict:
    """The persisting-L2 limit, the device's largest one and the current stream's access-policy
    window, each read on its own: a read the runtime refuses (the window of a legacy default
    stream, say) leaves the others judged. A value whose read failed is None."""
    if not cell.is_cuda:
        return {'checked': False, 'why': 'no GPU'}
    rt = _cudart()
    if rt is None:
        return {'checked': False, 'why': 'libcudart is not loaded in this process'}
    # prototypes, so that size_t and pointers cross as 64-bit values
    rt.cudaDeviceGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    rt.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    rt.cudaStreamGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    rt.cudaGetLastError.argtypes = []
    limit, max_size, value = ctypes.c_size_t(0), ctypes.c_int(0), _StreamAttrValue()
    errors = {
        'limit': rt.cudaDeviceGetLimit(ctypes.byref(limit), CUDA_LIMIT_PERSISTING_L2),
        'max': rt.cudaDeviceGetAttribute(ctypes.byref(max_size), CUDA_DEV_ATTR_MAX_PERSISTING_L2,
                                         torch.cuda.current_device()),
        'window': rt.cudaStreamGetAttribute(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                                            CUDA_STREAM_ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(value)),
    }
    if any(errors.values()):
        rt.cudaGetLastError()  # a refused read must not stay the thread's last error for torch to find
    bad = {k: e for k, e in errors.items() if e}
    return {'checked': not errors['limit'] or not errors['window'],
            'why': ', '.join(f'{k}: cuda error {e}' for k, e in bad.items()),
            'errors': errors,
            'persisting_limit_bytes': None if errors['limit'] else int(limit.value),
            'max_persisting_bytes': None if errors['max'] else int(max_size.value),
            'window_bytes': None if errors['window'] else int(value.accessPolicyWindow.num_bytes)}


def run_all(cell) -> dict:
    """Every probe on this cell, each timed; a probe that raises reports its error instead."""
    out, seconds = {}, {}
    for name, fn in (('outputs', outputs), ('determinism', determinism), ('poison', poison),
                     ('census', census), ('l2', l2_persisting), ('graph', graph_census)):
        t0 = time.perf_counter()
        try:
            out[name] = fn(cell)
        except Exception as e:  # noqa: BLE001 - a probe must not take the cell down
            out[name] = {'error': f'{type(e).__name__}: {e}'[:500]}
        seconds[name] = round(time.perf_counter() - t0, 4)
    out['numeric'] = numeric_settings()
    out['seconds'] = seconds
    return out
