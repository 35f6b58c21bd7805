"""How the session judges what the workers report, for the probes a CPU cannot exercise (CUDA-graph
timers, streams, persisting L2, the roofline): pure functions over synthetic reports, each rule
firing on the candidate's behaviour and never on behaviour the base shares."""

from __future__ import annotations

import math

from flaloop.bench.analysis import analyse
from flaloop.bench.model import Cell, CellResult, Pair
from flaloop.guard import dynamic as judge


def pairs(base_ms: float, cand_ms: float, base_gap: float, cand_gap: float, n: int = 12) -> list[Pair]:
    """n pairs whose wall time exceeds the device time by a gap per call on each side (tiny jitter),
    each seen alone on the GPU."""
    out = []
    for i in range(n):
        j = 1 + 0.001 * ((i % 3) - 1)
        out.append(Pair("AB" if i % 2 == 0 else "BA", base_ms * j, cand_ms * j, None, None,
                        base_wall_ms=base_ms * j + base_gap, cand_wall_ms=cand_ms * j + cand_gap, foreign=[]))
    return out


def test_a_timer_that_under_reports_leaves_a_wall_gap_on_its_side_only():
    # 0.1 ms per call, k = 100 calls per sample; the replay costs ~10 us per sample on each side
    honest = pairs(0.100, 0.080, base_gap=0.0001, cand_gap=0.0001)  # a real 1.25x: both gaps alike
    assert judge.timer_wall_gap("c", honest, k=100, timer="cuda_graph") is None
    lying = pairs(0.100, 0.080, base_gap=0.0001, cand_gap=0.0201)  # the events say 0.08, 0.1 elapsed
    f = judge.timer_wall_gap("c", lying, k=100, timer="cuda_graph")
    assert f is not None and f.rule == "timer-wall-gap" and f.blocking
    # a 1% lie is past the tolerance; the eager timer (host-bound walls) is never judged this way
    assert judge.timer_wall_gap("c", pairs(0.1, 0.099, 0.0001, 0.0011), k=100, timer="cuda_graph").blocking
    assert judge.timer_wall_gap("c", lying, k=100, timer="cuda_eager") is None


def eager(base: list[float], cand: list[float], host: float = 0.1) -> dict:
    return {"base": {"wall_ms": base, "host_ms": [host] * len(base)},
            "cand": {"wall_ms": cand, "host_ms": [host] * len(cand)}}


def test_a_device_win_the_eager_wall_time_does_not_show_is_flagged_unless_launch_bound():
    steady = [1.0, 1.002, 0.998, 1.001, 0.999, 1.0]
    none = eager(steady, [0.99 * x for x in steady])
    f = judge.eager_disagrees("c", 1.25, none)
    assert f is not None and f.rule == "eager-disagrees" and f.blocking
    assert judge.eager_disagrees("c", 1.25, eager(steady, [0.8 * x for x in steady])) is None
    assert judge.eager_disagrees("c", 1.25, eager(steady, [0.99 * x for x in steady], host=0.9)) is None  # launch-bound
    assert judge.eager_disagrees("c", 1.02, none) is None  # too small to judge on 6 eager samples


def _report(**over) -> dict:
    rep = {"outputs": {"subclass": [], "aliases_input": [], "changed_after_sync": []},
           "determinism": {"bitwise": True, "max_rel_diff": 0.0}, "poison": {"nonfinite": {"out0": 0}},
           "census": {"triton_launches": {"k": 3}, "library_ops": {}, "library_kernels": {}, "own_gpu_kernels": 3,
                      "n_streams": 1},
           "l2": {"checked": True, "persisting_limit_bytes": 11796480, "window_bytes": 0},
           "numeric": {"flags": {"cuda.matmul.allow_tf32": "False"}, "triton": {}, "env": {}}}
    for key, value in over.items():
        rep[key] = {**rep[key], **value}
    return rep


def rules(base: dict, cand: dict, aa: bool = False) -> set[str]:
    return {f.rule for f in judge.cell_findings("c", base, cand, None, 0.005, aa=aa) if f.blocking}


def test_l2_side_streams_library_kernels_and_settings_fire_on_the_candidate_only():
    base = _report()
    assert rules(base, _report()) == set()
    assert rules(base, _report(l2={"window_bytes": 1 << 26})) == {"l2-persisting"}
    assert rules(base, _report(l2={"persisting_limit_bytes": 1 << 30})) == {"l2-persisting"}
    # a base that reads a limit set aside (11.25 MiB on the H200): lowering it is a change of the device's setting too
    assert rules(base, _report(l2={"persisting_limit_bytes": 7864320})) == {"l2-persisting"}
    assert rules(base, _report(census={"n_streams": 2})) == {"side-stream"}
    assert rules(base, _report(census={"library_kernels": {"sm90_xmma_gemm_bf16": 2}})) == {"library-compute"}
    assert rules(base, _report(census={"triton_launches": {}, "own_gpu_kernels": 0})) == {"no-own-kernel"}
    tf32 = _report(numeric={"flags": {"cuda.matmul.allow_tf32": "True"}})
    assert rules(base, tf32) == {"numeric-settings"}
    # what the base does too is not held against the candidate
    two_streams = _report(census={"n_streams": 2})
    assert rules(two_streams, two_streams) == set()
    assert rules(tf32, tf32) == set()
    # an A/A never judges the candidate (it runs the base's code)
    assert rules(base, tf32, aa=True) == set()


def test_every_kernel_moved_to_one_side_stream_is_side_work_and_the_marker_is_not_counted():
    from flaloop.inside.worker.probes import MARKER_KERNEL, census_of

    def kernel(name, stream, ts):
        return {"cat": "kernel", "name": name, "args": {"stream": stream}, "ts": ts}

    marker = kernel(f"at::cuda::{MARKER_KERNEL}(long)", 7, 0)
    base = census_of([marker, kernel("chunk_fwd", 7, 5), kernel("chunk_o", 7, 9)], {}, marked=True)
    # the op's every kernel on one new stream: one stream, as the base has, but not the calling one
    moved = census_of([kernel("chunk_o", 21, 9), marker, kernel("chunk_fwd", 21, 5)], {}, marked=True)
    assert base["n_streams"] == moved["n_streams"] == 1
    assert (base["calling_stream"], base["side_stream_kernels"]) == (7, {})
    assert (moved["calling_stream"], moved["side_stream_kernels"]) == (7, {"21": 2})
    assert moved["own_gpu_kernels"] == 2 and MARKER_KERNEL not in str(moved["kernels"])
    assert rules(_report(census=base), _report(census=moved)) == {"side-stream"}
    # the base's own side stream is its behaviour; one more on the candidate is not
    assert rules(_report(census=moved), _report(census=moved)) == set()
    more = census_of([marker, kernel("a", 21, 5), kernel("b", 22, 6)], {}, marked=True)
    assert rules(_report(census=moved), _report(census=more)) == {"side-stream"}
    # no marker (a torch without it): the first kernel's stream stands for the calling one
    assert census_of([kernel("a", 3, 1), kernel("b", 4, 2)], {}, marked=False)["side_stream_kernels"] == {"4": 1}
    # a candidate without any kernel has no own kernel, whatever the marker launched
    assert census_of([marker], {}, marked=True)["own_gpu_kernels"] == 0


def test_a_persisting_limit_is_judged_when_the_window_could_not_be_read():
    refused = {"checked": True, "persisting_limit_bytes": 0, "window_bytes": None}
    set_limit = {**refused, "persisting_limit_bytes": 4 << 20}
    assert rules(_report(l2=refused), _report(l2=set_limit)) == {"l2-persisting"}
    assert rules(_report(l2=refused), _report(l2=refused)) == set()
    # a read that failed on the candidate is no reading, not a zero and not a finding
    unread = {"checked": True, "persisting_limit_bytes": None, "window_bytes": 0}
    assert rules(_report(l2=set_limit), _report(l2=unread)) == set()


def test_integrity_violations_the_base_shares_are_the_libraries_not_a_cheat():
    shared = "torch.manual_seed was replaced (now defined in .../torch/_compile.py)"  # seen on the H200
    assert judge.integrity([shared], [shared]) == []
    (f,) = judge.integrity([shared], [shared, "torch.cuda.streams.Event.elapsed_time was replaced"])
    assert f.rule == "timer-patched" and f.blocking
    assert judge.integrity([], ["x was replaced"], aa=True) == []


def test_a_cell_faster_than_its_roofline_floor_is_below_floor():
    f = judge.below_floor("c", cand_ms=0.004, floor_ms=0.008, base_ms=0.02)
    assert f is not None and f.rule == "below-floor" and f.blocking
    assert "measured 0.004 ms" in f.message and "floor 0.008 ms" in f.message and "2.00x below" in f.message
    assert judge.below_floor("c", cand_ms=0.0079, floor_ms=0.008) is None  # within the 5% slack
    assert judge.below_floor("c", cand_ms=0.09, floor_ms=0.008) is None
    # the base below the floor too, or a floor that is not a bound for this cell: named, not blocking
    assert not judge.below_floor("c", 0.004, 0.008, base_ms=0.005).blocking
    assert not judge.below_floor("c", 0.004, 0.008, 0.02, uncertain="no measured ceilings").blocking


def test_one_near_zero_cell_cannot_hide_in_the_geomean():
    """A geomean leaning on one cell says so (without_best_cell), and a blocking finding on a cell
    turns its verdict into BLOCKED whatever it measured."""
    results = []
    for i, ratio in enumerate((1.0, 1.0, 1.0, 0.01)):  # the last cell: 100x 'faster'
        r = CellResult(Cell(f"S{i}", {"B": 1}, "fwd"))
        r.status = "ok"
        r.pairs = [Pair("AB" if j % 2 == 0 else "BA", 1.0, ratio * (1 + 0.001 * (j % 3)), None, None)
                   for j in range(12)]
        results.append(r)
    results[3].findings = [judge.below_floor("S3/fwd", 0.01, 0.5)]
    summary = analyse(results, margin=0.005).to_dict()
    geo = summary["geomean"]
    assert geo["speedup"] > 3 and math.isclose(geo["without_best_cell"], 1.0, rel_tol=0.01)
    assert geo["best_cell_id"] == "S3/fwd"
    assert results[3].verdict == "BLOCKED" and summary["n_blocked"] == 1
    assert "below-floor" in results[3].reason


def test_a_clear_win_on_unchanged_code_is_implausible_and_beside_a_load_only_unsure():
    quiet = pairs(1.0, 0.5, 0.0, 0.0)
    f = judge.same_code_speedup("c", 2.0, 1.9, quiet)
    assert f.rule == "implausible-speedup" and f.blocking and "1.900x" in f.message
    assert judge.same_code_speedup("c", 1.05, 1.02, quiet) is None  # within what placement does to a bench
    for p in quiet[:3]:
        p.foreign = [4242]
    f = judge.same_code_speedup("c", 2.0, 1.9, quiet)
    assert f.rule == "contended-unsure" and not f.blocking and "--exclusive" in f.message


def test_finish_blocks_a_clear_win_of_unchanged_code_unless_the_sides_differ_by_cand_env():
    import types

    from flaloop.bench.finish import _same_code
    from flaloop.bench.model import BenchConfig
    from flaloop.bench.record import RunRecord

    def record():
        cell = {"id": "S/fwd", "shape_name": "S", "shape": {"B": 1}, "mode": "fwd"}
        est = {"speedup": 1.5, "ci_low": 1.4, "ci_high": 1.6, "log_ratio": -0.4, "half_width": 0.03, "n_pairs": 12,
               "method": "hl+rank"}
        return RunRecord.from_dict({"op": "op", "created": "", "base": {"commit": "b" * 40},
                                    "candidate": {"commit": "c" * 40},
                                    "cells": [{"cell": cell, "status": "ok", "verdict": "FASTER", "estimate": est,
                                               "pairs": [p.__dict__ for p in pairs(1.0, 0.66, 0.0, 0.0)]}]})

    def plan(**cfg):
        return types.SimpleNamespace(config=BenchConfig(**cfg), static={"code_unchanged": True}, allowed=[])
    rec = record()
    _same_code(rec, plan())
    assert rec.cells[0].verdict == "BLOCKED" and rec.guard.blocked and "implausible-speedup" in rec.cells[0].reason
    rec = record()
    _same_code(rec, plan(cand_env={"FLA_X": "1"}))
    assert rec.cells[0].verdict == "FASTER" and not rec.cells[0].findings
