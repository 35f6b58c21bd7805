"""A shared GPU: who else is on it, pair by pair, and `--exclusive`.

The session runs in this process over the scripted fake workers of test_session.py, on a fake
"cuda" device whose NVML is a stand-in module put in `sys.modules["pynvml"]`: it answers the
calls evidence.Clocks makes, and lists as compute processes the fake workers (as the real NVML
lists flaloop's workers) and, when the test says so, a real `sleep` process of this machine
standing for another user's job. A blind NVML (a container without the host's PID namespace)
lists nothing at all."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
from test_session import CELLS, FakeLauncher, Script

from flaloop.bench import evidence
from flaloop.bench.model import BenchConfig
from flaloop.bench.session import Session
from flaloop.core.errors import MeasurementError

UUID = "GPU-00000000-fake"


class GpuScript(Script):
    def answer(self, worker, cmd, payload):
        reply = super().answer(worker, cmd, payload)
        if cmd == "hello":
            reply.update(device="cuda", device_uuid=UUID, device_name="fake H200")
        return reply


class FakeNvml(types.ModuleType):
    """pynvml as evidence.Clocks uses it. `foreign(n)` says which foreign pids are on the GPU at
    the n-th process listing; `blind` lists no process at all."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 1, 0

    def __init__(self, launcher: FakeLauncher, foreign=lambda n: [], blind: bool = False):
        super().__init__("pynvml")
        self.launcher, self.foreign, self.blind, self.listings = launcher, foreign, blind, 0
        self.contextless = 0  # listings at the start in which our workers hold no CUDA context yet
        self.util = 0  # the device's utilization, percent (None: this NVML does not say)
        self.throttle = 0  # the clocks-event reasons NVML reports (0x4: the software power cap)

    def nvmlDeviceGetUtilizationRates(self, h):
        if self.util is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return types.SimpleNamespace(gpu=self.util, memory=0)

    def nvmlInit(self): pass  # noqa: E704
    def nvmlDeviceGetCount(self): return 1  # noqa: E704
    def nvmlDeviceGetHandleByIndex(self, i): return "h0"  # noqa: E704
    def nvmlDeviceGetUUID(self, h): return UUID  # noqa: E704
    def nvmlDeviceGetClockInfo(self, h, which): return 1980 if which == self.NVML_CLOCK_SM else 3201  # noqa: E704
    def nvmlDeviceGetMaxClockInfo(self, h, which): return 1980 if which == self.NVML_CLOCK_SM else 3201  # noqa: E704
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h): return self.throttle  # noqa: E704
    def nvmlDeviceGetTemperature(self, h, which): return 40  # noqa: E704
    def nvmlDeviceGetPowerUsage(self, h): return 120_000  # noqa: E704
    def nvmlSystemGetDriverVersion(self): return "580.0-fake"  # noqa: E704
    def nvmlDeviceGetMemoryInfo(self, h): return types.SimpleNamespace(used=7 << 30, total=141 << 30)  # noqa: E704
    def nvmlDeviceGetGraphicsRunningProcesses(self, h): return []  # noqa: E704

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self.listings += 1
        if self.blind:
            return []
        ours = [] if self.listings <= self.contextless else [w.pid for w in self.launcher.started if not w.dead]
        pids = ours + list(self.foreign(self.listings))
        return [types.SimpleNamespace(pid=p, usedGpuMemory=3 << 30) for p in pids]


@pytest.fixture
def other_job():
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


def gpu_session(tmp_path, monkeypatch, script=None, **cfg):
    """A session (not yet run) on the fake GPU, and its fake NVML to script."""
    launcher = FakeLauncher(script or GpuScript(factor=1.0))
    nvml = FakeNvml(launcher)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    config = BenchConfig(device="cpu", probes=False, **{"min_pairs": 8, "max_pairs": 12, "rounds": 2, **cfg})
    s = Session(op="op", cells=CELLS[:1], config=config, trees={"base": tmp_path / "b", "cand": tmp_path / "c"},
                launcher=launcher, run_dir=tmp_path / "run")
    return s, nvml


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


def test_exclusive_on_a_blind_but_quiet_gpu_measures(tmp_path, monkeypatch):
    s, nvml = gpu_session(tmp_path, monkeypatch, exclusive=True, exclusive_wait=1.0, rounds=1)
    nvml.blind = True
    s.run()
    (res,) = s.out.results
    assert res.status == "ok" and len(res.kept) >= 8
