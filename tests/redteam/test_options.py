"""A kernel wrong only behind a keyword option the registry's call never sets is blocked by the
unseen-shape draw's options (bench/options.py, `unseen-option-differs`): the bench's cells and the
unseen shapes call the op the registry's way (no initial state, no final state) and match.

Both plants are in a copy of examples/minifla with no recorded test calls (the replay of the test's
own calls is off, and says so), so the options alone must find them; no static rule reads them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import flaloop
from support.repos import OP, edit

CHUNK = Path("minifla/ops/linear_attn/chunk.py")
QUICK = ["--device", "cpu", "--modes", "fwd", "--min-pairs", "6", "--max-pairs", "8", "--cell-seconds", "20",
         "--rounds", "1"]
PLANTS = {
    # the final state's gradient dropped: only a backward through the final state sees it
    "final-state-gradient-dropped": ("USE_FINAL_STATE_GRADIENT=dht is not None,", "USE_FINAL_STATE_GRADIENT=False,"),
    # the initial state half counted in the forward: only a call that passes one sees it
    "initial-state-halved": ("        b_S += tl.load(h0 + p_state, mask=m_kv, other=0.).to(tl.float32)",
                             "        b_S += 0.5 * tl.load(h0 + p_state, mask=m_kv, other=0.).to(tl.float32)"),
}
NEEDS = {"final-state-gradient-dropped": ("output_final_state", True), "initial-state-halved": ("initial_state", "tensor")}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_kernel_wrong_only_behind_an_option_the_registry_never_sets_is_blocked(repo, plant):
    edit(repo / CHUNK, *PLANTS[plant])
    assert flaloop(repo, "audit", OP, "--json").json["findings"] == []
    r = flaloop(repo, "bench", OP, "--json", *QUICK)
    assert r.code == 1, r.stderr[-3000:]
    rec = r.json
    assert "no test calls recorded at the base" in rec["test_calls"]["off"]
    u = rec["unseen"]
    assert u["differ"] == 0 and u["checked"] == 8  # the registry's way: right everywhere
    assert all(c["diff"]["match"] is True for c in rec["cells"])
    o = u["options"]
    # no test calls: scale has no value but its default to vary, and two bools-or-tensors give three combinations
    assert o["off"] is None and [p["name"] for p in o["params"]] == ["initial_state", "output_final_state"]
    assert [x["name"] for x in o["left_out"]] == ["scale"] and len(o["combos"]) == 3
    name, value = NEEDS[plant]
    for c in o["combos"]:  # wrong exactly where the plant's option is on, and the record says which
        assert c["status"] == ("differs" if c["options"][name] == value else "match"), c
        assert c["shape"] in {s["name"] for s in u["shapes"]}
    found = [f for f in rec["guard"]["findings"] if f["rule"] == "unseen-option-differs"]
    assert found and all(f["blocking"] for f in found) and len(found) == o["differ"]
    assert all(f"{name}={value}" in f["message"] for f in found)
    assert all(c["status"] == "blocked" for c in rec["cells"])
    r = flaloop(repo, "audit", OP, "--allow", "unseen-option-differs", "--why", "nobody uses an initial state")
    assert r.code == 2 and "cannot be allowed" in r.stdout + r.stderr
