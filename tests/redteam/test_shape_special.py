"""Special-casing the timed shapes: an exact branch on a tested length, or arithmetic that is right
only on the shapes the bench times (GPU MODE reference-kernels PR #104; FLA #988 undone read
FASTER 1.10x on its bench cell while wrong on B1-T64-H2-D32). The unseen shapes compare base and
candidate where no cell looks."""

import pytest
from corpus import (
    CALL,
    CHUNK,
    after,
    assert_honest,
    assert_probed,
    assert_static,
    assert_static_misses,
    replace,
)

STATIC = {
    "shape-equals-test-value": [after(CHUNK, CALL, "    if q.shape[1] == 64:\n        scale = scale * 1.0\n")],
    "shape-in-tuple": [after(CHUNK, CALL, "    T = q.shape[1]\n    if T in (64, 100):\n        scale = scale * 1.0\n")],
}

DYNAMIC = {
    # the scale wrong only when heads x head dim is below the bench's 2 x 32
    "scale-off-below-the-bench-width": [after(CHUNK, CALL, "    scale = scale * (1 + 0.5 * (1 >> (q.shape[2] * q.shape[3] // 64)))\n")],
    # the chunk loop bounded by max_len // BT: the tail chunk is never swept unless T is a multiple of 32
    "tail-chunk-dropped": [replace(CHUNK, "NT=triton.cdiv(max_len, BT), BT=BT", "NT=max_len // BT, BT=BT")],
}

HONEST = {
    "smaller-chunks": [replace(CHUNK, "CHUNK_SIZE = 32\n", "CHUNK_SIZE = 16\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "shape-branch")


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_arithmetic_disguise_passes_the_audit_and_the_cell_and_the_unseen_shapes_block_it(name):
    assert_static_misses(DYNAMIC[name])
    r = assert_probed(name, DYNAMIC[name], "unseen-shape-differs", unseen=True)
    assert r.diff["match"], r.diff  # right on the bench's cell


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_change_passes(name):
    assert_honest(name, HONEST[name], unseen=True)
