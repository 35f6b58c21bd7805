"""Timers. Every function the timing path calls is bound here, when the worker starts and before
the target is imported (see integrity.py): a later patch of `torch.cuda.Event.elapsed_time`,
`torch.cuda.synchronize`, `CUDAGraph.replay` or `time.perf_counter` does not reach these names.

A device-time sample also records the host wall time of the same synchronized batch: device time
cannot exceed it, and a side whose device time falls short of its wall time by more than the
other side's does is flagged by the session (a timer that lies, however it was made to).

The garbage collector is off inside a timed window (as `timeit` does). Device time counts from the
start event, which the GPU passes at once on an idle stream; a collection before the work is
launched would be counted as the op's time.
"""

from __future__ import annotations

import gc
import glob
import time

import torch

_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_event_sync = torch.cuda.Event.synchronize
_elapsed = torch.cuda.Event.elapsed_time
_device_sync = torch.cuda.synchronize
_replay = torch.cuda.CUDAGraph.replay
_zero = torch.Tensor.zero_
_gc_enabled, _gc_disable, _gc_enable = gc.isenabled, gc.disable, gc.enable

FLUSH_MIN_BYTES = 256 << 20


def now() -> float:
    return _perf_counter()


def device_sync() -> None:
    _device_sync()


def replay(graph) -> None:
    _replay(graph)


def cuda_time_ms(fn) -> tuple[float, float]:
    """(device ms between two CUDA events around fn(), host wall ms of the same synchronized batch)."""
    start = _Event(enable_timing=True)
    end = _Event(enable_timing=True)
    _device_sync()
    was = _gc_enabled()
    _gc_disable()
    try:
        t0 = _perf_counter()
        _record(start)
        fn()
        _record(end)
        _event_sync(end)
        t1 = _perf_counter()
    finally:
        if was:
            _gc_enable()
    return float(_elapsed(start, end)), (t1 - t0) * 1e3


def cpu_time_ms(fn) -> float:
    was = _gc_enabled()
    _gc_disable()
    try:
        t0 = _perf_counter()
        fn()
        return (_perf_counter() - t0) * 1e3
    finally:
        if was:
            _gc_enable()


CPU_FLUSH_MIN_BYTES = 32 << 20


def cpu_cache_bytes() -> int | None:
    """The largest CPU cache Linux lists for cpu0 (the last level), or None."""
    sizes = []
    for d in glob.glob('/sys/devices/system/cpu/cpu0/cache/index*/size'):
        try:
            with open(d) as fh:
                text = fh.read().strip().upper()
        except OSError:
            continue
        scale = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip('KMG')
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


class L2Flush:
    """Overwrite a buffer twice the cache's size (outside the timed window, or captured into a cold
    cell's graph before each call): the GPU's L2, or on the CPU its last-level cache."""

    def __init__(self, device, l2_bytes: int | None):
        self.device, self.l2_bytes = device, l2_bytes
        self._buf = None

    def __call__(self) -> None:
        if self._buf is None:
            if self.device.type == 'cuda':
                n = max(2 * (self.l2_bytes or 0), FLUSH_MIN_BYTES)
            else:
                n = max(2 * (cpu_cache_bytes() or 0), CPU_FLUSH_MIN_BYTES)
            self._buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        _zero(self._buf)


def side_stream_warmup(fn) -> None:
    """torch.cuda.graph docs: warm up on a side stream before capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    _device_sync()
