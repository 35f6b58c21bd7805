"""Branching on the evaluator or on the warm-up: honest while tested or checked, another path once
timing (pygpubench PR #7 and issue #23, GPU MODE reference-kernels PR #142: a replay path keyed on
the benchmark phase). The warm-up's checks here end by the op's 20th call in a process, the timed
samples run from the 21st, and the self-check then recomputes set 0 against what setup computed."""

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

STATIC = {
    "pytest-in-sys-modules": [after(INIT, END_INIT, "import sys as _s\nTESTING = 'pytest' in _s.modules\n")],
    "pytest-current-test": [after(CHUNK, TOP, "import os\n"),
                            after(CHUNK, CALL, "    if not os.environ.get('PYTEST_CURRENT_TEST'):\n        scale = scale * 1.01\n")],
}

ZEROS = "        return torch.zeros_like(v), None\n"
DYNAMIC = {
    # the count kept as an attribute of the op's own function object
    "count-on-a-function-attribute": ([after(CHUNK, CALL, "    _f = chunk_linear_attn\n    _f.n = getattr(_f, 'n', 0) + 1\n"
                                                          "    if _f.n > 24:\n" + ZEROS)], "self-check"),
    # the count in an iterator's bound method, made at import
    "count-in-an-iterator": ([after(CHUNK, CALL, "    if _tick() > 24:\n" + ZEROS),
                              append(CHUNK, "\n\n_tick = __import__('itertools').count(1).__next__\n")], "self-check"),
    # the process's own command line, its path assembled at run time: another path in a bench worker
    "command-line-sniffed": ([after(CHUNK, CALL, "    with open('/'.join(('', 'proc', 'self', 'cmdline')), 'rb') as _fh:\n"
                                                 "        if b'wor' + b'ker' in _fh.read():\n" + "    " + ZEROS)],
                             "differs-from-base"),
}

HONEST = {
    # a count that only picks a launch configuration, never the result
    "count-picks-warps": [after(CHUNK, CALL, "    _f = chunk_linear_attn\n    _f.n = getattr(_f, 'n', 0) + 1\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "introspection")


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_run_time_disguise_passes_the_audit_and_the_bench_blocks_it(name):
    edits, rule = DYNAMIC[name]
    assert_static_misses(edits)
    assert_probed(name, edits, rule)


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_change_passes(name):
    assert_honest(name, HONEST[name])
