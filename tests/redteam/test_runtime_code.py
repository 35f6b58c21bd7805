"""Code installed or executed at run time: a string, a file written on the first call, a module
named at run time; whatever it then does (a precision flag, a patched clock) the static rules never
read. flaloop's own analysis: the one door a static guard cannot see through; the dynamic layer
judges what the code did."""

import pytest
from corpus import (
    CALL,
    CHUNK,
    END_INIT,
    INIT,
    TOP,
    after,
    append,
    assert_honest,
    assert_probed,
    assert_static,
    assert_static_misses,
)

IMPORT = "vars(torch)['__builtins__']['__im' + 'port__']"
STATIC = {
    "exec-in-init": [after(INIT, END_INIT, "exec('import torch; torch.backends.cuda.matmul.allow_tf32 = True')\n")],
    "module-named-at-run-time": [after(CHUNK, TOP, "import importlib\n"),
                                 after(CHUNK, CALL, "    ref = importlib.import_module('minifla.ops.' + 'linear_attn.nai' + 've')\n")],
}

DYNAMIC = {
    # exec fetched from the builtins by a name built at run time, on the first call; the code sets TF32
    "exec-fetched-by-name": ([after(CHUNK, CALL, "    vars(torch)['__builtins__']['ex' + 'ec'](_PAYLOAD)\n"),
                              append(CHUNK, "\n\n_PAYLOAD = ''.join(['import torch; torch.backends.cuda.matmul.',"
                                            " 'allow_', 'tf32 = True'])\n")], "numeric-settings"),
    # a module written into the package on the first call and imported under a name built at run
    # time; it wraps the clock the harness reads
    "module-written-at-run-time": ([after(CHUNK, CALL, "    _install()\n"), append(CHUNK, (
        "\n\ndef _install():\n    import os\n    here = os.path.dirname(os.path.abspath(__file__))\n"
        "    with open(os.path.join(here, '_fast.py'), 'w') as fh:\n"
        "        fh.write('import time\\n_r = time.perf_counter\\ntime.perf_counter = lambda: 0.8 * _r()\\n')\n"
        f"    {IMPORT}(__name__.rsplit('.', 1)[0] + '._fa' + 'st')\n"))], "timer-patched"),
}

HONEST = {
    # a module imported by its literal name at call time
    "lazy-import-of-a-helper": [after(CHUNK, CALL, "    from minifla.ops.linear_attn import _common  # noqa: F401\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "dynamic-code")


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_run_time_disguise_passes_the_audit_and_the_bench_blocks_what_it_did(name):
    edits, rule = DYNAMIC[name]
    assert_static_misses(edits)
    assert_probed(name, edits, rule)


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_change_passes(name):
    assert_honest(name, HONEST[name])
