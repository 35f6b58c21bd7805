"""A bench session's scripted fake workers (`Script`, `FakeWorker`, `FakeLauncher`), and a fake
"cuda" device whose NVML is a stand-in module put in `sys.modules["pynvml"]` (`FakeNvml`,
`gpu_session`): the session runs in the test's process, without a process, a tree or a timer."""

from __future__ import annotations

import random
import sys
import threading
import types
from pathlib import Path

from flaloop.bench.model import BenchConfig, Cell
from flaloop.bench.session import Session
from flaloop.bench.workers import WorkerFailed


class Script:
    """How the fake workers answer: base ~10 ms a call with 0.1% noise, the candidate `factor`
    times that (0.8: 25% faster); `crash` = (side, cmd, n): that side's n-th such request kills it."""

    def __init__(self, factor: float = 1.0, noise: float = 0.001, crash: tuple[str, str, int] | None = None,
                 hang: tuple[str, str, int] | None = None, seed: int = 0):
        self.factor, self.noise, self.crash, self.hang = factor, noise, crash, hang
        self.rng = random.Random(seed)
        self.log: list[tuple[int, str, str, dict]] = []  # (worker number, side, cmd, payload)
        self.counts: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()

    def answer(self, worker: FakeWorker, cmd: str, payload: dict) -> dict:
        with self.lock:
            self.log.append((worker.n, worker.side, cmd, payload))
            key = (worker.side, cmd)
            self.counts[key] = self.counts.get(key, 0) + 1
            for what, how in ((self.crash, "crashed"), (self.hang, "hung")):
                if what and what[:2] == key and self.counts[key] == what[2]:
                    raise WorkerFailed(worker.side, f"{how} during `{cmd}` (scripted)", "scripted last words")
            t = 10.0 * (1 + self.rng.gauss(0, self.noise)) * (self.factor if worker.side == "cand" else 1.0)
        if cmd == "hello":
            mod = str(worker.tree / "pkg" / "op.py")
            return {"ok": True, "pid": 1000 + worker.n, "device": "cpu", "device_uuid": None, "device_name": "fake",
                    "op_module_file": mod, "op_func_file": mod, "preload": [], "torch": "fake"}
        if cmd == "setup":
            return {"ok": True, "k": 4, "timer": "cpu", "nonfinite": {}, "tuning": {}, "placements": 1}
        if cmd == "sample":
            return {"ok": True, "times_ms": [t], "wall_ms": [t]}
        if cmd == "eager":
            return {"ok": True, "host_ms": [0.01], "wall_ms": [t]}
        if cmd == "dump":
            return {"ok": True, "shared": None}
        if cmd == "compare":
            return {"ok": True, "match": True, "tensors": {}}
        return {"ok": True}


class FakeWorker:
    def __init__(self, n: int, side: str, tree: Path, script: Script):
        self.n, self.side, self.tree, self.script = n, side, tree, script
        self.hello: dict = {}
        self.dead, self.forked, self.pid = False, False, 1000 + n
        self._pending: tuple[str, dict] | None = None

    def send(self, cmd: str, **payload) -> None:
        if self.dead:
            raise WorkerFailed(self.side, "is gone", "")
        self._pending = (cmd, payload)

    def receive(self, cmd: str, timeout: float) -> dict:
        asked, payload = self._pending
        try:
            return self.script.answer(self, asked, payload)
        except WorkerFailed:
            self.dead = True
            raise

    def request(self, cmd: str, timeout: float, **payload) -> dict:
        self.send(cmd, **payload)
        return self.receive(cmd, timeout)

    def stderr_tail(self) -> str:
        return ""

    def kill(self) -> None:
        self.dead = True

    def close(self) -> None:
        self.dead = True


class FakeLauncher:
    def __init__(self, script: Script):
        self.script, self.started = script, []

    def start(self, side, tree, log_path, import_mode):
        w = FakeWorker(len(self.started), side, tree, self.script)
        self.started.append(w)
        return w

    def fall_back(self, why):
        pass

    def note_imported(self, modules):
        pass

    def pids(self):
        return [w.pid for w in self.started]

    def describe(self):
        return {"used": False, "why": "fake workers"}

    def close(self, leave_warm=True):
        pass


CELLS = [Cell("S1", {"B": 1, "T": 8, "H": 1, "D": 4}, "fwd"), Cell("S2", {"B": 1, "T": 8, "H": 1, "D": 4}, "fwd")]


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


def gpu_session(tmp_path, monkeypatch, script=None, **cfg):
    """A session (not yet run) on the fake GPU, and its fake NVML to script."""
    launcher = FakeLauncher(script or GpuScript(factor=1.0))
    nvml = FakeNvml(launcher)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    config = BenchConfig(device="cpu", probes=False, **{"min_pairs": 8, "max_pairs": 12, "rounds": 2, **cfg})
    s = Session(op="op", cells=CELLS[:1], config=config, trees={"base": tmp_path / "b", "cand": tmp_path / "c"},
                launcher=launcher, run_dir=tmp_path / "run")
    return s, nvml
