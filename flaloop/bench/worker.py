"""flaloop benchmark worker: one long-lived process per side (base or candidate).

Run as a script, in the *target's* interpreter (never imported by the orchestrator)::

    PY -u worker.py --tree TREE --registry REGISTRY_FILE --op OPNAME --side base|cand
                    [--device cuda|cpu] [--workdir DIR] [--backend NAME]

Only the standard library and torch are imported here (triton only indirectly, through the op),
because the target's interpreter need not have flaloop installed.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout.  The real stdout
is reserved for replies: at start its fd is duplicated for the protocol and fd 1 / ``sys.stdout``
are pointed at stderr, so prints from the op, Triton or CUDA cannot corrupt the stream.  The
orchestrator must drain stderr.

Request: ``{"cmd": NAME, "id": ANY (optional, echoed), ...}``.
Reply:   ``{"ok": true, "cmd": NAME, "id": ..., ...}`` or
         ``{"ok": false, "cmd": NAME, "id": ..., "error": "short message", "traceback": "..."}``;
         an error that means "this cell cannot run here" starts with ``"skip:"`` (and ``"skip": true``).
Floats that are NaN or infinite are sent as ``null`` (strict JSON).  EOF on stdin or ``quit``
exits 0.  An exception in one command never kills the worker.

Commands (see ``Worker.cmd_*``): hello, setup, sample, eager, dump, compare, release, quit.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback

# torch is imported in main() (after the protocol fd is secured), never at import time.
torch = None
F = None

VALID_OVERRIDES = ('identity', 'l2norm', 'logsigmoid', 'sigmoid')
VALID_DTYPES = ('bfloat16', 'float16', 'float32')
VALID_MODES = ('fwd', 'fwdbwd')
VALID_TIMERS = ('auto', 'eager')
REGISTRY_MODULE_NAME = '_flaloop_target_registry'

DEFAULT_WARMUP = 5            # eager calls before anything is timed (Triton compile + autotune)
DEFAULT_MIN_SAMPLE_MS = 2.0   # calibrated k makes one sample last at least this long
MAX_K = 256
MAX_SETS_CUDA = 4
GRAPH_PROOF_TOL = 1e-3        # graph replay vs eager, relative RMS
FLUSH_MIN_BYTES = 256 << 20


class Skip(Exception):
    """The cell cannot run for this op (constraint, no backward, no varlen): reply error 'skip: ...'."""


class InitError(Exception):
    """The worker could not import its registry/op; every command but quit answers with this."""

    def __init__(self, msg: str, tb: str):
        super().__init__(msg)
        self.tb = tb


class GraphProofError(Exception):
    """The captured CUDA graph does not reproduce the eager results."""


# ---------------------------------------------------------------------------
# protocol plumbing
# ---------------------------------------------------------------------------


def _claim_stdout():
    """Reserve the real stdout for protocol lines; send fd 1 and sys.stdout to stderr."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(proto_fd, 'w', encoding='utf-8', buffering=1)


def _jsonable(obj):
    """Strict-JSON copy of obj: NaN/inf floats -> None, tuples -> lists, unknown -> str."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    try:  # numpy / torch scalars
        return _jsonable(obj.item())
    except Exception:
        return str(obj)


def _send(out, obj) -> None:
    out.write(json.dumps(_jsonable(obj), allow_nan=False, separators=(',', ':')) + '\n')
    out.flush()


def _short_error(exc: BaseException, limit: int = 1000) -> str:
    msg = f'{type(exc).__name__}: {exc}'
    return msg if len(msg) <= limit else msg[: limit - 3] + '...'


# ---------------------------------------------------------------------------
# imports of the target
# ---------------------------------------------------------------------------


def _import_torch() -> None:
    global torch, F
    import torch as _torch
    import torch.nn.functional as _F
    torch, F = _torch, _F


def _drop_script_dir_from_sys_path() -> None:
    """Running by path puts flaloop/bench/ first on sys.path; it must not shadow the target's modules."""
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if not (p and os.path.realpath(p) == here)]


def _dotted_name(path: str, tree: str) -> str | None:
    rel = os.path.relpath(path, tree)
    if rel.startswith('..') or not rel.endswith('.py'):
        return None
    return rel[:-3].replace(os.sep, '.')


def _load_registry(path: str, tree: str):
    """Import the registry file under a private module name (fallback: as a package module of TREE)."""
    spec = importlib.util.spec_from_file_location(REGISTRY_MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f'cannot load registry from {path}')
    mod = importlib.util.module_from_spec(spec)
    sys.modules[REGISTRY_MODULE_NAME] = mod  # dataclasses look their module up in sys.modules
    try:
        spec.loader.exec_module(mod)
        return mod
    except ImportError:
        sys.modules.pop(REGISTRY_MODULE_NAME, None)
        dotted = _dotted_name(path, tree)
        if dotted is None:
            raise
        return importlib.import_module(dotted)  # e.g. relative imports inside the registry


def _apply_backend_env(cfg, backend: str | None) -> str | None:
    """Mirror FLA's run.py: 'triton' turns every backend env off, another name turns its env on."""
    if not backend:
        return None
    envs = getattr(cfg, 'backend_env', None) or {}
    if backend == 'triton':
        for env in envs.values():
            os.environ[env] = '0'
        return 'triton (default path)'
    env = envs.get(backend)
    if env is None:
        raise ValueError(f"op {cfg.name!r} has no backend {backend!r}; known: {sorted(envs) + ['triton']}")
    os.environ[env] = '1'
    return f'{backend} ({env}=1)'


def _source_file(obj) -> str | None:
    """Real path of the file defining obj, looking through decorators (functools.wraps, torch.compiler.disable)."""
    candidates = []
    try:
        candidates.append(inspect.unwrap(obj))
    except Exception:
        pass
    orig = getattr(obj, '_torchdynamo_orig_callable', None)
    if orig is not None:
        candidates.append(orig)
    candidates.append(obj)
    for c in candidates:
        try:
            f = inspect.getsourcefile(c) or inspect.getfile(c)
        except TypeError:
            continue
        if f:
            return os.path.realpath(f)
    return None


def _signature(fn):
    try:
        return inspect.signature(fn)  # follows __wrapped__
    except (TypeError, ValueError):
        return None


def _index_dtype_for(param):
    """int32 when the parameter's annotation or default says so, else long (FLA's convention)."""
    default = param.default
    if torch is not None and isinstance(default, torch.Tensor):
        return default.dtype
    ann = param.annotation
    text = ann if isinstance(ann, str) else repr(ann)
    if 'IntTensor' in text or 'int32' in text:
        return torch.int32
    return torch.long


# ---------------------------------------------------------------------------
# tensor helpers
# ---------------------------------------------------------------------------


def _derive_seed(seed: int, set_index: int, salt: str = '') -> int:
    h = hashlib.sha256(f'flaloop:{int(seed)}:{int(set_index)}:{salt}'.encode()).digest()
    return int.from_bytes(h[:8], 'little') & ((1 << 63) - 1)


def _iter_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _iter_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _iter_tensors(x)


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _iter_tensors(obj))


def _nonfinite(t) -> int:
    if t.is_floating_point() or t.is_complex():
        return int((~torch.isfinite(t)).sum().item())
    return 0


def _apply_override(name: str, t):
    if name not in VALID_OVERRIDES:
        raise ValueError(f'unknown override {name!r}; valid: {list(VALID_OVERRIDES)}')
    if not t.is_floating_point():
        raise ValueError(f'override {name!r} needs a floating tensor, got {t.dtype}')
    if name == 'identity':
        return t
    if name == 'l2norm':
        return F.normalize(t.float(), p=2.0, dim=-1).to(t.dtype)
    if name == 'sigmoid':
        return t.sigmoid()
    return F.logsigmoid(t)


def _flatten_outputs(out, res: dict) -> None:
    """out0, out1, ... for the tensors of the output tuple (out{i}.{j} one level down)."""
    items = out if isinstance(out, (list, tuple)) else (out,)
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor):
            res[f'out{i}'] = x
        elif isinstance(x, (list, tuple)):
            for j, y in enumerate(x):
                if isinstance(y, torch.Tensor):
                    res[f'out{i}.{j}'] = y


def _diff_stats(a, b) -> tuple[float, float]:
    """(relative RMS error rms(a-b)/rms(b), max |a-b|) in fp32 over positions finite on both sides; 0/0 = 0."""
    a = a.detach().float()
    b = b.detach().float()
    if a.numel() == 0:
        return 0.0, 0.0
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not bool(fin.all()):
        a, b = a[fin], b[fin]
        if a.numel() == 0:
            return 0.0, 0.0
    d = a - b
    num = float(torch.linalg.vector_norm(d))
    den = float(torch.linalg.vector_norm(b))
    max_abs = float(d.abs().max())
    if num == 0.0:
        return 0.0, max_abs
    if den == 0.0:
        return math.inf, max_abs
    return num / den, max_abs


def _same_bits(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        both_nan = torch.isnan(a) & torch.isnan(b)
        return bool(((a == b) | both_nan).all())
    return bool(torch.equal(a, b))


# ---------------------------------------------------------------------------
# CUDA helpers (kept small and separate: untestable on CPU-only CI)
# ---------------------------------------------------------------------------


def _autotuners() -> dict:
    """Every Triton autotuner the loaded code defines at module level, by qualified name.

    Decorators nest (``@triton.heuristics`` over ``@triton.autotune``, ...): each module global is
    followed down its ``.fn`` chain to the Autotuner, if any.  Triton's own modules and torch's
    are skipped; nothing is imported here that was not loaded already.
    """
    at_mod = sys.modules.get('triton.runtime.autotuner')
    Autotuner = getattr(at_mod, 'Autotuner', None)
    KernelInterface = getattr(sys.modules.get('triton.runtime.jit'), 'KernelInterface', None)
    if Autotuner is None or KernelInterface is None:
        return {}
    found = {}
    for modname, mod in list(sys.modules.items()):
        if mod is None or modname.split('.')[0] in ('triton', 'torch'):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, obj in items:
            # Only Triton's own wrappers are followed: getattr on an arbitrary global (a lazy
            # module, a proxy) can import things or raise.
            o = obj
            try:
                for _ in range(6):
                    if isinstance(o, Autotuner):
                        found.setdefault(f'{modname}.{attr}', o)
                        break
                    if not isinstance(o, KernelInterface):
                        break
                    o = getattr(o, 'fn', None)
            except Exception:
                continue
    return found


def tuning_snapshot() -> dict:
    """{kernel: {tuning key: chosen config}} for every autotuner that has chosen something."""
    snap = {}
    for name, tuner in _autotuners().items():
        cache = getattr(tuner, 'cache', None) or {}
        if cache:
            snap[name] = {repr(key): str(cfg) for key, cfg in list(cache.items())}
    return snap


def tuning_added(before: dict, after: dict) -> dict:
    """The (kernel, key) choices present in `after` but not in `before`."""
    out = {}
    for name, choices in after.items():
        new = {k: v for k, v in choices.items() if k not in before.get(name, {})}
        if new:
            out[name] = new
    return out


def _cuda_time_ms(fn) -> float:
    """Device ms of fn() between two CUDA events on the current stream."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def _side_stream_warmup(fn) -> None:
    """torch.cuda.graph docs: warm up on a side stream before capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------
# one input set and one cell
# ---------------------------------------------------------------------------


class InputSet:
    __slots__ = ('index', 'gen', 'kwargs', 'leaves', 'do', 'nbytes')

    def __init__(self, index, gen, kwargs, leaves):
        self.index = index
        self.gen = gen
        self.kwargs = kwargs          # everything passed to fn(**kwargs)
        self.leaves = leaves          # [(name, leaf tensor requiring grad)]
        self.do = None                # upstream gradient (fwdbwd)
        self.nbytes = 0


class Cell:
    def __init__(self, worker: Worker, spec: dict):
        self.w = worker
        self.cfg = worker.cfg
        self.fn = worker.fn
        self.device = worker.device
        self.is_cuda = self.device.type == 'cuda'
        if not isinstance(spec, dict):
            raise ValueError('setup needs "cell": {...}')
        self.id = str(spec['id'])
        self.mode = spec.get('mode', 'fwd')
        if self.mode not in VALID_MODES:
            raise ValueError(f'mode must be one of {list(VALID_MODES)}, got {self.mode!r}')
        dtype_name = spec.get('dtype', 'bfloat16')
        if dtype_name not in VALID_DTYPES:
            raise ValueError(f'dtype must be one of {list(VALID_DTYPES)}, got {dtype_name!r}')
        self.dtype = getattr(torch, dtype_name)
        self.seed = int(spec.get('seed', 0))
        self.overrides = dict(spec.get('overrides') or {})
        self.timer_req = spec.get('timer', 'auto')
        if self.timer_req not in VALID_TIMERS:
            raise ValueError(f'timer must be one of {list(VALID_TIMERS)}, got {self.timer_req!r}')
        self.min_sample_ms = float(spec.get('min_sample_ms') or DEFAULT_MIN_SAMPLE_MS)
        self.warmup = int(spec.get('warmup') or DEFAULT_WARMUP)
        self.k = spec.get('k')
        self.n_sets_req = spec.get('n_sets')
        self.seqlens = spec.get('seqlens')
        self.shape = dict(spec.get('shape') or {})

        self.sets: list[InputSet] = []
        self.n_sets = 1
        self.set_bytes = 0
        self.timer = None
        self.graph = None
        self.static = None
        self.capture_error = None
        self.graph_bitwise_equal = None
        self.per_call_ms_estimate = None
        self.extra_kwarg_names: list[str] = []

    # -- building -----------------------------------------------------------------------------------

    def _check(self):
        cfg = self.cfg
        if self.mode == 'fwdbwd' and getattr(cfg, 'skip_backward', False):
            raise Skip(f'op {cfg.name!r} has skip_backward=True (no fwdbwd)')
        for name in self.overrides:
            if name not in cfg.inputs:
                raise ValueError(f'override for unknown input {name!r}; inputs: {list(cfg.inputs)}')
        for name, tname in self.overrides.items():
            if tname not in VALID_OVERRIDES:
                raise ValueError(f'unknown override {tname!r} for {name!r}; valid: {list(VALID_OVERRIDES)}')
        if self.seqlens is not None:
            seqlens = [int(x) for x in self.seqlens]
            if not seqlens or any(x <= 0 for x in seqlens):
                raise ValueError(f'seqlens must be positive ints, got {self.seqlens!r}')
            sig = _signature(self.fn)
            if sig is None or 'cu_seqlens' not in sig.parameters:
                raise Skip('op takes no cu_seqlens')
            if self.shape.get('B', 1) != 1:
                raise ValueError(f"varlen (seqlens) needs B == 1, got B={self.shape.get('B')}")
            total = sum(seqlens)
            if self.shape.get('T') not in (None, total):
                raise ValueError(f"T={self.shape['T']} != sum(seqlens)={total}")
            self.seqlens = seqlens
            self.shape['B'] = 1
            self.shape['T'] = total
        for dim in ('B', 'T', 'H', 'D'):
            if dim not in self.shape:
                raise ValueError(f'shape lacks {dim!r}: {self.shape}')
        constraints = getattr(cfg, 'dim_constraints', None)
        if constraints:
            for dim, allowed in constraints.items():
                val = self.shape.get(dim)
                if val is not None and val not in allowed:
                    raise Skip(f'op {cfg.name!r} requires {dim} in {list(allowed)}, got {val}')

    def _dims(self):
        s = self.shape
        extra = {k: v for k, v in s.items() if k not in ('B', 'T', 'H', 'D')}
        return s['B'], s['T'], s['H'], s['D'], extra

    def _tensor_dtype(self, name: str):
        if name == 'default':
            return self.dtype
        if name == 'long':
            return torch.long
        dt = getattr(torch, str(name), None)
        return dt if isinstance(dt, torch.dtype) else self.dtype

    def _varlen_kwargs(self) -> dict:
        if self.seqlens is None:
            return {}
        sig = _signature(self.fn)
        params = sig.parameters
        offsets = [0]
        for n in self.seqlens:
            offsets.append(offsets[-1] + n)
        kw = {'cu_seqlens': torch.tensor(offsets, dtype=_index_dtype_for(params['cu_seqlens']), device=self.device)}
        if 'cu_seqlens_cpu' in params:  # lets FLA skip a device->host sync (and so be graph-capturable)
            kw['cu_seqlens_cpu'] = torch.tensor(offsets, dtype=_index_dtype_for(params['cu_seqlens_cpu']))
        return kw

    def _make_set(self, index: int, varlen_kw: dict) -> InputSet:
        cfg = self.cfg
        B, T, H, D, extra = self._dims()
        gen = torch.Generator(device=self.device)
        gen.manual_seed(_derive_seed(self.seed, index))
        inputs = {}
        for name, spec in cfg.inputs.items():
            shape = tuple(int(x) for x in spec.shape_fn(B, T, H, D, **extra))
            dt = self._tensor_dtype(spec.dtype)
            if dt == torch.long:
                t = torch.randint(0, 10, shape, dtype=torch.long, device=self.device, generator=gen)
            else:
                t = torch.randn(shape, dtype=dt, device=self.device, generator=gen)
            ov = self.overrides.get(name)
            if ov is not None:
                t = _apply_override(ov, t)
            elif spec.transform is not None:
                t = spec.transform(t)
            if spec.requires_grad and t.is_floating_point():
                t = t.requires_grad_(True)
            inputs[name] = t
        if cfg.post_init is not None:
            torch.manual_seed(_derive_seed(self.seed, index, 'post_init'))  # post_init may use the global RNG
            cfg.post_init(inputs, B=B, T=T, H=H, D=D, **extra)
        kwargs = {**inputs, **(cfg.extra_kwargs or {}), **varlen_kw}
        leaves = []
        for name, v in inputs.items():
            items = [(name, v)] if isinstance(v, torch.Tensor) else (
                [(f'{name}.{i}', x) for i, x in enumerate(v)] if isinstance(v, (list, tuple)) else [])
            for lname, x in items:
                if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf and x.is_floating_point():
                    leaves.append((lname, x))
        return InputSet(index, gen, kwargs, leaves)

    def _add_do(self, s: InputSet) -> None:
        out = self.fn(**s.kwargs)
        t = out[0] if self.cfg.output_is_tuple else out
        if not isinstance(t, torch.Tensor):
            raise TypeError(f'output used for backward is {type(t).__name__}, not a tensor')
        s.do = torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=s.gen)
        for _, leaf in s.leaves:
            leaf.grad = None

    def _finish_set(self, s: InputSet) -> None:
        if self.mode == 'fwdbwd':
            self._add_do(s)
        s.nbytes = _nbytes(s.kwargs) + (_nbytes(s.do) if s.do is not None else 0)

    def build(self) -> dict:
        t_setup = time.perf_counter()
        self._check()
        varlen_kw = self._varlen_kwargs()
        self.extra_kwarg_names = sorted(varlen_kw)
        first = self._make_set(0, varlen_kw)
        self._finish_set(first)
        self.set_bytes = first.nbytes
        self.n_sets = self._choose_n_sets()
        self.sets = [first]
        for i in range(1, self.n_sets):
            s = self._make_set(i, varlen_kw)
            self._finish_set(s)
            self.sets.append(s)

        t0 = time.perf_counter()
        tuned_before = tuning_snapshot()
        for i in range(max(self.warmup, self.n_sets)):
            self.call(self.sets[i % self.n_sets])
        self._sync()
        warmup_s = time.perf_counter() - t0
        # What Triton's autotuners chose during this cell's first calls: the session compares
        # the two sides, since a different pick on an unchanged kernel is noise, not a win.
        self.tuning = tuning_added(tuned_before, tuning_snapshot())

        nonfinite = {name: _nonfinite(t) for name, t in self.results(self.sets[0]).items()}

        if self.k is not None:
            self.k = int(self.k)
            if self.k < 1:
                raise ValueError(f'k must be >= 1, got {self.k}')
        if not self.is_cuda:
            self.timer = 'cpu'
        elif self.timer_req == 'eager':
            self.timer = 'cuda_eager'
        else:
            self.timer = self._try_graph()  # calibrates k (graph or eager) when None
        if self.k is None:
            self._calibrate_k_eager()

        return {
            'cell': self.id,
            'timer': self.timer,
            'k': self.k,
            'n_sets': self.n_sets,
            'set_bytes': self.set_bytes,
            'nonfinite': nonfinite,
            'capture_error': self.capture_error,
            'graph_bitwise_equal': self.graph_bitwise_equal,
            'warmup_s': warmup_s,
            'setup_s': time.perf_counter() - t_setup,
            'mode': self.mode,
            'dtype': str(self.dtype).replace('torch.', ''),
            'shape': self.shape,
            'per_call_ms_estimate': self.per_call_ms_estimate,
            'extra_kwargs': self.extra_kwarg_names,
            'tuning': self.tuning,
        }

    def _choose_n_sets(self) -> int:
        if self.n_sets_req is not None:
            n = int(self.n_sets_req)
            if n < 1:
                raise ValueError(f'n_sets must be >= 1, got {n}')
            return n
        if not self.is_cuda:
            return 1
        l2 = self.w.l2_bytes or 0
        return int(min(max(math.ceil(2 * l2 / max(self.set_bytes, 1)), 1), MAX_SETS_CUDA))

    # -- calling --------------------------------------------------------------------------------------

    def call(self, s: InputSet):
        if self.mode == 'fwd':
            with torch.no_grad():
                return self.fn(**s.kwargs)
        for _, leaf in s.leaves:
            leaf.grad = None
        out = self.fn(**s.kwargs)
        t = out[0] if self.cfg.output_is_tuple else out
        t.backward(s.do)
        return out

    def named(self, s: InputSet, out) -> dict:
        res = {}
        _flatten_outputs(out, res)
        if self.mode == 'fwdbwd':
            for name, leaf in s.leaves:
                if leaf.grad is not None:
                    res[f'grad_{name}'] = leaf.grad
        return res

    def results(self, s: InputSet) -> dict:
        """Outputs (and grads) of one eager call on s, detached."""
        out = self.call(s)
        self._sync()
        return {k: v.detach() for k, v in self.named(s, out).items()}

    def calls(self, m: int) -> None:
        """m eager calls, call j on set j % n_sets."""
        n = self.n_sets
        for j in range(m):
            self.call(self.sets[j % n])

    def k_calls(self) -> None:
        self.calls(self.k)

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def _set_k(self, per_call_ms: float) -> None:
        self.per_call_ms_estimate = per_call_ms
        k = math.ceil(self.min_sample_ms / max(per_call_ms, 1e-6))
        self.k = int(min(max(k, 1), MAX_K))

    def _calibrate_k_eager(self) -> None:
        self._set_k(self._estimate_per_call_ms())

    def _estimate_per_call_ms(self) -> float:
        m = max(self.n_sets, 2)

        def run():
            self.calls(m)

        times = []
        for _ in range(3):
            if self.is_cuda:
                times.append(_cuda_time_ms(run) / m)
            else:
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e3 / m)
        return sorted(times)[1]

    # -- CUDA graph -------------------------------------------------------------------------------------

    def _try_graph(self) -> str:
        """Capture and prove a CUDA graph; on any failure fall back to the eager timer (capture_error set)."""
        try:
            if self.k is None:
                self._calibrate_k_with_graph()
            graph, static = self._capture(self.k)
            self.graph_bitwise_equal = self._prove(graph, static)
            self.graph, self.static = graph, static
            return 'cuda_graph'
        except Exception as e:
            self.capture_error = _short_error(e)
            self.w.log(f'[flaloop worker] cell {self.id}: CUDA graph unusable, eager timer:\n'
                       f'{traceback.format_exc()}')
        # outside the except block, so the traceback no longer pins the capture's tensors
        graph = static = None
        for s in self.sets:
            for _, leaf in s.leaves:
                leaf.grad = None
        gc.collect()
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:
            pass
        # eager must still work after the failed capture (raises if the context is broken)
        self.results(self.sets[0])
        if self.k is None:
            self._calibrate_k_eager()
        return 'cuda_eager'

    def _calibrate_k_with_graph(self) -> None:
        """k from the device time of a probe graph of n_sets calls (eager timing would be host-bound)."""
        probe, probe_static = self._capture(self.n_sets)
        times = []
        for _ in range(3):
            self.w.flush_l2()
            times.append(_cuda_time_ms(probe.replay) / self.n_sets)
        del probe, probe_static
        self._set_k(sorted(times)[1])

    def _capture(self, m: int):
        """Capture m calls (cycling sets) into one CUDAGraph.

        Keeps the outputs (and grads) of the last captured call on each set as the static tensors
        the proof checks; the pool memory of earlier calls is recycled within the capture.
        """
        n = self.n_sets
        _side_stream_warmup(lambda: self.calls(max(3, n)))
        graph = torch.cuda.CUDAGraph()
        static: dict[int, dict] = {}
        with torch.cuda.graph(graph):
            for j in range(m):
                s = self.sets[j % n]
                static.pop(s.index, None)
                out = self.call(s)  # fwdbwd: leaf.grad=None first, so backward allocates from the graph pool
                # detached: holding `out` itself would keep its autograd graph (and the leaves'
                # AccumulateGrad nodes, bound to the capture stream) alive into later eager calls
                static[s.index] = {k: v.detach() for k, v in self.named(s, out).items()}
                del out
        torch.cuda.synchronize()
        for s in self.sets:  # the grads stay referenced by `static`; drop the leaves' handles
            for _, leaf in s.leaves:
                leaf.grad = None
        return graph, static

    def _protected_storages(self) -> set:
        ptrs = set()
        for s in self.sets:
            for t in list(_iter_tensors(s.kwargs)) + ([s.do] if s.do is not None else []):
                ptrs.add(t.untyped_storage().data_ptr())
        return ptrs

    def _prove(self, graph, static) -> bool:
        """Poison the static outputs/grads with NaN, replay, and compare with eager calls on the same sets."""
        protected = self._protected_storages()
        with torch.no_grad():
            for d in static.values():
                for t in d.values():
                    if t.is_floating_point() and t.untyped_storage().data_ptr() not in protected:
                        t.detach().fill_(float('nan'))
        graph.replay()
        torch.cuda.synchronize()
        bitwise = True
        for index, d in static.items():
            eager = self.results(self.sets[index])
            if set(eager) != set(d):
                raise GraphProofError(f'set {index}: graph tensors {sorted(d)} != eager {sorted(eager)}')
            for name, g in d.items():
                e = eager[name]
                if g.shape != e.shape:
                    raise GraphProofError(f'set {index} {name}: shape {tuple(g.shape)} != eager {tuple(e.shape)}')
                if g.is_floating_point():
                    if not torch.equal(torch.isfinite(g), torch.isfinite(e)):
                        raise GraphProofError(
                            f'set {index} {name}: {_nonfinite(g)} nonfinite after replay vs {_nonfinite(e)} '
                            'eager (replay did not rewrite it?)')
                    err, _ = _diff_stats(g, e)
                    if err > GRAPH_PROOF_TOL:
                        raise GraphProofError(f'set {index} {name}: replay vs eager rel RMS {err:.3g}')
                elif not torch.equal(g, e):
                    raise GraphProofError(f'set {index} {name}: replay differs from eager')
                bitwise = bitwise and _same_bits(g.detach(), e)
        return bitwise

    # -- timing -------------------------------------------------------------------------------------------

    def sample(self) -> float:
        """Per-call ms of one sample (k calls)."""
        if not self.is_cuda:
            t0 = time.perf_counter()
            self.k_calls()
            return (time.perf_counter() - t0) * 1e3 / self.k
        self.w.flush_l2()  # outside the events
        fn = self.graph.replay if self.timer == 'cuda_graph' else self.k_calls
        return _cuda_time_ms(fn) / self.k

    def eager_sample(self) -> tuple[float, float]:
        """(host issue ms per call, wall ms per call) of k eager calls."""
        if self.is_cuda:
            self.w.flush_l2()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.k_calls()
        t1 = time.perf_counter()
        self._sync()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3 / self.k, (t2 - t0) * 1e3 / self.k

    def dump_tensors(self) -> dict:
        res = self.results(self.sets[0])
        return {name: t.detach().to('cpu', copy=True).contiguous() for name, t in res.items()}


# ---------------------------------------------------------------------------
# the worker
# ---------------------------------------------------------------------------


class Worker:
    def __init__(self, args):
        self.args = args
        self.side = args.side
        self.cells: dict[str, Cell] = {}
        self.init_error = None
        self.cfg = self.fn = self.mod = None
        self.device = None
        self.l2_bytes = None
        self.backend_note = None
        self._flush_buf = None
        try:
            self._init()
        except Exception as e:
            self.init_error = (_short_error(e), traceback.format_exc())
            self.log(f'[flaloop worker] init failed: {self.init_error[1]}')

    @staticmethod
    def log(msg: str) -> None:
        try:
            sys.stderr.write(msg.rstrip('\n') + '\n')
            sys.stderr.flush()
        except Exception:
            pass

    def _init(self) -> None:
        a = self.args
        self.tree = os.path.realpath(a.tree)
        self.registry_file = os.path.realpath(a.registry)
        if not os.path.isdir(self.tree):
            raise FileNotFoundError(f'tree {self.tree} is not a directory')
        if a.workdir:
            os.makedirs(a.workdir, exist_ok=True)
            os.chdir(a.workdir)
        sys.path.insert(0, self.tree)
        _import_torch()
        self.registry = _load_registry(self.registry_file, self.tree)
        self.cfg = self.registry.get_op(a.op)
        self.backend_note = _apply_backend_env(self.cfg, a.backend)
        dev = a.device or ('cuda' if torch.cuda.is_available() else 'cpu')
        if dev == 'cuda' and not torch.cuda.is_available():
            raise RuntimeError('--device cuda but torch.cuda.is_available() is False')
        self.device = torch.device(dev)
        if self.device.type == 'cuda':
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            self.l2_bytes = int(getattr(props, 'L2_cache_size', 0) or 0) or None
        self.mod = importlib.import_module(self.cfg.import_path)
        attr = self.cfg.func_name or self.cfg.name
        fn = getattr(self.mod, attr, None)
        if fn is None:
            public = [x for x in dir(self.mod) if not x.startswith('_')]
            raise ImportError(f'{attr!r} not in module {self.cfg.import_path!r}; available: {public}')
        self.fn = fn

    # -- dispatch ---------------------------------------------------------------------------------------

    def handle(self, cmd, req: dict) -> dict:
        method = getattr(self, f'cmd_{cmd}', None) if isinstance(cmd, str) else None
        if method is None:
            valid = sorted(m[4:] for m in dir(self) if m.startswith('cmd_')) + ['quit']
            raise ValueError(f'unknown cmd {cmd!r}; valid: {valid}')
        if self.init_error is not None:
            raise InitError(f'worker init failed: {self.init_error[0]}', self.init_error[1])
        return method(req)

    def after_error(self) -> None:
        gc.collect()
        if self.device is not None and self.device.type == 'cuda':
            try:
                torch.cuda.empty_cache()
            except Exception:
                pass

    def _cell(self, req: dict) -> Cell:
        cid = req.get('cell')
        if isinstance(cid, dict):
            cid = cid.get('id')
        cell = self.cells.get(str(cid))
        if cell is None:
            raise KeyError(f'unknown cell {cid!r}; set up: {sorted(self.cells)}')
        return cell

    def flush_l2(self) -> None:
        if self._flush_buf is None:
            n = max(2 * (self.l2_bytes or 0), FLUSH_MIN_BYTES)
            self._flush_buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._flush_buf.zero_()

    # -- commands ---------------------------------------------------------------------------------------

    def cmd_hello(self, req: dict) -> dict:
        dev = self.device
        if dev.type == 'cuda':
            idx = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            device_name = props.name
            uuid = getattr(props, 'uuid', None)
            device_uuid = str(uuid) if uuid is not None else None
        else:
            device_name = platform.processor() or platform.machine() or 'cpu'
            device_uuid = None
        return {
            'side': self.side,
            'op': self.cfg.name,
            'tree': self.tree,
            'registry': self.registry_file,
            'op_module_file': os.path.realpath(self.mod.__file__) if getattr(self.mod, '__file__', None) else None,
            'op_func_file': _source_file(self.fn),
            'python': sys.executable,
            'torch': torch.__version__,
            'triton': _triton_version(),
            'tilelang': _dist_version('tilelang'),
            'cutlass': _dist_version('nvidia-cutlass-dsl'),
            'device': dev.type,
            'device_name': device_name,
            'device_uuid': device_uuid,
            'l2_bytes': self.l2_bytes,
            'cuda_runtime': torch.version.cuda,
            'backend': self.backend_note,
            'pid': os.getpid(),
        }

    def cmd_setup(self, req: dict) -> dict:
        spec = req.get('cell')
        if not isinstance(spec, dict) or 'id' not in spec:
            raise ValueError('setup needs "cell": {"id": ..., "shape": {...}, ...}')
        cid = str(spec['id'])
        if cid in self.cells:
            self._release(cid)
        cell = Cell(self, spec)
        reply = cell.build()
        self.cells[cid] = cell
        return reply

    def cmd_sample(self, req: dict) -> dict:
        cell = self._cell(req)
        n = int(req.get('n', 1))
        return {'cell': cell.id, 'timer': cell.timer, 'k': cell.k, 'times_ms': [cell.sample() for _ in range(n)]}

    def cmd_eager(self, req: dict) -> dict:
        cell = self._cell(req)
        n = int(req.get('n', 1))
        host, wall = [], []
        for _ in range(n):
            h, w = cell.eager_sample()
            host.append(h)
            wall.append(w)
        return {'cell': cell.id, 'k': cell.k, 'host_ms': host, 'wall_ms': wall}

    def cmd_dump(self, req: dict) -> dict:
        cell = self._cell(req)
        path = req.get('path')
        if not path:
            raise ValueError('dump needs "path"')
        tensors = cell.dump_tensors()
        path = os.path.abspath(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f'{path}.tmp{os.getpid()}'
        torch.save(tensors, tmp)
        os.replace(tmp, path)
        return {
            'cell': cell.id,
            'path': path,
            'names': list(tensors),
            'shapes': {k: list(v.shape) for k, v in tensors.items()},
            'dtypes': {k: str(v.dtype).replace('torch.', '') for k, v in tensors.items()},
            'nonfinite': {k: _nonfinite(v) for k, v in tensors.items()},
        }

    def cmd_compare(self, req: dict) -> dict:
        cell = self._cell(req)
        path = req.get('ref')
        if not path:
            raise ValueError('compare needs "ref" (a dump file)')
        tol = float(req.get('tol', 1e-3))
        ref = torch.load(path, map_location='cpu', weights_only=True)
        if not isinstance(ref, dict):
            raise ValueError(f'{path} does not hold a dump dict')
        mine = {k: v.detach() for k, v in cell.results(cell.sets[0]).items()}
        names = list(mine) + [k for k in ref if k not in mine]
        tensors = {}
        match = True
        for name in names:
            a, b = mine.get(name), ref.get(name)
            entry = {
                'shape': list(a.shape) if a is not None else None,
                'shape_ref': list(b.shape) if isinstance(b, torch.Tensor) else None,
                'dtype': str(a.dtype).replace('torch.', '') if a is not None else None,
                'dtype_ref': str(b.dtype).replace('torch.', '') if isinstance(b, torch.Tensor) else None,
                'nonfinite_self': _nonfinite(a) if a is not None else None,
                'nonfinite_ref': _nonfinite(b) if isinstance(b, torch.Tensor) else None,
                'rel_rms': None,
                'max_abs': None,
                'missing': None,
            }
            if a is None:
                entry['missing'] = 'self'
            elif not isinstance(b, torch.Tensor):
                entry['missing'] = 'ref'
            elif tuple(a.shape) == tuple(b.shape):
                rel, mx = _diff_stats(a, b.to(a.device))
                entry['rel_rms'], entry['max_abs'] = rel, mx
            ok = (entry['missing'] is None and entry['shape'] == entry['shape_ref']
                  and entry['rel_rms'] is not None and entry['rel_rms'] <= tol
                  and entry['nonfinite_self'] == 0 and entry['nonfinite_ref'] == 0)
            entry['match'] = ok
            match = match and ok
            tensors[name] = entry
        return {'cell': cell.id, 'match': match, 'tol': tol, 'tensors': tensors}

    def _release(self, cid: str) -> bool:
        cell = self.cells.pop(cid, None)
        if cell is None:
            return False
        cell.graph = cell.static = None
        cell.sets = []
        del cell
        self.after_error()
        return True

    def cmd_release(self, req: dict) -> dict:
        cid = req.get('cell')
        if isinstance(cid, dict):
            cid = cid.get('id')
        return {'cell': cid, 'released': self._release(str(cid))}


def _dist_version(dist: str) -> str | None:
    """Installed version of a distribution, read from its metadata (never imported)."""
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


def _triton_version() -> str | None:
    mod = sys.modules.get('triton')
    v = getattr(mod, '__version__', None) if mod is not None else None
    if v:
        return str(v)
    try:
        from importlib.metadata import version
        return version('triton')
    except Exception:
        return None


# ---------------------------------------------------------------------------
# main loop
# ---------------------------------------------------------------------------


def _parse_args(argv):
    p = argparse.ArgumentParser(description='flaloop benchmark worker (JSON lines on stdin/stdout)')
    p.add_argument('--tree', required=True, help='source tree whose op is measured (put first on sys.path)')
    p.add_argument('--registry', required=True, help='path of the FLA-style registry.py')
    p.add_argument('--op', required=True, help='registry op name')
    p.add_argument('--side', required=True, choices=['base', 'cand'])
    p.add_argument('--device', choices=['cuda', 'cpu'], default=None, help='default: cuda when available')
    p.add_argument('--workdir', default=None, help='chdir here before importing the op')
    p.add_argument('--backend', default=None, help="op backend (OpConfig.backend_env key, or 'triton')")
    return p.parse_args(argv)


def serve(worker: Worker, stdin, proto) -> int:
    while True:
        line = stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        rid = cmd = None
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError('request is not a JSON object')
            rid, cmd = req.get('id'), req.get('cmd')
        except Exception as e:
            _send(proto, {'ok': False, 'error': f'bad request: {_short_error(e)}', 'traceback': ''})
            continue
        if cmd == 'quit':
            _send(proto, {'ok': True, 'cmd': 'quit', 'id': rid})
            return 0
        try:
            reply = {'ok': True, **worker.handle(cmd, req)}
        except Skip as e:
            reply = {'ok': False, 'skip': True, 'error': f'skip: {e}', 'traceback': traceback.format_exc()}
        except InitError as e:
            reply = {'ok': False, 'error': str(e), 'traceback': e.tb}
        except Exception as e:
            reply = {'ok': False, 'error': _short_error(e), 'traceback': traceback.format_exc()}
            worker.log(f'[flaloop worker] {cmd!r} failed:\n{reply["traceback"]}')
            worker.after_error()
        reply['cmd'] = cmd
        reply['id'] = rid
        _send(proto, reply)


def main(argv=None) -> int:
    proto = _claim_stdout()
    args = _parse_args(argv)
    _drop_script_dir_from_sys_path()
    worker = Worker(args)
    try:
        return serve(worker, sys.stdin, proto)
    except BrokenPipeError:
        return 1


if __name__ == '__main__':
    sys.exit(main())
