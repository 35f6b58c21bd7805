"""Autotune picks and rounds: what a worker reports Triton chose, how the session compares the
two sides, and how fresh-process rounds keep a per-process effect from becoming a verdict."""

from __future__ import annotations

import json

from support.cli import flaloop
from support.repos import commit_all

# A toy op whose speed depends on the process, not the code: the first process to call it in
# each pair of processes stalls for 60 ms per call (a sleep: CPU contention from other tests
# cannot shrink it, and the toy's own call takes well under a millisecond, so a stalled side reads
# tens of times slower; the rounds' checks ask for 3x). The same committed code runs on both sides
# (A/A). TOY_WITH_STALL takes the rule for which process stalls (a `_slow()` that sets the global
# _SLOW) at __SLOW__, the stall in seconds at __STALL__, and the file that counts the processes at
# __ORDER_FILE__ (in the source, committed: a variable of the environment would give each test a
# fork-server key of its own, and spawned workers).
TOY_WITH_STALL = '''import fcntl
import os
import time

import torch

_SLOW = None


__SLOW__


def _attn(q, k, v, scale):
    a = torch.einsum('bthd,bshd->bhts', q.float(), k.float()) * scale
    return torch.einsum('bhts,bshd->bthd', a.tril(), v.float())


def toy_attn(q, k, v, scale=None, cu_seqlens=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = _attn(q, k, v, scale)
    if _slow():  # a stall, as a process that drew worse memory or started cold might have
        time.sleep(__STALL__)
    return o.to(q.dtype), None


def toy_log(q):
    return (q.float().log() + 1).to(q.dtype), None
'''

ORDER_SENSITIVE = TOY_WITH_STALL.replace("__SLOW__", '''def _slow():
    """True in the 1st, 3rd, 5th... process to call the op (counted in the order file)."""
    global _SLOW
    if _SLOW is None:
        with open(__ORDER_FILE__, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            n = len(f.read().split())
            f.write(f"{os.getpid()}\\n")
        _SLOW = n % 2 == 0
    return _SLOW''').replace("__STALL__", "0.06")


def toy_op(toy, src: str, order_file) -> None:
    """Commit `src` as the toy's op, counting its processes in `order_file`."""
    (toy / "toyop/ops/toy/fast.py").write_text(src.replace("__ORDER_FILE__", repr(str(order_file))))
    commit_all(toy)


def test_rounds_in_fresh_processes_keep_a_per_process_effect_from_a_false_verdict(toy, tmp_path):
    toy_op(toy, ORDER_SENSITIVE, tmp_path / "order1")
    args = ["bench", "toy_attn", "--aa", "--base", "HEAD", "--json", "--device", "cpu", "--modes", "fwd", "--unseen-shapes", "0",
            "--min-pairs", "12", "--max-pairs", "12", "--cell-seconds", "60"]

    one = flaloop(toy, *args, "--rounds", "1")
    assert one.code == 0, one.stderr[-2000:]
    (cell,) = json.loads(one.stdout)["cells"]
    # one pair of processes: identical code reads as a large win
    assert cell["verdict"] == "FASTER" and cell["estimate"]["speedup"] > 3

    toy_op(toy, ORDER_SENSITIVE, tmp_path / "order2")
    two = flaloop(toy, *args, "--max-rounds", "2")
    assert two.code == 0, two.stderr[-2000:]
    rec = json.loads(two.stdout)
    (cell,) = rec["cells"]
    assert len(rec["rounds"]) == 2 and set(rec["rounds"][0].values()).isdisjoint(rec["rounds"][1].values())
    assert sorted({p["round"] for p in cell["pairs"]}) == [0, 1]
    first, second = cell["rounds"]
    assert first["speedup"] > 3 and second["speedup"] < 1 / 3  # the slow process swapped sides
    assert cell["rounds_disagree"] is True and cell["verdict"] == "UNSURE"
    assert len((tmp_path / "order2").read_text().split()) == 6  # two per round, and the warm-up pair
    # round 2 mirrors round 1: the side that set up first samples first (ABAB..., then BABA...),
    # after a settle pair that the setup record keeps and the estimate leaves out
    set_up_first = {b["round"]: b["side"] for b in reversed(cell["setup"]["placements"])}
    assert set_up_first == {1: "base", 2: "cand"}
    for rnd, lead in ((0, "AB"), (1, "BA")):
        orders = [p["order"] for p in cell["pairs"] if p["round"] == rnd]
        assert orders == [lead, lead[::-1]] * (len(orders) // 2), orders
    assert [(s["round"], s["order"]) for s in cell["setup"]["settle"]] == [(1, "AB"), (2, "BA")]
    assert all(s["base_ms"] > 0 and s["cand_ms"] > 0 for s in cell["setup"]["settle"])
    assert sum(1 for p in cell["pairs"] if p["dropped"] is None) == sum(r["n_pairs"] for r in cell["rounds"])


def test_a_cell_whose_rounds_disagree_gets_two_more_rounds_of_equal_size(toy, tmp_path):
    toy_op(toy, ORDER_SENSITIVE, tmp_path / "order")
    r = flaloop(toy, "bench", "toy_attn", "--aa", "--base", "HEAD", "--json", "--device", "cpu", "--modes", "fwd", "--unseen-shapes", "0",
                "--min-pairs", "8", "--max-pairs", "40", "--cell-seconds", "60")
    assert r.code == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout)
    (cell,) = rec["cells"]
    assert rec["contested"] == [cell["cell"]["id"]]
    assert len(rec["rounds"]) == 4 and len({pid for rnd in rec["rounds"] for pid in rnd.values()}) == 8
    assert len((tmp_path / "order").read_text().split()) == 10  # and the warm-up pair, which measures nothing
    # every round took as many pairs as the first, so each pair of processes weighs the same
    sizes = [x["n_pairs"] for x in cell["rounds"]]
    assert len(sizes) == 4 and len(set(sizes)) == 1, sizes
    # the slow process alternates sides: rounds 1 and 3 read >3x, rounds 2 and 4 <1/3x
    assert [x["speedup"] > 1 for x in cell["rounds"]] == [True, False, True, False]
    assert cell["verdict"] not in ("FASTER", "SLOWER")


# A toy op whose first call in a process "compiles": the process that finds no entry in the
# Triton cache adds one and then runs 150 ms slower per call; a process that loads it does not.
COMPILES_SLOW = TOY_WITH_STALL.replace("__SLOW__", '''def _slow():
    """True in a process that had to add the toy kernel to the Triton cache."""
    global _SLOW
    if _SLOW is None:
        entry = os.path.join(os.environ["TRITON_CACHE_DIR"], "TOYKERNEL")
        try:
            os.makedirs(entry)
            _SLOW = True
        except FileExistsError:
            _SLOW = False
        with open(__ORDER_FILE__, "a") as f:
            f.write(f"{os.getpid()} {int(_SLOW)}\\n")
    return _SLOW''').replace("__STALL__", "0.15")


def test_workers_that_compiled_during_the_warm_up_are_replaced_before_the_first_pair(toy, tmp_path):
    toy_op(toy, COMPILES_SLOW, tmp_path / "calls")
    cache = tmp_path / "triton-cache"
    env = {"FLALOOP_TRITON_CACHE_DIR": str(cache)}
    args = ["bench", "toy_attn", "--aa", "--base", "HEAD", "--json", "--device", "cpu", "--modes", "fwd", "--unseen-shapes", "0",
            "--min-pairs", "8", "--max-pairs", "8", "--cell-seconds", "60"]
    r = flaloop(toy, *args, env=env)
    assert r.code == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout)
    (cell,) = rec["cells"]
    assert rec["primed"]["new_cache_entries"] == 1
    slow = [line.split()[0] for line in (tmp_path / "calls").read_text().splitlines() if line.endswith(" 1")]
    assert len(slow) == 1 and int(slow[0]) in rec["primed"]["discarded"].values()
    measuring = {pid for rnd in rec["rounds"] for pid in rnd.values()}
    assert measuring.isdisjoint(rec["primed"]["discarded"].values())
    # no measured process is the slow one: no per-call time holds the 150 ms stall (CPU noise
    # on a loaded 2-core machine moves calls by tens of ms, never by the stall)
    worst = max(max(p["base_ms"], p["cand_ms"]) for p in cell["pairs"])
    assert len(cell["pairs"]) >= 8 and worst < 120, worst
    # and they calibrated k themselves (the warm-up's k = 1 came from the stalled process)
    assert cell["setup"]["k_warmup"] == 1 and cell["k"] >= 1

    again = flaloop(toy, *args, env=env)  # the cache is warm: nothing to replace
    assert again.code == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["primed"] is None


def test_rounds_below_one_is_a_usage_error(toy):
    r = flaloop(toy, "bench", "toy_attn", "--device", "cpu", "--rounds", "0")
    assert r.code == 2 and "--rounds 0" in r.stderr
    r = flaloop(toy, "bench", "toy_attn", "--device", "cpu", "--max-rounds", "-1")
    assert r.code == 2 and "--max-rounds -1" in r.stderr
    r = flaloop(toy, "bench", "toy_attn", "--device", "cpu", "--placements", "0")
    assert r.code == 2 and "--placements 0" in r.stderr
