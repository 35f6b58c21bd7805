"""One bench cell inside a worker: its input sets, how the op is called, the timer it got.

A cell is timed by a CUDA graph of k calls replayed between two events (the L2 flushed outside
them), once the replay is proven to reproduce eager outputs and gradients bit for bit or within
`GRAPH_PROOF_TOL`; where capture is impossible, by k eager calls between events; on the CPU by
`perf_counter` around k calls. k is calibrated so that one sample lasts `min_sample_ms`.
"""

from __future__ import annotations

import functools
import gc
import math
import time
import traceback

import torch

from . import timing
from .compare import diff_stats, flatten_outputs, same_bits
from .inputs import CellSpec, InputSet, nbytes, nonfinite
from .protocol import short_error
from .tuning import tuning_added, tuning_snapshot

VALID_TIMERS = ('auto', 'eager')
DEFAULT_WARMUP = 5            # eager calls before anything is timed (Triton compile + autotune)
DEFAULT_MIN_SAMPLE_MS = 2.0   # calibrated k makes one sample last at least this long
MAX_K = 256
GRAPH_PROOF_TOL = 1e-3        # graph replay vs eager, relative RMS


class GraphProofError(Exception):
    """The captured CUDA graph does not reproduce the eager results."""


class Cell:
    def __init__(self, worker, spec: dict):
        self.w = worker
        self.cfg = worker.cfg
        self.fn = worker.fn
        self.device = worker.device
        self.is_cuda = self.device.type == 'cuda'
        self.spec = CellSpec(spec, self.cfg, self.fn)
        self.id = self.spec.id
        self.mode = self.spec.mode
        self.dtype = self.spec.dtype
        self.timer_req = spec.get('timer', 'auto')
        if self.timer_req not in VALID_TIMERS:
            raise ValueError(f'timer must be one of {list(VALID_TIMERS)}, got {self.timer_req!r}')
        self.min_sample_ms = float(spec.get('min_sample_ms') or DEFAULT_MIN_SAMPLE_MS)
        self.warmup = int(spec.get('warmup') or DEFAULT_WARMUP)
        self.k = spec.get('k')
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
        self.tuning: dict = {}

    # -- building -----------------------------------------------------------------------------------

    def _add_do(self, s: InputSet) -> None:
        out = self.fn(**s.kwargs)
        t = out[0] if self.cfg.output_is_tuple else out
        if not isinstance(t, torch.Tensor):
            raise TypeError(f'output used for backward is {type(t).__name__}, not a tensor')
        s.do = torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=s.gen)
        for _, leaf in s.leaves:
            leaf.grad = None

    def _make(self, index: int, varlen_kw: dict) -> InputSet:
        s = self.spec.make_set(index, varlen_kw, self.device)
        if self.mode == 'fwdbwd':
            self._add_do(s)
        s.nbytes = nbytes(s.kwargs) + (nbytes(s.do) if s.do is not None else 0)
        return s

    def build(self) -> dict:
        t_setup = time.perf_counter()
        self.spec.check()
        varlen_kw = self.spec.varlen_kwargs(self.device)
        self.extra_kwarg_names = sorted(varlen_kw)
        first = self._make(0, varlen_kw)
        self.set_bytes = first.nbytes
        self.n_sets = self.spec.choose_n_sets(self.set_bytes, self.is_cuda, self.w.l2_bytes)
        self.sets = [first] + [self._make(i, varlen_kw) for i in range(1, self.n_sets)]

        t0 = time.perf_counter()
        tuned_before = tuning_snapshot()
        for i in range(max(self.warmup, self.n_sets)):
            self.call(self.sets[i % self.n_sets])
        self._sync()
        warmup_s = time.perf_counter() - t0
        # What Triton's autotuners chose during this cell's first calls: the session compares
        # the two sides, since a different pick on an unchanged kernel is noise, not a win.
        self.tuning = tuning_added(tuned_before, tuning_snapshot())

        nonfinite_counts = {name: nonfinite(t) for name, t in self.results(self.sets[0]).items()}

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
            self._set_k(self._estimate_per_call_ms())

        return {
            'cell': self.id, 'timer': self.timer, 'k': self.k, 'n_sets': self.n_sets, 'set_bytes': self.set_bytes,
            'nonfinite': nonfinite_counts, 'capture_error': self.capture_error,
            'graph_bitwise_equal': self.graph_bitwise_equal, 'warmup_s': warmup_s,
            'setup_s': time.perf_counter() - t_setup, 'mode': self.mode,
            'dtype': str(self.dtype).replace('torch.', ''), 'shape': self.spec.shape,
            'per_call_ms_estimate': self.per_call_ms_estimate, 'extra_kwargs': self.extra_kwarg_names,
            'tuning': self.tuning,
        }

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
        flatten_outputs(out, res)
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

    def results_mutated(self) -> dict:
        """Results on set 0 after its inputs were changed in place (same pointers, same storage):
        each floating input is rolled by one step along its first dimension of size > 1, which
        keeps every value, and so the input's domain (normalised rows, gates in (0, 1)). The inputs
        are rolled back afterwards, exactly. A candidate that caches its outputs by pointer, shape
        or object identity returns the stale result here, and the session's comparison with the
        base's mutated result blocks it."""
        s = self.sets[0]
        rolled = []
        with torch.no_grad():
            for t in s.tensors():
                if not t.is_floating_point() or t is s.do:
                    continue
                dim = next((d for d, n in enumerate(t.shape) if n > 1), None)
                if dim is None:
                    continue
                t.copy_(t.roll(1, dims=dim))
                rolled.append((t, dim))
        try:
            return {k: v.clone() for k, v in self.results(s).items()}
        finally:
            with torch.no_grad():
                for t, dim in rolled:
                    t.copy_(t.roll(-1, dims=dim))

    def calls(self, m: int) -> None:
        """m eager calls, call j on set j % n_sets."""
        n = self.n_sets
        for j in range(m):
            self.call(self.sets[j % n])

    def k_calls(self) -> None:
        self.calls(self.k)

    def _sync(self) -> None:
        if self.is_cuda:
            timing.device_sync()

    # -- timing -------------------------------------------------------------------------------------

    def sample(self) -> tuple[float, float]:
        """(per-call device ms, per-call host wall ms) of one sample of k calls."""
        if not self.is_cuda:
            ms = timing.cpu_time_ms(self.k_calls)
            return ms / self.k, ms / self.k
        self.w.flush_l2()  # outside the events
        fn = (lambda: timing.replay(self.graph)) if self.timer == 'cuda_graph' else self.k_calls
        dev, wall = timing.cuda_time_ms(fn)
        return dev / self.k, wall / self.k

    def eager_sample(self) -> tuple[float, float]:
        """(host issue ms per call, wall ms per call) of k eager calls."""
        if self.is_cuda:
            self.w.flush_l2()
            timing.device_sync()
        t0 = timing.now()
        self.k_calls()
        t1 = timing.now()
        self._sync()
        t2 = timing.now()
        return (t1 - t0) * 1e3 / self.k, (t2 - t0) * 1e3 / self.k

    def _set_k(self, per_call_ms: float) -> None:
        self.per_call_ms_estimate = per_call_ms
        k = math.ceil(self.min_sample_ms / max(per_call_ms, 1e-6))
        self.k = int(min(max(k, 1), MAX_K))

    def _estimate_per_call_ms(self) -> float:
        m = max(self.n_sets, 2)

        def run():
            self.calls(m)

        times = []
        for _ in range(3):
            if self.is_cuda:
                times.append(timing.cuda_time_ms(run)[0] / m)
            else:
                times.append(timing.cpu_time_ms(run) / m)
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
            self.capture_error = short_error(e)
            self.w.log(f'[flaloop worker] cell {self.id}: CUDA graph unusable, eager timer:\n'
                       f'{traceback.format_exc()}')
        # outside the except block, so the traceback no longer pins the capture's tensors
        graph = static = None
        for s in self.sets:
            for _, leaf in s.leaves:
                leaf.grad = None
        gc.collect()
        try:
            timing.device_sync()
            torch.cuda.empty_cache()
        except Exception:
            pass
        # eager must still work after the failed capture (raises if the context is broken)
        self.results(self.sets[0])
        if self.k is None:
            self._set_k(self._estimate_per_call_ms())
        return 'cuda_eager'

    def _calibrate_k_with_graph(self) -> None:
        """k from the device time of a probe graph of n_sets calls (eager timing would be host-bound)."""
        probe, probe_static = self._capture(self.n_sets)
        times = []
        for _ in range(3):
            self.w.flush_l2()
            times.append(timing.cuda_time_ms(functools.partial(timing.replay, probe))[0] / self.n_sets)
        del probe, probe_static
        self._set_k(sorted(times)[1])

    def _capture(self, m: int):
        """Capture m calls (cycling sets) into one CUDAGraph.

        Keeps the outputs (and grads) of the last captured call on each set as the static tensors
        the proof checks; the pool memory of earlier calls is recycled within the capture.
        """
        n = self.n_sets
        timing.side_stream_warmup(lambda: self.calls(max(3, n)))
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
        timing.device_sync()
        for s in self.sets:  # the grads stay referenced by `static`; drop the leaves' handles
            for _, leaf in s.leaves:
                leaf.grad = None
        return graph, static

    def _protected_storages(self) -> set:
        return {t.untyped_storage().data_ptr() for s in self.sets for t in s.tensors()}

    def _prove(self, graph, static) -> bool:
        """Poison the static outputs/grads with NaN, replay, and compare with eager calls on the same sets."""
        protected = self._protected_storages()
        with torch.no_grad():
            for d in static.values():
                for t in d.values():
                    if t.is_floating_point() and t.untyped_storage().data_ptr() not in protected:
                        t.detach().fill_(float('nan'))
        timing.replay(graph)
        timing.device_sync()
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
                            f'set {index} {name}: {nonfinite(g)} nonfinite after replay vs {nonfinite(e)} '
                            'eager (replay did not rewrite it?)')
                    err, _ = diff_stats(g, e)
                    if err > GRAPH_PROOF_TOL:
                        raise GraphProofError(f'set {index} {name}: replay vs eager rel RMS {err:.3g}')
                elif not torch.equal(g, e):
                    raise GraphProofError(f'set {index} {name}: replay differs from eager')
                bitwise = bitwise and same_bits(g.detach(), e)
        return bitwise
