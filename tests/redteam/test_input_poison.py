"""Inputs mutated to poison the reference: the candidate returns something cheap and rewrites its
inputs so that a reference computed afterwards on the same tensors agrees (KernelBench's and GPU
MODE's evaluators compute the reference after the candidate in one process). flaloop's base
computes its own results from its own inputs in another process, so the differential check sees it."""

import pytest
from corpus import (
    APPLY,
    CALL,
    CHUNK,
    after,
    append,
    assert_honest,
    assert_probed,
    assert_static_misses,
    replace,
)

DYNAMIC = {
    # zeros out, and the inputs zeroed through .data so that autograd does not object
    "inputs-zeroed-through-data": [replace(CHUNK, APPLY, "    for _x in (q, k, v):\n        _x.data.zero_()\n"
                                                         "    return torch.zeros_like(v), None\n")],
    # the poisoning kept on the function as an attribute (a closure), the method named at run time
    "poison-in-a-function-attribute": [
        after(CHUNK, CALL, "    _p = getattr(chunk_linear_attn, '_after', None)\n"
                           "    if _p is not None:\n        return _p(q, k, v), None\n"),
        append(CHUNK, "\n\ndef _make_after(fill):\n    def _after(*ts):\n        for t in ts:\n"
                      "            getattr(t.detach(), fill + '_')(0.0)\n        return torch.zeros_like(ts[-1])\n"
                      "    return _after\n\n\nchunk_linear_attn._after = _make_after('fi' + 'll')\n")],
}

HONEST = {
    # in place, on a copy of its own
    "scale-folded-into-own-copy": [after(CHUNK, CALL, "    q = q.clone()\n    q.mul_(scale)\n    scale = 1.0\n")],
}


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_poisoned_inputs_pass_the_audit_and_the_differential_check_blocks_them(name):
    assert_static_misses(DYNAMIC[name])
    assert_probed(name, DYNAMIC[name], "differs-from-base")


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_change_passes(name):
    assert_honest(name, HONEST[name])
