"""The bench session driven over scripted fake workers: the order of its requests (which side sets
up and samples first, round by round), its stopping, and its restarts after a crash, without a
process, a tree or a timer. The session is handed a launcher (bench/launcher.py); support/sessions.py's
hands out `FakeWorker`s that answer from a script and log every request."""

from __future__ import annotations

import threading

import pytest
from support.sessions import CELLS, FakeLauncher, Script

from flaloop.bench.model import BenchConfig, Cell
from flaloop.bench.session import Cancelled, Session
from flaloop.bench.workers import WorkerFailed


def run_session(tmp_path, script: Script, cells=None, cancel=None, **cfg) -> tuple[Session, FakeLauncher]:
    config = BenchConfig(device="cpu", probes=False, **{"min_pairs": 8, "max_pairs": 40, "rounds": 2, **cfg})
    launcher = FakeLauncher(script)
    s = Session(op="op", cells=cells or CELLS[:1], config=config, trees={"base": tmp_path / "b", "cand": tmp_path / "c"},
                launcher=launcher, run_dir=tmp_path / "run", cancel=cancel)
    s.run()
    return s, launcher


def requests(script: Script, cmd: str) -> list[tuple[int, str]]:
    return [(n, side) for n, side, c, _ in script.log if c == cmd]


def test_rounds_mirror_each_other_abba_then_baab_and_the_warmup_pair_never_samples(tmp_path):
    script = Script(factor=1.0)
    s, launcher = run_session(tmp_path, script)
    (res,) = s.out.results
    assert res.status == "ok"
    by_round = {r: [p.order for p in res.pairs if p.round == r] for r in (0, 1)}
    assert by_round[0][:4] == ["AB", "BA", "AB", "BA"]  # round 1: base set up first, samples first
    assert by_round[1][:4] == ["BA", "AB", "BA", "AB"]  # round 2: the mirror
    assert len(by_round[0]) == len(by_round[1])  # round 2 takes as many pairs as round 1 kept
    # the warm-up pair (workers 0 and 1) set everything up and measured nothing
    warm = {0, 1}
    assert {n for n, _ in requests(script, "setup")} & warm
    assert not {n for n, _ in requests(script, "sample")} & warm
    # each round's setups: in the round's start order (base first in round 1, the candidate in round 2)
    setups = [(n, side) for n, side in requests(script, "setup") if n not in warm]
    first_round, second_round = setups[:2], setups[2:4]
    assert [side for _, side in first_round] == ["base", "cand"]
    assert [side for _, side in second_round] == ["cand", "base"]
    # the settle pair of each round is kept aside, not in the estimate
    assert [x["order"] for x in res.setup["settle"]] == ["AB", "BA"]
    samples = len(requests(script, "sample"))
    assert samples == 2 * (len(res.pairs) + 2)  # every pair, and one settle pair a round, on both sides


def test_a_quiet_cell_stops_at_the_ci_half_width_and_a_clear_win_settles_in_round_one(tmp_path):
    s, _ = run_session(tmp_path, Script(factor=1.0, noise=0.0002), min_pairs=20, max_pairs=80)
    (res,) = s.out.results
    assert res.status == "ok" and len(res.pairs) == 20  # 10 a round: the minimum, the CI is already tight
    assert "round 1: CI half-width" in res.stop_reason
    s, _ = run_session(tmp_path / "win", Script(factor=0.8, noise=0.02), min_pairs=12)
    (res,) = s.out.results
    assert "round 1: settled: the CI lies beyond the margin" in res.stop_reason
    assert sum(p.round == 0 for p in res.pairs) == sum(p.round == 1 for p in res.pairs)
    assert all(p.cand_ms < p.base_ms for p in res.pairs)


def test_a_noisy_cell_stops_at_the_pair_cap(tmp_path):
    s, _ = run_session(tmp_path, Script(factor=1.0, noise=0.05), max_pairs=12, min_pairs=4)
    (res,) = s.out.results
    assert "pair cap" in res.stop_reason and len(res.pairs) == 12


def test_a_crash_fails_its_cell_and_a_fresh_pair_measures_the_rest(tmp_path):
    # the candidate dies at its 5th sample: in round 1 of the first cell (the settle pair is the 1st)
    script = Script(crash=("cand", "sample", 5))
    s, launcher = run_session(tmp_path, script, cells=CELLS)
    first, second = s.out.results
    assert first.status == "failed" and first.reason.startswith("round 1: cand worker:") and "crashed" in first.reason
    assert second.status == "ok" and len(second.pairs) >= 8
    assert s.out.restarts == 1
    assert any("scripted last words" in e for e in s.out.errors)
    # the fresh pair is new processes: the second cell's samples come from workers the first never used
    crashed_with = {n for n, side, c, p in script.log if c == "sample" and p["cell"] == first.id}
    measured_with = {n for n, side, c, p in script.log if c == "sample" and p["cell"] == second.id}
    assert not crashed_with & measured_with
    # every worker started: the warm-up pair, one a round, and one restart
    assert len(launcher.started) == 2 * 4


def test_restarts_are_bounded(tmp_path):
    class AlwaysCrash(Script):
        def answer(self, worker, cmd, payload):
            if cmd == "sample" and worker.side == "base":
                raise WorkerFailed("base", "crashed during `sample` (scripted)", "")
            return super().answer(worker, cmd, payload)

    cells = [Cell(f"S{i}", {"B": 1, "T": 8, "H": 1, "D": 4}, "fwd") for i in range(7)]
    s, _ = run_session(tmp_path, AlwaysCrash(), cells=cells, rounds=1)
    assert s.out.restarts == 4  # MAX_RESTARTS
    assert all(r.status == "failed" for r in s.out.results)
    assert any("no fresh workers after 4 restarts" in e for e in s.out.errors)


def test_a_cancel_withdraws_the_run(tmp_path):
    cancel = threading.Event()

    class CancelAtFirstSample(Script):
        def answer(self, worker, cmd, payload):
            if cmd == "sample":
                cancel.set()
            return super().answer(worker, cmd, payload)

    with pytest.raises(Cancelled):
        run_session(tmp_path, CancelAtFirstSample(), cancel=cancel)
