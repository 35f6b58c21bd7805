"""Timer cheats against honest changes on a shared GPU: the timing cross-checks (guard/timing.py)
over scripted pairs, and a session on the fake GPU of test_contention.py beside another process.

An honest change beside another process must never block (at worst `contended-unsure`); a timer
that under-reports on every pair must block, with or without the other process."""

from __future__ import annotations

import random
import subprocess

import pytest
from test_contention import GpuScript, gpu_session

from flaloop.bench.analysis import analyse
from flaloop.bench.model import Pair
from flaloop.guard import timing

OTHER = [4242]  # a foreign pid on the GPU


@pytest.fixture
def other_job():
    """A real process of this machine standing for another user's job on the GPU."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


def shared_gpu_pairs(n: int = 24, per_call: float = 0.5, gap_us: float = 20.0, spread_us: float = 8.0,
                     cheat_us: float = 0.0, honest_tilt_us: float = 0.0, foreign=OTHER, seed: int = 1,
                     rounds: int = 2) -> list[Pair]:
    """Pairs of a cell timed beside another process: device times spread widely (the load moves
    both halves of a pair alike) and each side's wall-minus-device gap is 20 us plus heavy noise.
    `cheat_us`: the candidate's timer under-reports by that much per call on every pair.
    `honest_tilt_us`: contention that happened to cost the candidate's halves more (no cheat)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        load = rng.uniform(1.0, 2.8)  # 0.5 -> 1.4 ms per call, as beside a training loop
        b, c = per_call * load, per_call * load * rng.uniform(0.995, 1.005)

        def gap(extra):
            return (gap_us + extra + abs(rng.gauss(0, spread_us)) * rng.choice((1, 1, 3))) / 1e3
        out.append(Pair("AB" if i % 2 == 0 else "BA", b, c - cheat_us / 1e3, None, None,
                        round=i * rounds // n, base_wall_ms=b + gap(0.0), cand_wall_ms=c + gap(honest_tilt_us),
                        foreign=list(foreign) if foreign is not None else None))
    return out


def test_an_honest_change_beside_another_process_is_never_blocked_and_the_doubt_is_named():
    # the shape of the H200 incident: every pair contended, the candidate's gaps a few us larger
    for seed in range(6):
        f = timing.timer_wall_gap("c", shared_gpu_pairs(honest_tilt_us=6.0, seed=seed), k=20, timer="cuda_graph")
        assert f is None or (not f.blocking and f.rule == "contended-unsure"), f
    # one where the excess is material by the fixed yardstick: said, with the numbers and the advice
    f = timing.timer_wall_gap("c", shared_gpu_pairs(n=40, honest_tilt_us=6.0, spread_us=4.0, seed=3), k=20,
                              timer="cuda_graph")
    assert f is not None and f.rule == "contended-unsure" and not f.blocking
    assert "--exclusive" in f.message and "tolerance" in f.message and "40 of 40 pairs beside" in f.message


def test_a_systematic_excess_beside_another_process_is_said_but_decides_only_past_three_percent_of_the_call():
    """What the neighbour does to one side's host is not noise a pair cancels: a 10 us excess on every
    contended pair of a ~1 ms call (1%) is named, never blocked; the same on a quiet GPU blocks."""
    for seed in range(40):
        f = timing.timer_wall_gap("c", shared_gpu_pairs(n=40, honest_tilt_us=10.0, spread_us=4.0, seed=seed), k=20,
                                  timer="cuda_graph")
        assert f is not None and f.rule == "contended-unsure" and not f.blocking
    quiet = shared_gpu_pairs(n=40, honest_tilt_us=10.0, spread_us=4.0, seed=0, foreign=[])
    assert timing.timer_wall_gap("c", quiet, k=20, timer="cuda_graph").blocking


def test_a_timer_that_under_reports_on_every_pair_blocks_with_or_without_the_other_process():
    for foreign in (OTHER, [], None):
        f = timing.timer_wall_gap("c", shared_gpu_pairs(cheat_us=60.0, foreign=foreign), k=20, timer="cuda_graph")
        assert f is not None and f.rule == "timer-wall-gap" and f.blocking, (foreign, f)
    # quiet GPU, steady gaps: a 1% under-report of a 0.5 ms call is caught
    f = timing.timer_wall_gap("c", shared_gpu_pairs(cheat_us=5.0, spread_us=0.3, foreign=[]), k=20,
                              timer="cuda_graph")
    assert f is not None and f.blocking


def test_uncontended_pairs_decide_when_there_are_enough_of_them():
    quiet = shared_gpu_pairs(n=12, spread_us=0.3, foreign=[], seed=2)
    noisy = shared_gpu_pairs(n=12, honest_tilt_us=40.0, seed=3)  # contention cost the candidate's halves
    assert timing.timer_wall_gap("c", quiet + noisy, k=20, timer="cuda_graph") is None
    cheat_quiet = shared_gpu_pairs(n=12, spread_us=0.3, foreign=[], cheat_us=20.0, seed=2)
    f = timing.timer_wall_gap("c", cheat_quiet + noisy, k=20, timer="cuda_graph")
    assert f is not None and f.blocking and "12 pairs with the GPU to themselves" in f.message


def test_an_excess_in_one_round_only_belongs_to_a_process_not_the_code():
    pairs = shared_gpu_pairs(n=24, spread_us=0.3, foreign=[], seed=4)
    for p in pairs[:12]:  # round 1's candidate process ran beside a busy neighbour throughout
        p.cand_wall_ms += 0.03
    f = timing.timer_wall_gap("c", pairs, k=20, timer="cuda_graph")
    assert f is None or not f.blocking


def test_an_eager_check_beside_another_process_says_unsure_instead_of_blocking():
    rng = random.Random(5)
    base = [1.0 * rng.uniform(1, 3) for _ in range(6)]  # the other process stretches single calls
    cand = [b * rng.uniform(0.7, 1.3) for b in base]
    eager = {"base": {"wall_ms": base, "host_ms": [0.05] * 6}, "cand": {"wall_ms": cand, "host_ms": [0.05] * 6}}
    f = timing.eager_disagrees("c", 1.2, eager, contended=True)
    assert f is None or not f.blocking
    steady = [1.0, 1.001, 0.999, 1.0, 1.002, 0.998]
    lie = {"base": {"wall_ms": steady, "host_ms": [0.05] * 6},
           "cand": {"wall_ms": [x * 0.995 for x in steady], "host_ms": [0.05] * 6}}
    assert timing.eager_disagrees("c", 1.5, lie, contended=True).blocking  # steady calls: decided anyway


class GraphTimerScript(GpuScript):
    """Fake workers with the CUDA-graph timer: wall = device + 20 us per call, plus the contention's
    noise on pairs beside the other process; `cheat`: the candidate's device time reads 20% short."""

    def __init__(self, nvml_box: list, cheat: float = 0.0, **kw):
        super().__init__(factor=1.0, **kw)
        self.nvml_box, self.cheat = nvml_box, cheat

    def answer(self, worker, cmd, payload):
        reply = super().answer(worker, cmd, payload)
        if cmd == "setup":
            reply.update(timer="cuda_graph")
        if cmd == "sample":
            busy = bool(self.nvml_box and self.nvml_box[0].foreign(self.nvml_box[0].listings))
            t = reply["times_ms"][0]
            wall = t + 0.02 + (abs(self.rng.gauss(0, 0.01)) if busy else 0.0001 * self.rng.random())
            if worker.side == "cand":
                t *= 1 - self.cheat
            reply.update(times_ms=[t], wall_ms=[wall])
        return reply


def _run(tmp_path, monkeypatch, other_job, cheat: float):
    box: list = []
    s, nvml = gpu_session(tmp_path, monkeypatch, script=GraphTimerScript(box, cheat=cheat, noise=0.05))
    box.append(nvml)
    nvml.foreign = lambda n: [other_job]
    s.run()
    analyse(s.out.results, margin=0.005)
    (res,) = s.out.results
    assert all(p.foreign == [other_job] for p in res.kept)
    return res


def test_a_session_beside_another_process_blocks_the_cheat_and_not_the_honest_candidate(tmp_path, monkeypatch,
                                                                                         other_job):
    honest = _run(tmp_path / "honest", monkeypatch, other_job, cheat=0.0)
    assert honest.verdict != "BLOCKED" and not any(f.blocking for f in honest.findings)
    cheat = _run(tmp_path / "cheat", monkeypatch, other_job, cheat=0.2)
    assert cheat.verdict == "BLOCKED" and "timer-wall-gap" in {f.rule for f in cheat.findings if f.blocking}
