"""The self-check: each measuring process, after its timed samples, recomputes set 0 (one more
eager call, and a call on inputs changed in place; under the graph timer also one more replay) and
compares with what it computed at setup. Planted on minifla: behaviour that changes after the op
has been called a number of times, counted where no static rule and no module state holds it (on
the input tensor itself, under a name built at run time; in the process's environment). The
warm-up's checks and probes see the honest path (they stop well before the count); the timed
samples see the other one. An honest change passes."""

from __future__ import annotations

import pytest
from support.cli import flaloop
from support.repos import OP, make_repo, planted

SHAPE = "B1_T64_H2_D32"
CHUNK = "minifla/ops/linear_attn/chunk.py"
BENCH = ["--device", "cpu", "--modes", "fwd", "--min-pairs", "8", "--max-pairs", "8", "--cell-seconds", "30",
         "--rounds", "1", "--json"]
CALL = "    N, scale, max_len = check_inputs(q, k, v, scale, initial_state, cu_seqlens)\n"
# The warm-up's process calls the op about 13 times on set 0 (setup, the comparison, the probes);
# a measuring process about 14 before its first sample and 25 or more by the end of 8 pairs.
PLANTS = {
    # counted on the input tensor itself, under an attribute name assembled at run time; then a
    # "skipped" computation that returns zeros fast
    "count-on-the-input": CALL + (
        "    _tag = ''.join(chr(c) for c in (95, 110, 99, 97, 108, 108, 115))\n"
        "    setattr(q, _tag, getattr(q, _tag, 0) + 1)\n"
        "    if getattr(q, _tag) > 3 * 6:\n"
        "        return torch.zeros_like(v), None\n"),
    # the last result kept in the key tensor's own __dict__ (through vars(), under a name assembled
    # at run time), served again once that tensor has been seen often enough
    "stored-on-the-key": CALL + (
        "    _d = vars(k)\n"
        "    _name = 'x'.join(('', 'memo', ''))\n"
        "    _seen = _d.setdefault(_name, [0, None])\n"
        "    _seen[0] += 1\n"
        "    if _seen[0] > 18 and _seen[1] is not None:\n"
        "        return _seen[1], None\n"
        "    _out, _fin = ChunkLinearAttnFunction.apply(q, k, v, scale, initial_state, output_final_state,\n"
        "                                               cu_seqlens, N, max_len)\n"
        "    _seen[1] = _out.detach().clone()\n"
        "    return _out, _fin\n"),
}


@pytest.fixture(scope="module")
def base_repo(tmp_path_factory):
    repo = make_repo(tmp_path_factory.mktemp("selfcheck") / "minifla")
    r = flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd")
    assert r.code == 0, r.stderr
    return repo


def _bench(repo, plant: str | None, honest: tuple[str, str] | None = None):
    p = repo / CHUNK
    text = p.read_text()
    if plant is not None:
        assert text.count(CALL) == 1
        text = text.replace(CALL, plant)
    if honest is not None:
        assert text.count(honest[0]) == 1
        text = text.replace(*honest)
    with planted(p, text):
        return flaloop(repo, "bench", OP, *BENCH)


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_behaviour_that_changes_after_the_checks_is_blocked_by_the_self_check(base_repo, name):
    r = _bench(base_repo, PLANTS[name])
    assert r.code == 1, r.stdout[-2000:] + r.stderr[-3000:]
    doc = r.json
    [cell] = doc["cells"]
    assert cell["verdict"] == "BLOCKED", cell
    rules = {f["rule"] for f in doc["guard"]["findings"]}
    assert rules == {"self-check"}, rules  # nothing else saw it: the warm-up's checks and probes passed
    [f] = [f for f in doc["guard"]["findings"] if f["rule"] == "self-check"]
    assert f["blocking"] and f["cell"] == f"{SHAPE}/fwd" and "after the timed samples" in f["message"]
    # zeros show on any call; a stored result only once the inputs change under it
    reading = {"count-on-the-input": "one more eager call", "stored-on-the-key": "a call on inputs changed in place"}
    assert f"{reading[name]} differs from setup's" in f["message"] and "rel-RMS" in f["message"]
    [check] = cell["probes"]["self_check"]
    assert check["base"]["match"] is True and check["cand"]["match"] is False


def test_an_honest_change_passes_the_self_check_and_the_record_keeps_it(base_repo):
    r = _bench(base_repo, None, honest=("CHUNK_SIZE = 32\n", "CHUNK_SIZE = 16\n"))
    assert r.code == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = r.json
    [cell] = doc["cells"]
    assert cell["verdict"] != "BLOCKED" and not doc["guard"]["findings"]
    [check] = cell["probes"]["self_check"]
    assert check["round"] == 1
    for side in ("base", "cand"):
        assert check[side]["match"] is True and check[side]["seconds"] > 0
        assert set(check[side]["checks"]) == {"eager", "mutated"}  # no graph on the CPU
        assert all(t["match"] for c in check[side]["checks"].values() for t in c["tensors"].values())


def test_no_probes_means_no_self_check(base_repo):
    # the same plant with --no-probes: measured, not checked, and the record says the probes were off
    p = base_repo / CHUNK
    with planted(p, p.read_text().replace(CALL, PLANTS["count-on-the-input"])):
        r = flaloop(base_repo, "bench", OP, *BENCH, "--no-probes")
    assert r.code in (0, 1), r.stderr[-2000:]
    [cell] = r.json["cells"]
    assert "self_check" not in (cell.get("probes") or {}) and r.json["guard"]["probes"] is False
