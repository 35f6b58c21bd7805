"""Work where the timer does not look: a side stream the timed stream's events do not wait for, a
thread, a process, an `atexit` hook (KernelBench PR #82; pygpubench PR #7; FLA chunk_delta_rule on
an H200, a new `torch.cuda.Stream` in the op's call). The census counts the streams the kernels ran
on; a thread that finishes the output late is in tests/redteam/test_lazy_outputs.py."""

import pytest
from corpus import (
    APPLY,
    CHUNK,
    FLA_ROOT,
    FWD,
    TOP,
    Subject,
    after,
    append,
    assert_probed,
    assert_static,
    assert_static_misses,
    fla_subject,
    replace,
)

STATIC = {
    "side-stream": [after(CHUNK, FWD, "    side = torch.cuda.Stream()\n")],
    "atexit-aliased": [after(CHUNK, TOP, "import atexit as _ax\n_ax.register(print)\n")],
}

# the stream class and its context manager fetched by names built at run time
SIDE = '''

def _on_side(fn, *args, **kwargs):
    _cuda = getattr(torch, 'cu' + 'da')
    s = getattr(_cuda, 'Str' + 'eam')()
    with getattr(_cuda, 'str' + 'eam')(s):
        return fn(*args, **kwargs)
'''
MINI_PLANT = [replace(CHUNK, APPLY, "    return _on_side(ChunkLinearAttnFunction.apply, q, k, v, scale, initial_state, "
                                    "output_final_state, cu_seqlens, N, max_len)\n"), append(CHUNK, SIDE)]
FLA_MODULE = "fla/ops/delta_rule/chunk.py"
FLA_PLANT = [append(FLA_MODULE, SIDE + "\n\n_op = chunk_delta_rule\n\n\ndef chunk_delta_rule(*args, **kwargs):\n"
                                       "    return _on_side(_op, *args, **kwargs)\n")]


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "concurrency")


def test_run_time_disguise_passes_the_audit():
    assert_static_misses(MINI_PLANT)


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["minifla", "fla"])
def test_a_side_stream_named_at_run_time_is_blocked_on_the_gpu(target):
    if target == "fla" and not FLA_ROOT.is_dir():
        pytest.skip("real FLA is not at .fla/")
    subject, plant = (Subject(device="cuda"), MINI_PLANT) if target == "minifla" else (fla_subject(), FLA_PLANT)
    assert_probed(f"side-{target}", plant, "side-stream", subject=subject)
