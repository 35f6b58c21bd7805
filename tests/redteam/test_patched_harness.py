"""The harness's own tools patched: the clock, CUDA events, synchronize, the checker (FLA
chunk_delta_rule on an H200: an `fla/__init__.py` returning 0.8x of `elapsed_time` read FASTER
1.25x; KernelBench's static checker; pygpubench's README). The worker binds its timing functions
before the target's import and watches every callable it relies on."""

import statistics

import pytest
from corpus import (
    CALL,
    CHUNK,
    END_INIT,
    INIT,
    TOP,
    after,
    append,
    assert_probed,
    assert_static,
    assert_static_misses,
    base_times_ms,
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


@pytest.mark.xfail(strict=True, reason="gap: the watch compares the identity of callables and of Python code "
                                       "objects; a builtin's C function pointer swapped through ctypes keeps both")
def test_a_clock_swapped_at_the_c_level_is_blocked():
    assert "timer-patched" in c_swapped().blocking, c_swapped().show()
