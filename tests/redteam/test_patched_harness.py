"""The harness's own tools patched: the clock, CUDA events, synchronize, the checker (FLA
chunk_delta_rule on an H200: an `fla/__init__.py` returning 0.8x of `elapsed_time` read FASTER
1.25x; KernelBench's static checker; pygpubench's README). The worker binds its timing functions
before the target's import and watches every callable it relies on."""

import pytest
from corpus import CALL, CHUNK, END_INIT, INIT, TOP, after, assert_probed, assert_static, assert_static_misses

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
