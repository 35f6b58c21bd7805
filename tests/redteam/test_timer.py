"""Timer cheats against honest changes on a shared GPU: the timing cross-checks (guard/timing.py)
over scripted pairs, and a session on the fake GPU of support/sessions.py beside another process.

An honest change beside another process must never block (at worst `contended-unsure`); a timer
that under-reports on every pair must block, with or without the other process."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from support.sessions import GpuScript, gpu_session

from flaloop.bench.analysis import analyse
from flaloop.bench.model import Pair
from flaloop.guard import timing

OTHER = [4242]  # a foreign pid on the GPU


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


# -- the round trip on the orchestrator's clock (timing.timer_host_gap): every timer, however forged --

def host_pairs(n: int = 24, sample: float = 40.0, overhead: float = 0.5, jitter: float = 0.2, cheat: float = 0.0,
               tilt: float = 0.0, foreign=OTHER, seed: int = 1, rounds: int = 2) -> list[Pair]:
    """Pairs with each side's sample request timed around its round trip (ms per sample): the work
    (stretched alike on both sides by a loaded host), plus an overhead and the host's jitter, now and
    then a preemption 8 times as long on either side. `cheat`: the share of its work the candidate's
    timer does not report; `tilt`: ms the candidate's gap happened to be longer by (no cheat)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        work_b = sample * rng.uniform(1.0, 2.5)
        work_c = work_b * rng.uniform(0.98, 1.02)

        def gap():
            return overhead + abs(rng.gauss(0, jitter)) * rng.choice((1, 1, 1, 8))
        out.append(Pair("AB" if i % 2 == 0 else "BA", work_b / 4, work_c * (1 - cheat) / 4, None, None,
                        round=i * rounds // n, foreign=list(foreign) if foreign is not None else None,
                        base_rtt_ms=work_b + gap(), cand_rtt_ms=work_c + gap() + tilt,
                        base_reported_ms=work_b, cand_reported_ms=work_c * (1 - cheat)))
    return out


def test_an_honest_change_on_a_loaded_host_is_never_blocked_by_the_round_trip():
    for foreign in (OTHER, [], None):
        for seed in range(20):
            f = timing.timer_host_gap("c", host_pairs(foreign=foreign, seed=seed, jitter=1.0))
            assert f is None or not f.blocking, (foreign, seed, f)
    # the candidate's gap 1.5 ms longer in every contended pair (~2% of its sample, past the minimum
    # effect, short of the 3% a contended pair decides on): said, never blocked
    f = timing.timer_host_gap("c", host_pairs(n=40, tilt=1.5, jitter=0.05, seed=3))
    assert f is not None and f.rule == "contended-unsure" and not f.blocking and "--exclusive" in f.message


def test_an_honestly_slower_candidate_whose_untimed_calls_take_longer_too_is_not_blocked():
    """A candidate that sleeps in the op (48x slower per call, as tests/e2e/test_loop.py's) spends its
    untimed calls of a sample (the first sync, the kept call's copy) slower too: its round trip grows
    past the base's by about one call, which is honest, not a timer hiding time."""
    pairs = []
    for i in range(12):
        base_call, cand_call, k = 0.12, 5.8, 4  # per-call ms, calls per sample
        pairs.append(Pair("AB" if i % 2 == 0 else "BA", base_call, cand_call, None, None, round=i * 2 // 12,
                          foreign=None, base_rtt_ms=k * base_call + 0.5 + base_call,
                          cand_rtt_ms=k * cand_call + 0.5 + cand_call + 0.01 * (i % 3),
                          base_reported_ms=k * base_call, cand_reported_ms=k * cand_call))
    f = timing.timer_host_gap("c", pairs)
    assert f is None or not f.blocking, f
    # the same candidate with a timer that hides half its calls is still blocked: a forged reading earns
    # no allowance, since the allowance is on the per-call time it reports
    for p in pairs:
        p.cand_ms, p.cand_reported_ms = p.cand_ms / 2, p.cand_reported_ms / 2
    f = timing.timer_host_gap("c", pairs)
    assert f is not None and f.rule == "timer-host-gap" and f.blocking, f


def test_a_timer_that_hides_part_of_the_sample_blocks_on_the_round_trip_with_or_without_company():
    for foreign in (OTHER, [], None):
        f = timing.timer_host_gap("c", host_pairs(cheat=0.1, foreign=foreign, jitter=1.0))
        assert f is not None and f.rule == "timer-host-gap" and f.blocking, (foreign, f)
    # on quiet pairs with a steady host, 2% hidden is enough
    f = timing.timer_host_gap("c", host_pairs(cheat=0.02, foreign=[], jitter=0.05))
    assert f is not None and f.rule == "timer-host-gap" and f.blocking
    # pairs without round trips (a record from before the check, a client that keeps none): no judgement
    bare = host_pairs(cheat=0.5)
    for p in bare:
        p.cand_rtt_ms = None
    assert timing.timer_host_gap("c", bare) is None


def test_the_round_trip_of_a_sample_is_timed_by_the_client():
    from types import SimpleNamespace

    from flaloop.bench.sampling import host_timed
    from flaloop.bench.workers import WorkerClient

    class Log:
        def drain(self):
            pass

        def tail(self, n):
            return ""

        def close(self):
            pass
    script = ("import sys, time\nfor line in sys.stdin:\n    if 'quit' in line:\n        break\n"
              "    time.sleep(0.05)\n    print('{\"ok\": true}', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    w = WorkerClient("cand", Path("."), proc, Log())
    try:
        assert w.round_trip_s is None
        assert w.request("sample", 10.0) == {"ok": True}
        assert w.round_trip_s >= 0.05  # the worker slept that long before answering
    finally:
        w.close()
    s = SimpleNamespace(workers={"cand": SimpleNamespace(round_trip_s=0.012)})
    assert host_timed(s, "cand", {"k": 4, "times_ms": [2.5]}) == (12.0, 10.0)
    assert host_timed(s, "cand", {"k": 4, "times_ms": [2.5], "keep_s": 0.001}) == (12.0, 10.0)  # in both gaps
    assert host_timed(SimpleNamespace(workers={}), "cand", {"k": 4, "times_ms": [2.5]}) == (None, None)


class HostClockScript(GpuScript):
    """Fake workers with the CPU timer whose sample requests take their work plus 0.3 ms and the
    host's jitter on the orchestrator's clock; `cheat`: the candidate reports that share less."""

    def __init__(self, cheat: float = 0.0, **kw):
        super().__init__(**kw)
        self.cheat = cheat

    def answer(self, worker, cmd, payload):
        reply = super().answer(worker, cmd, payload)
        if cmd == "sample":
            t = reply["times_ms"][0]
            worker.round_trip_s = (4 * t + 0.3 + abs(self.rng.gauss(0, 0.2))) / 1e3
            if worker.side == "cand":
                reply.update(times_ms=[t * (1 - self.cheat)], wall_ms=[t * (1 - self.cheat)])
            reply["k"] = 4
        return reply


@pytest.mark.parametrize("cheat", [0.0, 0.2])
def test_a_session_beside_another_process_judges_the_round_trip(tmp_path, monkeypatch, other_job, cheat):
    s, nvml = gpu_session(tmp_path, monkeypatch, script=HostClockScript(cheat=cheat, noise=0.05))
    nvml.foreign = lambda n: [other_job]
    s.run()
    analyse(s.out.results, margin=0.005)
    (res,) = s.out.results
    assert all(p.cand_rtt_ms and p.base_reported_ms for p in res.kept)
    blocked = {f.rule for f in res.findings if f.blocking}
    # (the fake's eager calls are not forged: eager-disagrees sees the cheat too)
    assert ("timer-host-gap" in blocked) == bool(cheat) and (cheat or not blocked), res.findings
    assert (res.verdict == "BLOCKED") == bool(cheat)
