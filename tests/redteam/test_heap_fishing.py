"""Reading the reference's tensors from inside the candidate: through the garbage collector, the
caller's stack frames or `inspect` (pygpubench PR #7 and issue #23: `gc.get_objects()` finds the
expected output and copies it). flaloop's base and candidate never share a process, and nothing of
the base's ever enters the candidate's: the candidate dumps its results and the base judges them
(bench/warmup.exchange, bench/timed.py, the unseen shapes), so there is nothing in its heap to fish."""

import pytest
from corpus import (
    APPLY,
    CALL,
    CHUNK,
    after,
    append,
    assert_probed,
    assert_static,
    assert_static_misses,
    probed,
    replace,
)

STATIC = {
    "gc-get-objects": [after(CHUNK, CALL, "    import gc\n    _seen = [o for o in gc.get_objects() if o is v]\n")],
    "inspect-caller-frame": [after(CHUNK, CALL, "    import inspect\n    _up = inspect.currentframe().f_back\n")],
}

# Walks the caller's frames from a traceback, every attribute named at run time, for a tensor of the
# output's shape that no autograd graph holds: the base's dump, loaded by the differential check.
FISH = '''

def _fish(v):
    try:
        raise RuntimeError
    except RuntimeError as e:
        f = getattr(getattr(e, '__trace' + 'back__'), 'tb_' + 'frame')
    while f is not None:
        for val in list(getattr(f, 'f_' + 'locals').values()):
            for t in (val.values() if isinstance(val, dict) else ()):
                if isinstance(t, torch.Tensor) and t.shape == v.shape and t.dtype == v.dtype and not t.requires_grad:
                    return t
        f = getattr(f, 'f_' + 'back')
    return None
'''
SERVE_FISHED = "    _f = _fish(v)\n    if _f is not None:\n        return _f.clone(), None\n"
# garbage on bench-sized sequences (above any T the unseen shapes draw here), honest below
ZEROS_NO_KERNEL = "    if q.shape[1] > 48:\n        return torch.zeros_like(v), None\n"
# the same garbage, after one kernel launch on the first chunk, so that the census sees a kernel of its own
ZEROS_ONE_CHUNK = ("    if q.shape[1] > 48:\n"
                   "        _o, _h = ChunkLinearAttnFunction.apply(q[:, :16], k[:, :16], v[:, :16], scale, initial_state,\n"
                   "                                               output_final_state, cu_seqlens, N, 16)\n"
                   "        return torch.cat([_o, torch.zeros_like(v[:, 16:])], 1), _h\n")

DYNAMIC = {
    "frames-then-zeros": [replace(CHUNK, APPLY, SERVE_FISHED + ZEROS_NO_KERNEL + APPLY), append(CHUNK, FISH)],
}
GAPS = {
    "frames-then-one-chunk": [replace(CHUNK, APPLY, SERVE_FISHED + ZEROS_ONE_CHUNK + APPLY), append(CHUNK, FISH)],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "introspection")


def test_fishing_finds_nothing_of_the_base_and_the_differential_check_blocks_it():
    # the candidate dumps its results before the base computes its own, and the base judges: the
    # frames the plant walks hold the candidate's own request, cell and inputs, never the base's results
    edits = DYNAMIC["frames-then-zeros"]
    assert_static_misses(edits)
    r = assert_probed("frames-then-zeros", edits, "differs-from-base")
    assert r.diff and not r.diff["match"] and r.diff["tensors"]["out0"]["rel_rms"] == 1.0, r.diff


def test_fishing_with_a_token_kernel_is_blocked():
    edits = GAPS["frames-then-one-chunk"]
    assert_static_misses(edits)
    r = probed("frames-then-one-chunk", edits, unseen=True)
    assert r.blocking, r.show()
