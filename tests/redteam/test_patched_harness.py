"""The harness's own tools patched: the clock, CUDA events, synchronize, the checker (FLA
chunk_delta_rule on an H200: an `fla/__init__.py` returning 0.8x of `elapsed_time` read FASTER
1.25x; KernelBench's static checker; pygpubench's README). The worker binds its timing functions
before the target's import and watches every callable it relies on."""

import statistics
import subprocess
import sys

import pytest
from corpus import (
    CALL,
    CHUNK,
    END_INIT,
    HOST_PAIRS,
    INIT,
    TOP,
    after,
    append,
    assert_probed,
    assert_static,
    assert_static_misses,
    base_times_ms,
    host_timed,
    probed,
)

IMPORT = "vars(torch)['__builtins__']['__im' + 'port__']"
STATIC = {
    "elapsed-time-wrapped-in-init": [after(INIT, END_INIT, "import torch\n_orig = torch.cuda.Event.elapsed_time\n"
                                                           "torch.cuda.Event.elapsed_time = lambda self, end: 0.8 * _orig(self, end)\n")],
    "perf-counter-aliased": [after(CHUNK, TOP, "import time as _tm\n_tm.perf_counter = lambda: 0.0\n")],
}

DYNAMIC = {
    # the clock's module and name built at run time, patched on the op's first call
    "clock-by-run-time-names": [after(CHUNK, CALL, f"    _c = {IMPORT}('ti' + 'me')\n    _r = getattr(_c, 'perf_' + 'counter')\n"
                                                   "    setattr(_c, 'perf_' + 'counter', lambda: 0.8 * _r())\n")],
    # synchronize replaced on every call, on the module reached by a name built at run time
    "synchronize-by-run-time-names": [after(CHUNK, CALL, "    setattr(getattr(torch, 'cu' + 'da'), 'synch' + 'ronize', "
                                                         "lambda *a, **k: None)\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "timer-patch")


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_run_time_disguise_passes_the_audit_and_the_watch_blocks_it(name):
    assert_static_misses(DYNAMIC[name])
    assert_probed(name, DYNAMIC[name], "timer-patched")


# C level: the builtin `time.perf_counter` keeps its identity, and with it every reference the worker
# bound before the import, but its PyMethodDef's function pointer is pointed at a ctypes callback
# that runs the monotonic clock at 1/100 of its rate. ctypes is imported by a computed name.
C_SWAP = [append(CHUNK, '''

def _swap_clock():
    import time
    ct = vars(torch)['__builtins__']['__im' + 'port__']('ct' + 'ypes')
    fn, mono, word = getattr(time, 'perf_' + 'counter'), time.monotonic, ct.sizeof(ct.c_void_p)
    address = vars(torch)['__builtins__']['i' + 'd'](fn)
    method_def = ct.c_void_p.from_address(address + 2 * word).value
    slow = ct.PYFUNCTYPE(ct.py_object, ct.c_void_p, ct.c_void_p)(lambda module, unused: mono() * 0.01)
    ct.c_void_p.from_address(method_def + word).value = ct.cast(slow, ct.c_void_p).value
    globals()['_k' + 'eep'] = slow


_swap_clock()
''')]
_c_swap = {}


def c_swapped():
    if not _c_swap:
        _c_swap["r"] = probed("clock-swapped-in-c", C_SWAP)
    return _c_swap["r"]


def test_a_clock_swapped_at_the_c_level_reaches_the_harness_and_passes_the_audit():
    # the exploit is real: the candidate's samples read 100 times faster than the base's on the same code
    assert_static_misses(C_SWAP)
    r = c_swapped()
    assert r.error is None and r.times_ms, r.show()
    assert statistics.median(r.times_ms) < 0.1 * statistics.median(base_times_ms()), (r.times_ms, base_times_ms())


def test_a_clock_swapped_at_the_c_level_is_blocked():
    # the watch sees nothing (identities kept); the round trip flaloop times with its own clock does
    r = host_timed("clock-swapped-in-c-paired", C_SWAP)
    assert not r.integrity, r.integrity
    assert all(p.cand_reported_ms < 0.1 * p.cand_rtt_ms for p in r.pairs), r.pairs
    assert r.finding is not None and "timer-host-gap" in {r.finding.rule} and r.finding.blocking, r.finding


# Python level, from the op's first call: the worker's own bound clock (the global its timers read,
# in a module loaded under a private name) found by attribute names built at run time and wrapped to
# run at a tenth of its rate. The integrity watch names the replacement; here its violations are
# left out of the judgement, to show that the round-trip check blocks on its own.
BOUND_CLOCK = [after(CHUNK, CALL, f"    _n = '_perf_' + 'counter'\n"
                                  f"    for _m in list(vars({IMPORT}('s' + 'ys'))['mod' + 'ules'].values()):\n"
                                  "        _d = getattr(_m, '__di' + 'ct__', None) or {}\n"
                                  "        _r = _d.get(_n)\n"
                                  "        if 'cpu_' + 'time_ms' in _d and _r is not None and not getattr(_r, 'slow', 0):\n"
                                  "            _f = lambda _r=_r: 0.1 * _r()\n"
                                  "            _f.slow = True\n"
                                  "            _d[_n] = _f\n")]


def test_the_workers_bound_clock_wrapped_from_the_first_call_is_blocked_without_the_watch():
    assert_static_misses(BOUND_CLOCK)
    r = host_timed("bound-clock-wrapped", BOUND_CLOCK)
    assert any("_perf_counter was replaced" in v for v in r.integrity), r.integrity  # the plant took
    assert r.finding is not None and r.finding.rule == "timer-host-gap" and r.finding.blocking, r.finding


def test_an_honest_change_beside_a_cpu_load_is_not_blocked_by_the_round_trip():
    # an honest worker reports less than its round trip in every pair (the mechanism), and a busy
    # process on the host moves both sides' gaps alike: no block, at worst an unsure warning
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        r = host_timed("comment-beside-load", [after(CHUNK, TOP, "# the kernels are the base's\n")])
    finally:
        busy.kill()
        busy.wait()
    assert len(r.pairs) == HOST_PAIRS and not r.integrity
    assert all(p.base_reported_ms < p.base_rtt_ms and p.cand_reported_ms < p.cand_rtt_ms for p in r.pairs), r.pairs
    assert r.finding is None or not r.finding.blocking, r.finding
