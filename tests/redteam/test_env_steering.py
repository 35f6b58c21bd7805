"""The environment steered from inside the op: compiler defaults (`TRITON_F32_DEFAULT`), backend
switches, test leniency (`FLA_CI_ENV`), set for both sides at once or only where the op runs (FLA
chunk_delta_rule on an H200: `TRITON_F32_DEFAULT` set at import went through gate and bench)."""

import pytest
from corpus import CALL, CHUNK, END_INIT, INIT, TOP, after, assert_probed, assert_static, assert_static_misses

STATIC = {
    "env-write-in-init": ([after(INIT, END_INIT, "import os\nos.environ['MINIFLA_FAST'] = '1'\n")], "env-write"),
    "putenv-aliased": ([after(CHUNK, TOP, "from os import putenv as _pe\n_pe('MINIFLA_FAST', '1')\n")], "env-write"),
    "triton-f32-default": ([after(CHUNK, TOP, "import os\nos.environ['TRITON_F32_DEFAULT'] = 'tf32'\n")], "numeric-tf32"),
}

DYNAMIC = {
    # the mapping and the key built at run time, on the first call
    "triton-default-by-run-time-names": [after(CHUNK, CALL, "    getattr(__import__('os'), 'envi' + 'ron')"
                                                            "['TRITON_' + 'F32_DEFAULT'] = 'tf' + '32'\n")],
    # test leniency, through the mapping's update method named at run time, at import
    "fla-leniency-by-update": [after(CHUNK, TOP, "getattr(getattr(__import__('os'), 'envi' + 'ron'), 'upd' + 'ate')"
                                                 "({'FLA_' + 'CI_ENV': '1'})\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    edits, rule = STATIC[name]
    assert_static(edits, rule)


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_run_time_disguise_passes_the_audit_and_the_settings_probe_blocks_it(name):
    assert_static_misses(DYNAMIC[name])
    assert_probed(name, DYNAMIC[name], "numeric-settings")
