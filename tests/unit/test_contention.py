"""A shared GPU, in-process: a session over the scripted fake workers of support/sessions.py on a fake
"cuda" device whose NVML is a stand-in module, blind or unable to see flaloop. The cases beside a
real `sleep` process standing for another user's job are in tests/e2e/test_contention.py."""

from __future__ import annotations

from support.sessions import gpu_session

from flaloop.bench import evidence


def test_a_process_list_that_cannot_see_flaloop_itself_says_unknown(tmp_path, monkeypatch):
    s, nvml = gpu_session(tmp_path, monkeypatch)
    nvml.blind = True
    s.run()
    idle = s.out.env["idle"]
    assert idle["idle"] is None and idle["processes_visible"] is False
    assert "not even flaloop's workers" in idle["not_idle_because"][0]
    (res,) = s.out.results
    assert all(p.foreign is None for p in res.pairs)
    c = evidence.contention(res.pairs, idle)
    assert c["state"] == "unknown" and c["observed"] == 0
    line = evidence.contention_line(c)
    assert line.startswith("contention unknown: NVML lists no process") and "the GPU read idle" in line


def test_a_blind_process_list_still_sees_the_device_busy_while_flaloop_is_idle(tmp_path, monkeypatch):
    """A container's NVML names no process, but the device's utilization is its own: busy while
    flaloop's workers have launched nothing is another process's work."""
    s, nvml = gpu_session(tmp_path, monkeypatch)
    nvml.blind, nvml.util = True, 63
    s.run()
    idle = s.out.env["idle"]
    assert idle["idle"] is False and "up to 63% busy in 5 of 5 readings" in idle["foreign_activity"]
    assert "while flaloop's workers were idle" in idle["not_idle_because"][0]
    c = evidence.contention(s.out.results[0].pairs, idle)
    assert c["state"] == "contended"
    assert evidence.contention_line(c).startswith("CONTENDED: another process computes on the GPU: up to 63% busy")
    # a busy minority of readings is not enough, and no utilization at all leaves it unknown
    for readings in ([{"util_pct": None}] * 5, [{"util_pct": 3}] * 5):
        assert evidence.busy_while_ours_idle(readings) is None
    assert evidence.busy_while_ours_idle([{"util_pct": 40}, {"util_pct": 0}, {"util_pct": 0}]) is None


def test_exclusive_on_a_blind_but_quiet_gpu_measures(tmp_path, monkeypatch):
    s, nvml = gpu_session(tmp_path, monkeypatch, exclusive=True, exclusive_wait=1.0, rounds=1)
    nvml.blind = True
    s.run()
    (res,) = s.out.results
    assert res.status == "ok" and len(res.kept) >= 8
