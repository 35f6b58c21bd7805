"""Lazy outputs: a result that does its work when someone reads it, after the timer stopped (a
tensor subclass, a torch function/dispatch mode, a thread that fills the output later).
KernelBench's static checker, SOL-ExecBench `check_lazy_outputs`, CUDA-L1 #12."""

import pytest
from corpus import (
    APPLY,
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
    replace,
)

CALL_OP = ("    _o, _h = ChunkLinearAttnFunction.apply(q, k, v, scale, initial_state, output_final_state, "
           "cu_seqlens, N, max_len)\n")

STATIC = {
    "subclass-declared": [after(CHUNK, TOP, "\n\nclass _Lazy(torch.Tensor):\n    pass\n"),
                          replace(CHUNK, APPLY, CALL_OP + "    return _o.as_subclass(_Lazy), _h\n")],
    "dispatch-mode-in-init": [after(INIT, END_INIT, "\n\nclass _Later:\n    def __torch_dispatch__(self, func, types, "
                                                    "args=(), kwargs=None):\n        return func(*args)\n")],
}

DYNAMIC = {
    # the class made by type() under a name assembled at run time, the cast through getattr
    "subclass-built-at-run-time": ([after(CHUNK, TOP, "_Lz = type('L' + 'azy', (torch.Tensor,), {})\n"),
                                    replace(CHUNK, APPLY, CALL_OP + "    return getattr(_o, 'as_' + 'subclass')(_Lz), _h\n")],
                                   "output-subclass"),
    # a thread class fetched from the builtins' importer by names built at run time fills the output
    # 2 s after the call returned; the differential check reads the output long before
    "filled-later-by-a-hidden-thread": ([replace(CHUNK, APPLY, CALL_OP + (
        "    _z = torch.zeros_like(_o)\n"
        "    _imp = vars(torch)['__builtins__']['__im' + 'port__']\n"
        "    _t, _nap = getattr(_imp('thre' + 'ading'), 'Thr' + 'ead'), getattr(_imp('ti' + 'me'), 'sl' + 'eep')\n"
        "    _t(target=lambda: (_nap(2.0), _z.copy_(_o)), daemon=True).start()\n"
        "    return _z, _h\n"))], "differs-from-base"),
}

HONEST = {
    # a plain tensor through a helper: contiguous, detached from nothing, computed before returning
    "finished-through-a-helper": [replace(CHUNK, APPLY, CALL_OP + "    return _finish(_o), _h\n"),
                                  append(CHUNK, "\n\ndef _finish(o):\n    return o if o.is_contiguous() else o.contiguous()\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "tensor-subclass")


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_run_time_disguise_passes_the_audit_and_the_bench_blocks_it(name):
    edits, rule = DYNAMIC[name]
    assert_static_misses(edits)
    assert_probed(name, edits, rule)


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_change_passes(name):
    assert_honest(name, HONEST[name])
