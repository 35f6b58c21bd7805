"""Timed calls checked (docs/GUARD.md, timed-call-differs): in every round one timed call, drawn by
the orchestrator, is compared with the base's same call on the same inputs (the round's own draw).

Planted on minifla: ops whose results go wrong only once the op has been called more often than
the warm-up's checks and probes call it, or only inside the timing loop, with their state where the
static rules do not read it (a closure, an attribute of the op function or of the input tensor,
under names assembled at run time; the collector's state through a name assembled at run time).
Each test first shows that the static audit passes the plant, so what blocks it is the dynamic
layer. On the CPU the warm-up's candidate calls the op 13 times on the cell (6 at setup, 1 for the
differential check, 5 in the probes, 1 for the mutation probe) and a measuring one 7 at setup
before its settle sample; the samples are long (`--sample-ms 800`: k of 6 or more calls at
minifla's speed on a loaded interpreter), so every timed call of a measuring process is past the
count of 13. On a machine so slow that k falls to 5, the first call of the first pair is the 13th
(honest) one: where the orchestrator drew exactly that call the check must match, and the
self-check after the samples blocks the plant instead (`_counted`). The timing-loop plant is wrong
on every timed call. An honest change passes, and the record says what the check cost.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.cli import flaloop
from support.repos import OP, make_repo, planted

from flaloop.bench import timed
from flaloop.bench.model import Cell, CellResult
from flaloop.guard import dynamic

SHAPE = "B1_T64_H2_D32"
CHUNK = "minifla/ops/linear_attn/chunk.py"
QUICK = ["--device", "cpu", "--modes", "fwd", "--min-pairs", "6", "--max-pairs", "6", "--cell-seconds", "60",
         "--rounds", "1", "--unseen-shapes", "0", "--json"]
BENCH = [*QUICK, "--sample-ms", "800"]  # long samples: every timed call past the counters' limit
CALL = "    N, scale, max_len = check_inputs(q, k, v, scale, initial_state, cu_seqlens)\n"
WRONG = "        return torch.zeros_like(v), None\n"
# a name no static rule can read: 'calls' assembled from its character codes
NAME = "    _tag = ''.join(chr(c) for c in (99, 97, 108, 108, 115))\n"
LIMIT = 13

PLANTS = {
    # a call counter in a closure made at import (no global, no nonlocal, no mutable default)
    "counter-in-a-closure": (
        "def _ticker():\n"
        "    box = [0]\n"
        "\n"
        "    def tick():\n"
        "        box[0] = box[0] + 1\n"
        "        return box[0]\n"
        "    return tick\n"
        "\n"
        "\n"
        "_tick = _ticker()\n"
        "\n"
        "\n",
        CALL + f"    if _tick() > {LIMIT}:\n" + WRONG),
    # a call counter kept as an attribute of the op function itself
    "counter-on-the-function": (
        "",
        CALL + NAME + "    setattr(chunk_linear_attn, _tag, getattr(chunk_linear_attn, _tag, 0) + 1)\n"
        f"    if getattr(chunk_linear_attn, _tag) > {LIMIT}:\n" + WRONG),
    # a count of the times this very input tensor was seen, on the tensor
    "counter-on-the-input": (
        "",
        CALL + NAME + "    setattr(v, _tag, getattr(v, _tag, 0) + 1)\n"
        f"    if getattr(v, _tag) > {LIMIT}:\n" + WRONG),
    # inside the timing loop: the timers switch the garbage collector off around their window
    "inside-the-timing-loop": (
        "",
        CALL + "    if not getattr(gc, 'is' + 'enabled')():\n" + WRONG),
}
ANCHOR = "def chunk_linear_attn(\n"
IMPORTS = "import torch\n"


@pytest.fixture(scope="module")
def base_repo(tmp_path_factory):
    repo = make_repo(tmp_path_factory.mktemp("timed") / "minifla")
    r = flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd")
    assert r.code == 0, r.stderr
    return repo


def _planted(repo, name: str | None, honest: tuple[str, str] | None = None):
    p = repo / CHUNK
    text = p.read_text()
    if name is not None:
        head, body = PLANTS[name]
        assert text.count(CALL) == 1 and text.count(ANCHOR) == 1 and text.count(IMPORTS) == 1
        text = text.replace(ANCHOR, head + ANCHOR).replace(CALL, body).replace(IMPORTS, "import gc\n" + IMPORTS)
    if honest is not None:
        assert text.count(honest[0]) == 1
        text = text.replace(*honest)
    return p, text


def _run(repo, name: str | None, *commands, honest=None):
    with planted(*_planted(repo, name, honest)):
        return [flaloop(repo, *c) for c in commands]


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_results_wrong_only_on_timed_calls_are_blocked_by_the_timed_call_check(base_repo, name):
    bench = QUICK if name == "inside-the-timing-loop" else BENCH
    audit, r = _run(base_repo, name, ("audit", OP, "--json"), ("bench", OP, *bench))
    # the static rules do not read it: what blocks it below is the dynamic layer
    assert audit.code == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    assert not [f for f in audit.json["findings"] if f.get("blocking")], audit.json["findings"]
    assert r.code == 1, r.stdout[-2000:] + r.stderr[-3000:]
    doc = r.json
    [cell] = doc["cells"]
    assert cell["verdict"] == "BLOCKED", cell
    rules = {f["rule"] for f in doc["guard"]["findings"]}
    [check] = cell["probes"]["timed_calls"]
    if name != "inside-the-timing-loop" and _counted(check) <= LIMIT:  # drew the one honest timed call
        assert check["match"] is True and rules == {"self-check"}, (check, rules)
        return
    assert rules == {"timed-call-differs"}, rules  # the warm-up's checks and the probes passed it
    [f] = doc["guard"]["findings"]
    assert f["blocking"] and f["cell"] == f"{SHAPE}/fwd"
    assert "round 1, pair " in f["message"] and " of 6, call " in f["message"], f["message"]
    assert "out0 rel-RMS" in f["message"] and "same inputs" in f["message"]
    assert check["match"] is False and check["timer"] == "cpu" and 0 <= check["call"] < check["k"]
    assert check["sets"] == ["s0"] and check["worst"]["tensor"] == "s0:out0" and check["worst"]["rel_rms"] > 0.5
    tc = doc["guard"]["timed_calls"]
    assert tc["checked"] == 1 and tc["differ"] == 1


def _counted(check: dict) -> int:
    """The candidate's call count at the checked call: 7 at setup, the settle sample, the pairs
    before it, then its own."""
    return 7 + check["k"] * (1 + check["pair"]) + check["call"] + 1


def test_an_honest_change_passes_and_the_record_states_the_cost(base_repo):
    [r] = _run(base_repo, None, ("bench", OP, *QUICK), honest=("CHUNK_SIZE = 32\n", "CHUNK_SIZE = 16\n"))
    assert r.code == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = r.json
    [cell] = doc["cells"]
    assert cell["verdict"] != "BLOCKED" and not doc["guard"]["findings"]
    [check] = cell["probes"]["timed_calls"]
    assert check["match"] is True and check["round"] == 1 and 0 <= check["pair"] < check["of_pairs"] == 6
    assert check["k"] == cell["k"] >= 1 and 0 <= check["call"] < check["k"] and check["sets"] == ["s0"]
    tc = doc["guard"]["timed_calls"]
    assert tc["checked"] == 1 and tc["differ"] == 0 and len(tc["draw"]) == 12
    assert 0 < tc["seconds"] and 0 < tc["share"] < 0.2  # the cost, and its share of the run


# A path taken only while a CUDA graph is captured: each captured call gets a device counter of its
# own (taken from a buffer allocated by an eager call, so that the capture records no fill of it),
# which every replay of the graph increments; the output is zeroed once it passes 1. The graph proof
# replays once (the counter at 1: right); every later replay, all of them timed, is wrong. Eager
# calls never take the path, so the warm-up's checks and the probes see the honest op.
CAPTURED = CALL + NAME + (
    "    _o, _ht = ChunkLinearAttnFunction.apply(q, k, v, scale, initial_state, output_final_state,\n"
    "                                            cu_seqlens, N, max_len)\n"
    "    _pool = getattr(chunk_linear_attn, _tag, None)\n"
    "    if getattr(torch.cuda, 'is_current_stream_' + 'capturing')():\n"
    "        _c = _pool[0][_pool[1]:_pool[1] + 1]\n"
    "        _pool[1] = _pool[1] + 1\n"
    "        _c.add_(1)\n"
    "        _o = _o * (_c <= 1).to(_o.dtype)\n"
    "    elif _pool is None:\n"
    "        setattr(chunk_linear_attn, _tag, [torch.zeros(1 << 16, device=v.device), 0])\n"
    "    return _o, _ht\n")


@pytest.mark.gpu
def test_a_path_taken_only_while_captured_is_blocked_on_the_replays_it_times(base_repo):
    p = base_repo / CHUNK
    gpu = ["cuda" if a == "cpu" else a for a in QUICK]
    with planted(p, p.read_text().replace(CALL, CAPTURED)):
        audit = flaloop(base_repo, "audit", OP, "--json")
        r = flaloop(base_repo, "bench", OP, *gpu, env={"TRITON_INTERPRET": None})  # compiled kernels, graphs
    assert audit.code == 0 and not [f for f in audit.json["findings"] if f.get("blocking")], audit.stdout[-2000:]
    assert r.code == 1, r.stdout[-2000:] + r.stderr[-3000:]
    [cell] = r.json["cells"]
    assert cell["timer"] == "cuda_graph" and cell["verdict"] == "BLOCKED", cell
    blocking = {f["rule"] for f in r.json["guard"]["findings"] if f["blocking"]}
    assert blocking == {"timed-call-differs"}, r.json["guard"]["findings"]  # the proof and the probes passed it
    [check] = cell["probes"]["timed_calls"]
    assert check["match"] is False and check["timer"] == "cuda_graph" and check["worst"]["rel_rms"] > 0.5


def test_a_wrong_timed_call_cannot_be_allowed(base_repo):
    r = flaloop(base_repo, "audit", OP, "--allow", "timed-call-differs", "--why", "only the timed calls are off")
    assert r.code == 2 and "cannot be allowed" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_kept_call_is_uniform_over_the_pairs_a_round_takes():
    # a reservoir of one: whatever number of pairs the stopping rule ends at, each is kept alike
    n, trials = 6, 6000
    counts = [0] * n
    for _ in range(trials):
        kept = None
        for i in range(n):
            if timed.replaces(i):
                kept = i
        counts[kept] += 1
    assert all(abs(c - trials / n) < 200 for c in counts), counts  # about 7 standard deviations
    assert {timed.call_index(3) for _ in range(200)} == {0, 1, 2} and timed.call_index(None) == 0
    assert timed.draw("ab", 0) == "ab:r1" != timed.draw("ab", 1) and timed.run_salt() != timed.run_salt()


def test_the_finding_names_the_cell_round_pair_call_and_error():
    worst = {"tensor": "s0:out0", "rel_rms": 0.93, "shape": [1, 64, 2, 32], "shape_ref": [1, 64, 2, 32]}
    at = {"round": 2, "pair": 3, "call": 4, "k": 9, "timer": "cpu", "of_pairs": 10}
    f = dynamic.timed_call_finding("B1_T64_H2_D32/fwd", at, worst, 0.005)
    assert f.rule == "timed-call-differs" and f.blocking and f.cell == "B1_T64_H2_D32/fwd"
    assert f.message.startswith("round 2, pair 4 of 10, call 5 of 9: ") and "s0:out0 rel-RMS 0.93" in f.message
    g = dynamic.timed_call_finding("c", {**at, "timer": "cuda_graph"}, {**worst, "missing": "self"}, 0.005, aa=True)
    assert "the graph's replay" in g.message and "missing on the candidate" in g.message and not g.blocking


class _Pair:
    """The two workers of a round as `timed.check` talks to them: the candidate dumps its kept call,
    the base compares it with its own and answers `compare`."""

    def __init__(self, tmp_path, compare: dict, aa: bool = False):
        self.run_dir, self.round, self.allowed, self.asked = tmp_path, 1, [], []
        self.cfg = SimpleNamespace(worker_timeout=60, diff_tol=0.005, aa=aa)
        self.out = SimpleNamespace(transfer={"how": "file"}, timed_calls={"checked": 0, "differ": 0, "seconds": 0.0})
        self.results = [CellResult(Cell("B1_T64_H2_D32", {"B": 1, "T": 64, "H": 2, "D": 32}, "fwd", "bfloat16"))]
        self.compare = compare

    def ask(self, side, cmd, timeout, **payload):
        self.asked.append((side, cmd, payload))
        return {"ok": True, "path": payload.get("path")} if cmd == "dump" else {"ok": True, **self.compare}

    def fail(self, res, side, reply):
        res.status = "failed"


def _tensor(rel: float, nonfinite_self: int = 0, nonfinite_ref: int = 0) -> dict:
    return {"rel_rms": rel, "max_abs": rel, "shape": [1], "shape_ref": [1], "nonfinite_self": nonfinite_self,
            "nonfinite_ref": nonfinite_ref, "missing": None, "match": rel <= 0.005 and not nonfinite_self + nonfinite_ref}


@pytest.mark.parametrize("case", ["match", "differs", "base-nonfinite", "aa"])
def test_the_base_judges_the_candidates_kept_call(tmp_path, case):
    t = {"match": _tensor(0.0), "differs": _tensor(0.7, nonfinite_self=3), "base-nonfinite": _tensor(0.0, 0, 2),
         "aa": _tensor(0.01)}[case]
    s = _Pair(tmp_path, {"match": t["match"], "tol": 0.005, "sets": ["s0"], "tensors": {"s0:out0": t}}, aa=case == "aa")
    res = s.results[0]
    at = {"round": 1, "pair": 2, "call": 0, "k": 3, "timer": "cpu", "of_pairs": 8}
    assert timed.check(s, res, at) is (case != "differs")
    # the candidate dumps what it kept, and the base, not the candidate, compares
    assert [(side, cmd) for side, cmd, _ in s.asked] == [("cand", "dump"), ("base", "compare")]
    assert all(p.get("kept") is True for _, _, p in s.asked)
    [entry] = res.probes["timed_calls"]
    assert entry["pair"] == 2 and entry["worst"]["tensor"] == "s0:out0"
    tc = s.out.timed_calls
    if case == "base-nonfinite":  # the draw is outside the op's domain for the base: not judged
        assert "non-finite" in entry["skipped"] and tc["skipped"] == 1 and tc["checked"] == 0 and not res.findings
    elif case == "match":
        assert tc["checked"] == 1 and tc["differ"] == 0 and not res.findings
    else:
        [f] = res.findings
        assert f.rule == "timed-call-differs" and tc["differ"] == 1
        assert f.blocking is (case == "differs") and (res.status == "blocked") is (case == "differs")
        assert "3 non-finite" in f.message if case == "differs" else "A/A" in f.message
