"""Environment fingerprint and GPU clock evidence, read through NVML (nvidia-ml-py).

The orchestrator never imports torch; the workers report torch/triton/CUDA versions and the
device UUID in their hello, and this module reads clocks and throttle reasons of the GPU with
that UUID. Without NVML (CPU runs, or the package missing) every reading is None and the bench
says so instead of guessing.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import asdict, dataclass

# Throttle reasons that mean "this pair was not measured at the clock you think": everything
# but GPU idle and the applications-clocks setting (which is just the configured ceiling).
_BENIGN_THROTTLE = 0x1 | 0x2


@dataclass(frozen=True)
class ClockReading:
    sm_mhz: int
    sm_max_mhz: int
    mem_mhz: int
    throttle_reasons: int
    temperature_c: int | None
    power_w: float | None

    @property
    def throttled(self) -> bool:
        return bool(self.throttle_reasons & ~_BENIGN_THROTTLE)

    @property
    def fraction_of_max(self) -> float:
        return self.sm_mhz / self.sm_max_mhz if self.sm_max_mhz else 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "throttled": self.throttled}


class Clocks:
    """NVML handle for one GPU, by UUID; `read()` is None when NVML is unavailable."""

    def __init__(self, uuid: str | None):
        self._nvml = None
        self._handle = None
        self.error: str | None = None
        if not uuid:
            self.error = "no GPU"
            return
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._find(pynvml, uuid)
        except Exception as exc:  # noqa: BLE001 - evidence is best effort, and says why not
            self.error = f"NVML unavailable: {exc}"
            self._nvml = None

    @staticmethod
    def _find(nvml, uuid: str):
        want = uuid.lower().removeprefix("gpu-")
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            got = nvml.nvmlDeviceGetUUID(h)
            got = (got.decode() if isinstance(got, bytes) else got).lower().removeprefix("gpu-")
            if got == want:
                return h
        raise RuntimeError(f"no GPU with UUID {uuid} among {nvml.nvmlDeviceGetCount()}")

    @property
    def available(self) -> bool:
        return self._handle is not None

    def read(self) -> ClockReading | None:
        if not self.available:
            return None
        n, h = self._nvml, self._handle
        try:
            temp = n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)
        except Exception:  # noqa: BLE001
            temp = None
        try:
            power = n.nvmlDeviceGetPowerUsage(h) / 1000.0
        except Exception:  # noqa: BLE001
            power = None
        return ClockReading(
            sm_mhz=n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
            sm_max_mhz=n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
            mem_mhz=n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
            throttle_reasons=int(n.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
            temperature_c=temp, power_w=power,
        )

    def driver(self) -> str | None:
        if not self._nvml:
            return None
        v = self._nvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v


def fingerprint(hello: dict, clocks: Clocks) -> dict:
    """What the run record and the table header say about the machine."""
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": hello.get("device"),
        "device_name": hello.get("device_name"),
        "device_uuid": hello.get("device_uuid"),
        "driver": clocks.driver(),
        "cuda": hello.get("cuda_runtime"),
        "torch": hello.get("torch"),
        "triton": hello.get("triton"),
        "python": hello.get("python"),
        "nvml": clocks.error or "ok",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
