"""A shared GPU: who else is on it, pair by pair, and `--exclusive`.

The session runs in this process over the scripted fake workers of support/sessions.py, on a fake
"cuda" device whose NVML is a stand-in module put in `sys.modules["pynvml"]`: it answers the
calls evidence.Clocks makes, and lists as compute processes the fake workers (as the real NVML
lists flaloop's workers) and, when the test says so, a real `sleep` process of this machine
standing for another user's job. A blind NVML (a container without the host's PID namespace)
lists nothing at all."""

from __future__ import annotations

import pytest
from support.sessions import gpu_session

from flaloop.bench import evidence
from flaloop.core.errors import MeasurementError


def test_pairs_beside_another_process_are_marked_and_the_run_reads_contended_never_idle(tmp_path, monkeypatch,
                                                                                         other_job):
    s, nvml = gpu_session(tmp_path, monkeypatch)
    nvml.foreign = lambda n: [other_job] if n > 8 else []  # the other job starts during round 1
    s.run()
    idle = s.out.env["idle"]
    assert idle["idle"] is True and idle["processes_visible"] is True and idle["other_processes"] == []
    (res,) = s.out.results
    assert res.status == "ok"
    marks = [p.foreign for p in res.pairs]
    assert marks[0] == [] and marks[-1] == [other_job] and all(m in ([], [other_job]) for m in marks)
    c = evidence.contention(res.pairs, idle)
    assert c["state"] == "contended" and c["contended"] == sum(bool(m) for m in marks) and c["pairs"] == len(marks)
    assert c["processes"] == [{"pid": other_job, "pairs": c["contended"], "name": "sleep", "used_mib": None}]
    line = evidence.contention_line(c)
    assert line.startswith(f"CONTENDED: {c['contended']} of {len(marks)} pairs") and f"pid {other_job} (sleep)" in line
    assert not any(p.dropped for p in res.pairs)  # marked, not dropped: both sides shared the GPU alike


def test_a_cell_whose_pairs_all_ran_power_capped_beside_another_process_says_so_and_what_to_do(
        tmp_path, monkeypatch, other_job):
    """On the H200 another process's matmuls held the GPU at its power cap: every pair was dropped as
    throttled, and the cell read only "0 usable pairs (60 dropped)". The reason now names what
    dropped them, who else was on the GPU, and what to do."""
    s, nvml = gpu_session(tmp_path, monkeypatch)
    nvml.foreign = lambda n: [other_job]
    nvml.throttle = 0x4
    s.run()
    (res,) = s.out.results
    assert res.status == "failed" and res.kept == [] and res.pairs
    assert all(p.dropped == "throttled: sw_power_cap (0x4)" for p in res.pairs)
    n = len(res.pairs)
    assert res.reason.endswith(f"only 0 usable pairs ({n} dropped: {n} throttled: sw_power_cap (0x4)); another "
                               f"process was on the GPU in {n} of {n} pairs (pid {other_job}): measure when it has "
                               "finished, or pass --exclusive to wait for it"), res.reason


def test_workers_not_listed_at_the_start_but_listed_around_the_pairs_read_exclusive_not_unknown(
        tmp_path, monkeypatch, other_job):
    """On the H200 NVML named another user's job but not workers that held no CUDA context yet, and
    a run whose every pair then saw the list name them read "contention unknown" as if the list
    were blind. A list that names any process works; one that named ours around the pairs did."""
    s, nvml = gpu_session(tmp_path, monkeypatch)
    nvml.contextless = 1
    s.run()
    idle = s.out.env["idle"]
    assert idle["processes_visible"] is False  # the one listing before measuring named nobody
    c = evidence.contention(s.out.results[0].pairs, idle)
    assert c["observed"] == c["pairs"] > 0 and c["state"] == "exclusive" and "blind" not in c
    assert evidence.contention_line(c) is None
    # the same start beside another job: the list names it, so it is seen, and the GPU is not idle
    s, nvml = gpu_session(tmp_path / "shared", monkeypatch)
    nvml.contextless, nvml.foreign = 1, lambda n: [other_job]
    s.run()
    idle = s.out.env["idle"]
    assert idle["processes_visible"] is True and idle["idle"] is False
    assert [p["pid"] for p in idle["other_processes"]] == [other_job]
    assert not any("NVML lists no process" in why for why in idle["not_idle_because"])
    c = evidence.contention(s.out.results[0].pairs, idle)
    assert c["state"] == "contended" and c["contended"] == c["pairs"] and "blind" not in c


def test_exclusive_waits_for_the_other_process_to_leave(tmp_path, monkeypatch, other_job):
    s, nvml = gpu_session(tmp_path, monkeypatch, exclusive=True, exclusive_wait=30.0)
    first_pair = {}

    def foreign(n):  # there at the start, gone after four listings of the wait; back for one pair later
        if n <= 6:
            return [other_job]
        first_pair.setdefault("n", n)
        return [other_job] if n == first_pair["n"] + 5 else []

    nvml.foreign = foreign
    events = []
    s.on_event = lambda kind, **info: events.append((kind, info))
    s.run()
    (res,) = s.out.results
    assert res.status == "ok"
    waits = [i for k, i in events if k == "exclusive-wait"]
    assert waits and f"pid {other_job} (sleep)" in waits[0]["who"]
    dropped = [p for p in res.pairs if p.dropped]
    assert len(dropped) == 1 and dropped[0].dropped == f"another process on the GPU: pid {other_job}"
    assert all(p.foreign == [] for p in res.kept)  # what is measured ran with the GPU ours alone


def test_exclusive_refuses_when_the_gpu_stays_busy_or_cannot_be_seen(tmp_path, monkeypatch, other_job):
    s, nvml = gpu_session(tmp_path, monkeypatch, exclusive=True, exclusive_wait=1.0)
    nvml.foreign = lambda n: [other_job]
    with pytest.raises(MeasurementError, match="--exclusive: the GPU was not free for 1s before measuring S1") as e:
        s.run()
    assert f"pid {other_job} (sleep)" in str(e.value) and e.value.exit_code == 3
    s, nvml = gpu_session(tmp_path / "blind", monkeypatch, exclusive=True, exclusive_wait=1.0)
    nvml.blind, nvml.util = True, 80  # blind, and the device busy while flaloop's workers are idle
    with pytest.raises(MeasurementError, match="another process computes on the GPU: up to 80% busy") as e:
        s.run()
    assert e.value.exit_code == 3
    s, nvml = gpu_session(tmp_path / "blind-no-util", monkeypatch, exclusive=True, exclusive_wait=1.0)
    nvml.blind, nvml.util = True, None
    with pytest.raises(MeasurementError, match="not even flaloop's workers.*no utilization either"):
        s.run()


