"""Inputs kept resident in L2 across timed calls: a persisting-L2 limit and an access-policy
window outlive the cache flush (pygpubench PR #49). The static rules read driver access and the
L2 tokens; on a GPU the worker reads the persisting limit and the stream's window after the calls."""

import pytest
from corpus import (
    CALL,
    CHUNK,
    FLA_ROOT,
    TOP,
    Subject,
    after,
    append,
    assert_static,
    assert_static_misses,
    fla_subject,
    probed,
)

STATIC = {
    "ctypes-cudart": [after(CHUNK, TOP, "import ctypes\n_rt = ctypes.CDLL('libcudart.so')\n")],
    "access-policy-window": [after(CHUNK, CALL, "    attr.accessPolicyWindow.hitRatio = 1.0\n")],
}

# The CUDA runtime the process loaded, found in /proc/self/maps and opened through ctypes, every
# name built at run time; the persisting-L2 limit (cudaLimitPersistingL2CacheSize = 6) set to 4 MiB.
PERSIST = '''

def _persist():
    _ct = vars(torch)['__builtins__']['__im' + 'port__']('ct' + 'ypes')
    with open('/'.join(('', 'proc', 'self', 'maps'))) as fh:
        libs = sorted({line.split()[-1] for line in fh if 'cud' + 'art' in line})
    rt = getattr(_ct, 'CD' + 'LL')(libs[0] if libs else 'libcud' + 'art.so.12')
    getattr(rt, 'cudaDevice' + 'SetLimit')(6, 4 << 20)
'''
MINI_PLANT = [after(CHUNK, CALL, "    _persist()\n"), append(CHUNK, PERSIST)]
# FLA: the op's module gets a wrapper that calls the plant, appended after its definition
FLA_MODULE = "fla/ops/delta_rule/chunk.py"
FLA_PLANT = [append(FLA_MODULE, PERSIST + "\n\n_op = chunk_delta_rule\n\n\ndef chunk_delta_rule(*args, **kwargs):\n"
                                          "    _persist()\n    return _op(*args, **kwargs)\n")]


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "driver-l2")


def test_run_time_disguise_passes_the_audit():
    assert_static_misses(MINI_PLANT)


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["minifla", "fla"])
def test_a_persisting_l2_limit_set_through_names_built_at_run_time_is_blocked_on_the_gpu(target):
    if target == "fla" and not FLA_ROOT.is_dir():
        pytest.skip("real FLA is not at .fla/")
    subject, plant = (Subject(device="cuda"), MINI_PLANT) if target == "minifla" else (fla_subject(), FLA_PLANT)
    r = probed(f"l2-{target}", plant, subject=subject)
    if ((r.probes.get("base") or {}).get("l2") or {}).get("max_persisting_bytes") == 0:
        pytest.skip("this GPU sets no L2 aside for persisting accesses (a MIG slice, say): the plant has no effect")
    assert "l2-persisting" in r.blocking, r.show()
