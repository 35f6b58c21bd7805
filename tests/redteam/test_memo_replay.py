"""Skipped work in timed calls: results kept and served again, keyed on pointers, identity or
shapes, or held on the tensors themselves (GPU MODE reference-kernels PR #104, "batch-and-skip";
pygpubench PR #7). The comparison on inputs changed in place (same pointers, new values) finds a
kept result stale."""

import pytest
from corpus import (
    CALL,
    CHUNK,
    TOP,
    after,
    append,
    assert_honest,
    assert_probed,
    assert_static,
    assert_static_misses,
)

APPLY_KEPT = ("    _o, _h = ChunkLinearAttnFunction.apply(q, k, v, scale, initial_state, output_final_state,\n"
              "                                          cu_seqlens, N, max_len)\n")
STATIC = {
    "data-ptr-key": [after(CHUNK, CALL, "    key = (q.data_ptr(), k.data_ptr(), v.data_ptr())\n")],
    "lru-cache-on-tensors": [after(CHUNK, TOP, "import functools\n\n\n@functools.lru_cache(maxsize=None)\n"
                                               "def _cached(q: torch.Tensor, k: torch.Tensor):\n    return q\n")],
}

DYNAMIC = {
    # the result kept in the key tensor's own __dict__ under a name built at run time
    "kept-on-the-input": [after(CHUNK, CALL, "    _d, _n = vars(k), '_' + 'kept'\n    if _n in _d:\n        return _d[_n], None\n"
                                             + APPLY_KEPT + "    _d[_n] = _o.detach()\n    return _o, _h\n")],
    # kept in a dict hung on the function object, keyed on the inputs' shapes and strides
    "kept-on-the-function-by-shape": [after(CHUNK, CALL, "    _m = _store(chunk_linear_attn)\n    _key = (q.shape, q.stride())\n"
                                                         "    if _key in _m:\n        return _m[_key], None\n" + APPLY_KEPT
                                                         + "    _m[_key] = _o.detach()\n    return _o, _h\n"),
                                      append(CHUNK, "\n\ndef _store(f):\n    return vars(f).setdefault('_' + 'm', {})\n")],
}

HONEST = {
    # launch metadata cached on ints, as the autotuner does
    "lru-cache-on-ints": [after(CHUNK, TOP, "import functools\n\n\n@functools.lru_cache(maxsize=None)\n"
                                                         "def _blocks(T: int, BT: int) -> int:\n    return (T + BT - 1) // BT\n"),
                          after(CHUNK, CALL, "    _ = _blocks(q.shape[1], CHUNK_SIZE)\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "cache-memo")


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_run_time_disguise_passes_the_audit_and_changed_inputs_find_it_stale(name):
    assert_static_misses(DYNAMIC[name])
    assert_probed(name, DYNAMIC[name], "inputs-mutated")


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_change_passes(name):
    assert_honest(name, HONEST[name])
