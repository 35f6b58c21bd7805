"""Borrowed compute: the op hands the work to its naive reference, to the kernel its test compares
against, or to a library GEMM/einsum (KernelBench's static checker, "torch computation ops"; the
Kevin paper's fall-back to the reference; FLA chunk_delta_rule's `T <= 64` hand-off on an H200)."""

import pytest
from corpus import (
    APPLY,
    CALL,
    CHUNK,
    FWD,
    TOP,
    after,
    assert_probed,
    assert_static,
    assert_static_misses,
    replace,
)

IMPORT = "vars(torch)['__builtins__']['__im' + 'port__']"
STATIC = {
    "naive-for-short-sequences": ([after(CHUNK, TOP, "from minifla.ops.linear_attn.naive import naive_linear_attn\n"),
                                   after(CHUNK, CALL, "    if q.shape[1] <= 64:\n        return naive_linear_attn("
                                                      "q, k, v, scale, initial_state, output_final_state)\n")], "ref-call"),
    "torch-matmul": ([after(CHUNK, FWD, "    o = torch.matmul(q, k.transpose(-1, -2))\n")], "vendor-compute"),
}

DYNAMIC = {
    # the reference reached through the builtins' importer, module and function named at run time
    "reference-by-run-time-name": ([replace(CHUNK, APPLY, (
        f"    _m = {IMPORT}('minifla.ops.linear_attn.na' + 'ive', fromlist=['x'])\n"
        "    return getattr(_m, 'naive_linear_' + 'attn')(q, k, v, scale, initial_state, output_final_state)\n"))],
        "no-own-kernel"),
    # einsum fetched by a name built at run time: the work is torch's, not a kernel of the op's own
    "einsum-by-run-time-name": ([replace(CHUNK, APPLY, (
        "    _e = getattr(torch, 'ein' + 'sum')\n"
        "    _s = _e('bthk,bshk->bhts', q, k).tril() * scale\n"
        "    return _e('bhts,bshv->bthv', _s, v), None\n"))], "library-compute"),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    edits, rule = STATIC[name]
    assert_static(edits, rule)


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_run_time_disguise_passes_the_audit_and_the_census_blocks_it(name):
    edits, rule = DYNAMIC[name]
    assert_static_misses(edits)
    assert_probed(name, edits, rule)
