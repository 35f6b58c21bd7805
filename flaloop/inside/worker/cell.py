"""One bench cell inside a worker: its input sets, how the op is called, the timer it got.

A cell is timed by a CUDA graph of k calls replayed between two events (the L2 flushed outside
them), once the replay is proven to reproduce eager outputs and gradients bit for bit or within
`GRAPH_PROOF_TOL`; where capture is impossible, by k eager calls between events; on the CPU by
`perf_counter` around k calls. k is calibrated so that one sample lasts `sample_ms`.

On a GPU a cell can be built more than once in the same process (`placements`): each placement
has its own input tensors (the same values) and its own proven graph with its own memory pool,
and `sample(i)` times placement i. Where a cell's memory lands moves its time: on the H200 one
process's four placements of the same cell differed by up to 0.85% (benchmarks/placement.py,
docs/lab/2026-12-01-h200.md, R8), so a pair of processes that each hold one placement carries that luck into
the comparison; rotating over placements averages it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import time
import traceback

import torch

from . import timing
from .backends import backend_snapshot
from .inputs import CellSpec, InputSet, nbytes, nonfinite
from .outputs import compare_results, diff_stats, flatten_outputs, same_bits
from .protocol import refusal, short_error
from .tuning import tuning_added, tuning_snapshot

VALID_TIMERS = ('auto', 'eager')
VALID_L2 = ('rotate', 'hot', 'cold')  # bench/model.L2_STATES
DEFAULT_WARMUP = 5            # eager calls before anything is timed (Triton compile + autotune)
DEFAULT_SAMPLE_MS = 2.0   # calibrated k makes one sample last at least this long
MAX_K = 256
GRAPH_PROOF_TOL = 1e-3        # graph replay vs eager, relative RMS
PLACEMENT_MEMORY_SHARE = 0.25  # extra placements may take at most this share of the free GPU memory



def first_output(out, is_tuple):
    """The output a backward starts from: the first item of a tuple, the output itself; `is_tuple`
    None (an op declared from recorded calls, whose return nobody described) decides by the type."""
    if is_tuple is None:
        is_tuple = isinstance(out, (tuple, list))
    return out[0] if is_tuple else out

class GraphProofError(Exception):
    """The captured CUDA graph does not reproduce the eager results."""


class BuiltCell:
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
        self.l2 = spec.get('l2') or 'rotate'
        if self.l2 not in VALID_L2:
            raise ValueError(f'l2 must be one of {list(VALID_L2)}, got {self.l2!r}')
        self.flush_graph = None  # cold, graph timer: k flushes alone, whose time each sample subtracts
        self.flush_ms = None
        self.sample_ms = float(spec.get('sample_ms') or DEFAULT_SAMPLE_MS)
        self.warmup = int(spec.get('warmup') or DEFAULT_WARMUP)
        self.k = spec.get('k')
        # only compared, never timed (the warm-up's unseen shapes): inputs built, no call made here;
        # the dump that follows is the one call
        self.check_only = bool(spec.get('check_only'))
        self.placements_req = int(spec.get('placements') or 1)
        if self.placements_req < 1:
            raise ValueError(f'placements must be >= 1, got {self.placements_req}')
        self.sets: list[InputSet] = []
        # placements after the first: (its input sets, its proven graph or None under the eager timer)
        self.extra: list[tuple[list[InputSet], object]] = []
        self.extra_static: list[dict] = []  # their graphs' output tensors, as `static` is placement 0's
        self.placement_bytes = 0
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
        # the self-check's references (setup's "reference": a measuring process asks for them):
        # set 0's results and its results on inputs changed in place, taken before any timed sample
        self.want_reference = bool(spec.get('reference'))
        self.reference: dict | None = None
        self.reference_mutated: dict | None = None
        # the results one timed call left, taken from inside a timed sample (`sample`'s `keep`):
        # {'s<set>:<name>': tensor}, for the session to compare with the base's same call
        self.kept: dict | None = None
        self.keep_s = 0.0  # host seconds the last kept copy took (its cost, in the record)

    # -- building -----------------------------------------------------------------------------------

    def _add_do(self, s: InputSet) -> None:
        out = self.fn(**s.kwargs)
        t = first_output(out, self.cfg.output_is_tuple)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f'output used for backward is {type(t).__name__}, not a tensor')
        s.do = torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=s.gen)
        for _, leaf in s.leaves:
            leaf.grad = None

    def _make(self, index: int, varlen_kw: dict) -> InputSet:
        s = self.spec.make_set(index, varlen_kw, self.device)
        if self.mode == 'fwdbwd' and not self.check_only:  # check-only: drawn at the one call (`call`)
            self._add_do(s)
        s.nbytes = nbytes(s.kwargs) + (nbytes(s.do) if s.do is not None else 0)
        return s

    def build(self) -> dict:
        t_setup = time.perf_counter()
        self.spec.check()
        held_before = self._held_bytes()
        varlen_kw = self.spec.varlen_kwargs(self.device)
        self.extra_kwarg_names = sorted(varlen_kw)
        try:  # fwdbwd: the op's forward runs here, for the upstream gradient's shape
            first = self._make(0, varlen_kw)
        except Exception as e:
            self._refused(e)
            raise
        self.set_bytes = first.nbytes
        # hot: one set, so that every call finds the previous call's inputs in the L2
        self.n_sets = 1 if self.l2 == 'hot' else self.spec.choose_n_sets(self.set_bytes, self.is_cuda, self.w.l2_bytes)
        self.sets = [first] + [self._make(i, varlen_kw) for i in range(1, self.n_sets)]
        if self.check_only:
            self.timer, self.k = ('cuda_eager' if self.is_cuda else 'cpu'), 1
            return {'cell': self.id, 'timer': self.timer, 'k': self.k, 'n_sets': self.n_sets, 'check_only': True,
                    'set_bytes': self.set_bytes, 'placements': 1, 'nonfinite': {}, 'mode': self.mode,
                    'setup_s': time.perf_counter() - t_setup, 'shape': self.spec.shape, 'tuning': {},
                    'dtype': str(self.dtype).replace('torch.', ''), 'extra_kwargs': self.extra_kwarg_names}

        t0 = time.perf_counter()
        tuned_before = tuning_snapshot()
        try:
            for i in range(max(self.warmup, self.n_sets)):
                self.call(self.sets[i % self.n_sets])
            self._sync()
        except Exception as e:
            self._refused(e)
            raise
        warmup_s = time.perf_counter() - t0
        # What Triton's autotuners chose during this cell's first calls: the session compares
        # the two sides, since a different pick on an unchanged kernel is noise, not a win.
        self.tuning = tuning_added(tuned_before, tuning_snapshot())

        first = self.results(self.sets[0])
        nonfinite_counts = {name: nonfinite(t) for name, t in first.items()}
        if self.want_reference:  # the self-check's reference: set 0 before any timed sample
            self.reference = {k: v.clone() for k, v in first.items()}
        del first

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
        if self.is_cuda and self.placements_req > 1:
            self._add_placements(varlen_kw, max(self._held_bytes() - held_before, self.n_sets * self.set_bytes))
        if self.want_reference:
            self.reference_mutated = self.results_mutated()

        return {
            'cell': self.id, 'timer': self.timer, 'k': self.k, 'n_sets': self.n_sets, 'set_bytes': self.set_bytes,
            'placements': 1 + len(self.extra), 'placement_bytes': self.placement_bytes,
            'nonfinite': nonfinite_counts, 'capture_error': self.capture_error,
            'graph_bitwise_equal': self.graph_bitwise_equal, 'warmup_s': warmup_s,
            'setup_s': time.perf_counter() - t_setup, 'mode': self.mode,
            'dtype': str(self.dtype).replace('torch.', ''), 'shape': self.spec.shape,
            'per_call_ms_estimate': self.per_call_ms_estimate, 'extra_kwargs': self.extra_kwarg_names,
            'tuning': self.tuning, 'l2': self.l2, 'flush_ms': self.flush_ms,
            # what the target's backend registries served so far in this process (both sides set up
            # the same cells in the same order, so the two snapshots compare)
            'backends': backend_snapshot(),
        }

    def _refused(self, e: Exception) -> None:
        """Raise OpRefused from `e` when the op's own code refused this cell (protocol.refusal)."""
        refused = refusal(e, self.w.tree)
        if refused is not None:
            raise refused from e

    # -- calling --------------------------------------------------------------------------------------

    def call(self, s: InputSet):
        if self.mode == 'fwd':
            with torch.no_grad():
                return self.fn(**s.kwargs)
        for _, leaf in s.leaves:
            leaf.grad = None
        out = self.fn(**s.kwargs)
        t = first_output(out, self.cfg.output_is_tuple)
        if s.do is None:  # the same draw `_add_do` makes, without its extra call
            s.do = torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=s.gen)
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
        with self._rolled(self.sets[0]):
            return {k: v.clone() for k, v in self.results(self.sets[0]).items()}

    @contextlib.contextmanager
    def _rolled(self, s: InputSet):
        """Set `s`'s floating inputs (not its upstream gradient) rolled by one step in place for the
        block, rolled back exactly after it."""
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
            yield
        finally:
            with torch.no_grad():
                for t, dim in rolled:
                    t.copy_(t.roll(-1, dims=dim))

    def self_check(self, tol: float) -> dict:
        """After the timed samples: does this process still compute what it computed before them?
        Readings of set 0 against the references taken at setup: under the graph timer the graph's
        outputs after one more replay, and after a replay on inputs changed in place; one more eager
        call; and an eager call on inputs changed in place. Behaviour keyed on the number of calls, the process's age, the inputs' identity or
        the capture state shows here, after the warm-up's checks and the probes have passed."""
        if self.reference is None:
            raise ValueError(f'cell {self.id} was set up without "reference": nothing to check against')
        checks = {}
        if self.timer == 'cuda_graph' and self.graph is not None and 0 in (self.static or {}):
            def replayed() -> dict:
                timing.replay(self.graph)
                self._sync()
                return {k: v.detach().clone() for k, v in self.static[0].items()}

            checks['replay'] = compare_results(replayed(), self.reference, tol)
            # the graph on inputs changed in place: work skipped or stale only while captured shows here
            with self._rolled(self.sets[0]):
                checks['replay-mutated'] = compare_results(replayed(), self.reference_mutated, tol)
            replayed()  # the graph's outputs as the inputs are again
        checks['eager'] = compare_results(self.results(self.sets[0]), self.reference, tol)
        checks['mutated'] = compare_results(self.results_mutated(), self.reference_mutated, tol)
        return {'match': all(c.get('match') for c in checks.values()), 'checks': checks}

    def calls(self, m: int, sets: list[InputSet] | None = None, keep: int | None = None) -> None:
        """m eager calls, call j on set j % n_sets (of placement 0, or of `sets`); with `keep`, the
        results of call number `keep` copied into `kept` right after it returns, before the next
        call: inside the timed window, since a call outside it is one the op could tell apart."""
        sets = sets or self.sets
        for j in range(m):
            s = sets[j % len(sets)]
            out = self.call(s)
            if j == keep:
                self._keep({s.index: self.named(s, out)})

    def k_calls(self, sets: list[InputSet] | None = None, keep: int | None = None) -> None:
        self.calls(self.k, sets, keep)

    def _keep(self, by_set: dict) -> None:
        """Copies of a timed call's results ({set index: {name: tensor}}) into `kept`."""
        t0 = timing.now()
        self.kept = {f's{i}:{name}': t.detach().clone() for i, d in by_set.items() for name, t in d.items()}
        self.keep_s = timing.now() - t0

    # -- placements ---------------------------------------------------------------------------------

    def _held_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device)) if self.is_cuda else 0

    def _add_placements(self, varlen_kw: dict, per_placement: int) -> None:
        """Build placements 2..n: fresh input sets with the same values, and under the graph timer
        their own captured and proven graph (a graph captured outside a given pool gets its own).
        As many as fit in PLACEMENT_MEMORY_SHARE of the free memory (the other side shares it)."""
        self.placement_bytes = int(per_placement)
        free, _ = torch.cuda.mem_get_info(self.device)
        room = int(PLACEMENT_MEMORY_SHARE * free) // max(per_placement, 1)
        for _ in range(min(self.placements_req - 1, room)):
            try:
                sets = [self._make(i, varlen_kw) for i in range(self.n_sets)]
                graph = None
                if self.timer == 'cuda_graph':
                    graph, static = self._capture(self.k, sets, flush=self.l2 == 'cold')
                    self._prove(graph, static, sets)
                else:
                    self.calls(max(3, self.n_sets), sets)
            except torch.cuda.OutOfMemoryError:
                sets = graph = static = None
                gc.collect()
                torch.cuda.empty_cache()
                break  # fewer placements, not a failed cell (the reply says how many were built)
            self.extra.append((sets, graph))
            self.extra_static.append(static if graph is not None else {})
        self._sync()

    def placement(self, i: int) -> tuple[list[InputSet], object]:
        """Placement i, modulo how many were built: its input sets and its graph."""
        i %= 1 + len(self.extra)
        return (self.sets, self.graph) if i == 0 else self.extra[i - 1]

    def placement_static(self, i: int) -> dict:
        """The output tensors of placement i's graph ({set index: {name: tensor}}; {} without one)."""
        i %= 1 + len(self.extra)
        return (self.static or {}) if i == 0 else self.extra_static[i - 1]

    def _sync(self) -> None:
        if self.is_cuda:
            timing.device_sync()

    # -- timing -------------------------------------------------------------------------------------

    def sample(self, placement: int = 0, keep: int | None = None) -> tuple[float, float]:
        """(per-call device ms, per-call host wall ms) of one sample of k calls on a placement, in
        the cell's L2 state (bench/model.L2_STATES): rotate and hot, the L2 flushed before the
        sample (rotate) or not (hot), then k calls between two events; cold, see `_cold_sample`.

        With `keep` (a call index the session drew, 0 <= keep < k) this sample's results stay in
        `kept`: under the eager and CPU timers those of timed call number `keep`, copied as it
        returns; under the graph timer what this replay left in the graph's output tensors, copied
        after the events and before any other replay overwrites it (`keep` only says to copy)."""
        sets, graph = self.placement(placement)
        if keep is not None:
            keep, self.kept = int(keep) % self.k, None
        if self.l2 == 'cold':
            times = self._cold_sample(sets, graph, keep)
        elif not self.is_cuda:
            ms = timing.cpu_time_ms(lambda: self.k_calls(sets, keep))
            times = ms / self.k, ms / self.k
        else:
            if self.l2 != 'hot':
                self.w.flush_l2()  # outside the events
            fn = (lambda: timing.replay(graph)) if self.timer == 'cuda_graph' else (lambda: self.k_calls(sets, keep))
            dev, wall = timing.cuda_time_ms(fn)
            times = dev / self.k, wall / self.k
        if keep is not None and self.timer == 'cuda_graph':
            t0 = timing.now()
            self._keep(self.placement_static(placement))
            self._sync()
            self.keep_s = timing.now() - t0
        return times

    def _cold_sample(self, sets: list[InputSet], graph, keep: int | None = None) -> tuple[float, float]:
        """k calls, each after an L2 flush, the flushes' time not counted. Under the graph timer
        the graph holds k (flush, call) pairs, so the GPU runs them back to back, and the time of
        `flush_graph` (k flushes alone), taken right after, is subtracted from both the device and
        the wall time. Otherwise (eager, CPU) each call is timed alone, the flush just before its
        window."""
        if self.timer == 'cuda_graph':
            self.w.flush_l2()
            dev, wall = timing.cuda_time_ms(lambda: timing.replay(graph))
            fdev, fwall = timing.cuda_time_ms(lambda: timing.replay(self.flush_graph))
            return (dev - fdev) / self.k, (wall - fwall) / self.k
        dev = wall = 0.0
        for j in range(self.k):
            self.w.flush_l2()
            one = functools.partial(self.calls, 1, sets, 0 if j == keep else None)
            if self.is_cuda:
                d, w = timing.cuda_time_ms(one)
            else:
                d = w = timing.cpu_time_ms(one)
            dev, wall = dev + d, wall + w
        return dev / self.k, wall / self.k

    def eager_sample(self) -> tuple[float, float]:
        """(host issue ms per call, wall ms per call) of k eager calls, in the cell's L2 state as
        `sample` keeps it (cold: each call after its own flush, timed alone), so that the guard's
        eager cross-check compares like with like."""
        if self.l2 == 'cold':
            host = wall = 0.0
            for _ in range(self.k):
                h, w = self._eager_window(1, flush=True)
                host, wall = host + h, wall + w
            return host / self.k, wall / self.k
        h, w = self._eager_window(self.k, flush=self.is_cuda and self.l2 != 'hot')
        return h / self.k, w / self.k

    def _eager_window(self, m: int, flush: bool) -> tuple[float, float]:
        """(host issue ms, wall ms) of m eager calls, after an L2 flush with `flush`."""
        if flush:
            self.w.flush_l2()
        self._sync()
        t0 = timing.now()
        self.calls(m)
        t1 = timing.now()
        self._sync()
        t2 = timing.now()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    def _set_k(self, per_call_ms: float) -> None:
        """k calls last `sample_ms`; in a cold cell its k flushes may not last longer than that
        either. The flush is not timed but it is run: a CPU's last-level cache can take a thousand
        calls to overwrite (0.12 s for the 480 MiB L3 a cloud VM lists), and the calls' k alone once
        made a cold cell of `--cell-seconds 30` take 400 s. On a GPU the flush costs about a call
        (81 us on the H200), so only calls shorter than that get a smaller k."""
        self.per_call_ms_estimate = per_call_ms
        k = math.ceil(self.sample_ms / max(per_call_ms, 1e-6))
        if self.l2 == 'cold':
            flush = self._flush_estimate_ms()
            self.flush_ms = flush  # the setup reply says what bounded k (a CUDA graph's own reading replaces it)
            k = min(k, math.ceil(self.sample_ms / max(flush, 1e-6)))
        self.k = int(min(max(k, 1), MAX_K))

    def _flush_estimate_ms(self) -> float:
        """The median of three L2 flushes' times (the first also allocates the buffer)."""
        if self.is_cuda:
            times = [timing.cuda_time_ms(self.w.flush_l2)[0] for _ in range(3)]
        else:
            times = [timing.cpu_time_ms(self.w.flush_l2) for _ in range(3)]
        return sorted(times)[1]

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
            graph, static = self._capture(self.k, flush=self.l2 == 'cold')
            self.graph_bitwise_equal = self._prove(graph, static)
            self.graph, self.static = graph, static
            if self.l2 == 'cold':
                self._capture_flushes()
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

    def _capture_flushes(self) -> None:
        """The cold graph timer's `flush_graph`: k L2 flushes alone, and their median time per call."""
        self.flush_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.flush_graph):
            for _ in range(self.k):
                self.w.flush_l2()
        timing.device_sync()
        times = sorted(timing.cuda_time_ms(lambda: timing.replay(self.flush_graph))[0] for _ in range(3))
        self.flush_ms = times[1] / self.k

    def _capture(self, m: int, sets: list[InputSet] | None = None, flush: bool = False):
        """Capture m calls (cycling the sets of placement 0, or `sets`) into one CUDAGraph, each
        after an L2 flush with `flush` (the cold L2 state).

        Keeps the outputs (and grads) of the last captured call on each set as the static tensors
        the proof checks; the pool memory of earlier calls is recycled within the capture.
        """
        sets = sets or self.sets
        n = len(sets)
        timing.side_stream_warmup(lambda: self.calls(max(3, n), sets))
        if flush:
            self.w.flush_l2()  # its buffer is allocated outside the capture
        graph = torch.cuda.CUDAGraph()
        static: dict[int, dict] = {}
        with torch.cuda.graph(graph):
            for j in range(m):
                if flush:
                    self.w.flush_l2()
                s = sets[j % n]
                static.pop(s.index, None)
                out = self.call(s)  # fwdbwd: leaf.grad=None first, so backward allocates from the graph pool
                # detached: holding `out` itself would keep its autograd graph (and the leaves'
                # AccumulateGrad nodes, bound to the capture stream) alive into later eager calls
                static[s.index] = {k: v.detach() for k, v in self.named(s, out).items()}
                del out
        timing.device_sync()
        for s in sets:  # the grads stay referenced by `static`; drop the leaves' handles
            for _, leaf in s.leaves:
                leaf.grad = None
        return graph, static

    @staticmethod
    def _protected_storages(sets: list[InputSet]) -> set:
        return {t.untyped_storage().data_ptr() for s in sets for t in s.tensors()}

    def _prove(self, graph, static, sets: list[InputSet] | None = None) -> bool:
        """Poison the static outputs/grads with NaN, replay, and compare with eager calls on the same sets."""
        sets = sets or self.sets
        protected = self._protected_storages(sets)
        with torch.no_grad():
            for d in static.values():
                for t in d.values():
                    if t.is_floating_point() and t.untyped_storage().data_ptr() not in protected:
                        t.detach().fill_(float('nan'))
        timing.replay(graph)
        timing.device_sync()
        bitwise = True
        for index, d in static.items():
            eager = self.results(sets[index])
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
