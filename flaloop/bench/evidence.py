"""Environment fingerprint and GPU clock evidence, read through NVML (nvidia-ml-py).

The orchestrator never imports torch; the workers report torch/triton/CUDA (and TileLang /
CuTe DSL) versions and the device UUID in their hello, and this module reads clocks, throttle
reasons, temperature, power and the other processes of the GPU with that UUID. Without NVML
(CPU runs, or the package missing) every reading is None and the evidence says why
("no GPU", "NVML unavailable: ...") instead of guessing.

Two summaries go into a run record: `idle_evidence(clocks)` before measuring (is the GPU idle,
at full clock, cool, alone?) as `record["env"]["idle"]`, and `during_evidence(readings)` over
the readings taken around the pairs as `record["env"]["during"]`.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

# Throttle reasons that mean "this pair was not measured at the clock you think": everything
# but GPU idle and the applications-clocks setting (which is just the configured ceiling).
_BENIGN_THROTTLE = 0x1 | 0x2
# NVML's clocks-event (throttle) reason bits.
THROTTLE_NAMES = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}
# Below this fraction of its max SM clock, an idle GPU is not "at clock" (cf. BenchConfig.clock_floor).
IDLE_CLOCK_FLOOR = 0.75


def throttle_names(mask: int | None) -> list[str]:
    if not mask:
        return []
    names = [name for bit, name in THROTTLE_NAMES.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_NAMES)
    return names + ([f"0x{rest:x}"] if rest else [])


@dataclass(frozen=True)
class ClockReading:
    sm_mhz: int
    sm_max_mhz: int
    mem_mhz: int
    throttle_reasons: int
    temperature_c: int | None
    power_w: float | None
    util_pct: int | None = None  # NVML's share of its last sample period with a kernel running

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
            temperature_c=temp, power_w=power, util_pct=self.util_pct(),
        )

    def util_pct(self) -> int | None:
        """The device's utilization (percent of NVML's last sample period, 1/6 s to 1 s by product,
        in which a kernel ran), whoever ran it; None where NVML does not say."""
        if not self.available:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:  # noqa: BLE001
            return None

    def processes(self) -> list[dict] | None:
        """Compute and graphics processes on this GPU (pid, used memory), None without NVML."""
        if not self.available:
            return None
        n, h = self._nvml, self._handle
        seen: dict[int, dict] = {}
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs = getattr(n, getter)(h)
            except Exception:  # noqa: BLE001 - not every driver answers both
                continue
            for p in procs:
                mem = getattr(p, "usedGpuMemory", None)
                seen[int(p.pid)] = {"pid": int(p.pid), "used_mib": round(mem / 2**20) if mem else None,
                                    "kind": "compute" if "Compute" in getter else "graphics"}
        return sorted(seen.values(), key=lambda d: d["pid"])

    def memory_used_mib(self) -> int | None:
        if not self.available:
            return None
        try:
            return round(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20)
        except Exception:  # noqa: BLE001
            return None

    def mem_max_mhz(self) -> int | None:
        if not self.available:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetMaxClockInfo(self._handle, self._nvml.NVML_CLOCK_MEM))
        except Exception:  # noqa: BLE001
            return None

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
        "tilelang": hello.get("tilelang"),
        "cutlass": hello.get("cutlass"),
        "python": hello.get("python"),
        "nvml": clocks.error or "ok",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


# -- idle and during-measurement evidence -------------------------------------------------------

def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _as_dict(r) -> dict | None:
    if r is None:
        return None
    return r.to_dict() if isinstance(r, ClockReading) else dict(r)


def _summarize(readings: list[dict]) -> dict:
    sm = [r["sm_mhz"] for r in readings if r.get("sm_mhz") is not None]
    sm_max = max((r.get("sm_max_mhz") or 0 for r in readings), default=0) or None
    mem = [r["mem_mhz"] for r in readings if r.get("mem_mhz") is not None]
    temp = [r["temperature_c"] for r in readings if r.get("temperature_c") is not None]
    power = [r["power_w"] for r in readings if r.get("power_w") is not None]
    masks = [int(r.get("throttle_reasons") or 0) for r in readings]
    throttled = [m for m in masks if m & ~_BENIGN_THROTTLE]
    union = 0
    for m in masks:
        union |= m
    return {
        "available": True, "n_readings": len(readings),
        "sm_mhz": _stats(sm), "sm_max_mhz": sm_max,
        "sm_fraction_min": (min(sm) / sm_max) if sm and sm_max else None,
        "mem_mhz": _stats(mem), "temperature_c": _stats(temp), "power_w": _stats(power),
        "throttle_reasons": throttle_names(union), "n_throttled": len(throttled),
    }


def sample_readings(clocks: Clocks, samples: int, interval_s: float) -> list[dict]:
    """`samples` readings `interval_s` apart, as dicts (those NVML could not give left out)."""
    readings = []
    for i in range(max(1, samples)):
        r = clocks.read()
        if r is not None:
            readings.append(r.to_dict())
        if i + 1 < samples:
            time.sleep(interval_s)
    return readings


def idle_evidence(clocks: Clocks | None, own_pids: Iterable[int] = (), samples: int = 5,
                  interval_s: float = 0.1) -> dict:
    """The GPU before measuring: clocks, memory clock, temperature, power, throttle reasons and
    the processes on it that are not ours (`own_pids`: the bench workers).

    `idle` is True when the SM clock stands at >= 75% of its max (or the GPU reports itself idle,
    which parks the clock legitimately), nothing but benign reasons throttle it, and no other
    process holds the GPU.
    """
    if clocks is None or not clocks.available:
        return {"available": False, "reason": (clocks.error if clocks is not None else None) or "no GPU"}
    readings = sample_readings(clocks, samples, interval_s)
    if not readings:
        return {"available": False, "reason": "NVML gave no reading"}
    out = _summarize(readings)
    ours = {int(p) for p in own_pids}
    occ = occupancy(clocks, ours, with_memory=True)
    others = occ["foreign"] if occ else []
    idle_clock = any(int(r.get("throttle_reasons") or 0) & 0x1 for r in readings)
    at_clock = (out["sm_fraction_min"] or 0) >= IDLE_CLOCK_FLOOR or idle_clock
    visible = bool(occ and occ["visible"])
    out.update(mem_max_mhz=clocks.mem_max_mhz(), other_processes=others, own_processes=sorted(ours),
               processes_visible=visible, memory_used_mib=occ and occ["used_mib"],
               # unknown (None) when the process list is blind: another process may be there unseen
               idle=bool(at_clock and not out["n_throttled"] and not others) if visible or not ours else None)
    why = []
    if not visible and ours:  # blind: what the device does while flaloop's workers are idle
        out["foreign_activity"] = busy_while_ours_idle(readings)
        if out["foreign_activity"]:  # confirmed once NVML's window cannot cover our workers' start-up
            time.sleep(UTIL_WINDOW_S)
            out["foreign_activity"] = busy_while_ours_idle(sample_readings(clocks, samples, interval_s))
        if out["foreign_activity"]:
            out["idle"] = False
            why.append(f"{out['foreign_activity']} ({BLIND_SHORT})")
        else:
            why.append(BLIND)
            out["quiet_start"] = all(r.get("util_pct") is not None for r in readings)
    if not at_clock:
        why.append(f"SM clock at {out['sm_fraction_min']:.0%} of max")
    if out["n_throttled"]:
        why.append("throttled: " + ", ".join(out["throttle_reasons"]))
    if others:
        why.append(f"{len(others)} other process(es) on the GPU: " + ", ".join(str(p["pid"]) for p in others))
    out["not_idle_because"] = why
    return out


def during_evidence(readings: Iterable) -> dict:
    """Summary of the clock readings taken around the pairs (ClockReading or its dict; None
    entries are readings NVML could not give). A CPU run, or one without NVML, says so."""
    rs = [d for d in (_as_dict(r) for r in readings) if d]
    if not rs:
        return {"available": False, "reason": "no GPU clock readings (CPU run or NVML unavailable)"}
    out = _summarize(rs)
    below = [r for r in rs if r.get("sm_max_mhz") and r["sm_mhz"] / r["sm_max_mhz"] < IDLE_CLOCK_FLOOR]
    out["n_below_floor"] = len(below)
    return out


BLIND = ("NVML lists no process on the GPU, not even flaloop's workers (a container without the host's "
         "PID namespace?): whether another process shares it cannot be seen here")
BLIND_SHORT = "NVML lists no process here, so it cannot be named"
# With a blind process list, the device's own utilization at a moment flaloop's workers launch
# nothing: at or above this in most readings, another process is computing on the GPU.
BUSY_UTIL_PCT = 5
# NVML's utilization covers its last sample period (at most 1 s): after flaloop's own kernels, wait
# this long before a reading can only be someone else's
UTIL_WINDOW_S = 1.0


def busy_while_ours_idle(readings: list[dict]) -> str | None:
    """When most readings (taken while flaloop's workers launch nothing) have the device busy, what
    they show; None otherwise, or when NVML gives no utilization."""
    utils = [r.get("util_pct") for r in readings]
    busy = [u for u in utils if u is not None and u >= BUSY_UTIL_PCT]
    if not busy or 2 * len(busy) <= len(utils):
        return None
    return (f"another process computes on the GPU: up to {max(busy)}% busy in {len(busy)} of {len(utils)} readings "
            "while flaloop's workers were idle")


def process_name(pid: int) -> str | None:
    """The command name of `pid` as this machine's /proc shows it (None when it cannot)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or None
    except OSError:
        return None


def occupancy(clocks: Clocks | None, own_pids: Iterable[int], with_memory: bool = False) -> dict | None:
    """Who is on the GPU now: the compute and graphics processes that are not ours (`own_pids`),
    with their memory and name, and the device's used memory. `visible` is False when NVML lists
    no process at all although ours are there (then a foreign one would not show either).
    The device's used memory only `with_memory` (one NVML call fewer after every pair). None
    without NVML."""
    if clocks is None or not clocks.available:
        return None
    listed = clocks.processes()
    if listed is None:
        return None
    ours = {int(p) for p in own_pids}
    foreign = [{**p, "name": process_name(p["pid"])} for p in listed if p["pid"] not in ours]
    seen_ours = [p["pid"] for p in listed if p["pid"] in ours]
    # a list that names another process works, even where it names none of ours (a worker that
    # holds no CUDA context yet is not listed)
    return {"foreign": foreign, "visible": bool(seen_ours or foreign) or not ours, "own_listed": seen_ours,
            "used_mib": clocks.memory_used_mib() if with_memory else None}


def contention(pairs: Iterable, idle: dict | None = None) -> dict:
    """What the pairs' occupancy samples say (model.Pair.foreign: the foreign pids seen after each
    pair, None where it could not be seen): how many pairs ran beside another process, and who."""
    ps = list(pairs)
    seen = [p for p in ps if p.foreign is not None]
    hit = [p for p in seen if p.foreign]
    who: dict[int, int] = {}
    for p in hit:
        for pid in p.foreign:
            who[pid] = who.get(pid, 0) + 1
    names = {o["pid"]: o for o in (idle or {}).get("other_processes") or []}
    out = {"pairs": len(ps), "observed": len(seen), "contended": len(hit),
           "processes": [{"pid": pid, "pairs": n, "name": (names.get(pid) or {}).get("name") or process_name(pid),
                          "used_mib": (names.get(pid) or {}).get("used_mib")} for pid, n in sorted(who.items())]}
    idle = idle or {}
    if idle.get("available") and idle.get("processes_visible") is False:
        out["activity"] = idle.get("foreign_activity")  # the device busy while ours were idle
        if not seen:  # blind throughout; a list that named our workers around the pairs was not
            out["blind"] = BLIND
            out["quiet_start"] = bool(idle.get("quiet_start"))
    out["state"] = ("contended" if hit or idle.get("other_processes") or out.get("activity") else
                    "unknown" if out.get("blind") or not seen else "exclusive")
    return out


def contention_line(c: dict | None) -> str | None:
    """One line for the table and the report; None when the GPU was ours alone (or no GPU)."""
    if not c or c.get("state") == "exclusive" or not c.get("pairs"):
        return None
    if c["state"] == "unknown":
        text = "contention unknown: " + (c.get("blind") or "no occupancy sample during the pairs")
        if c.get("quiet_start"):
            text += (f"; the GPU read idle (under {BUSY_UTIL_PCT}% busy) when measuring began, so only a process "
                     "that started later would go unseen")
        return text
    if c.get("activity"):
        return f"CONTENDED: {c['activity']} before measuring ({BLIND_SHORT})"
    who = ", ".join(f"pid {p['pid']}" + (f" ({p['name']})" if p.get("name") else "")
                    + (f", {p['used_mib']} MiB" if p.get("used_mib") else "") for p in c["processes"]) or \
        "a process seen before measuring"
    return f"CONTENDED: {c['contended']} of {c['pairs']} pairs ran beside another process on the GPU: {who}"


def readings_of(record) -> list[dict]:
    """Every clock reading a run record (bench/record.RunRecord) holds: before and after each pair
    of every cell."""
    return [r for cell in record.cells for p in cell.pairs for r in (p.clock_before, p.clock_after) if r]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES would name them to a child: the
    variable's own entries when it is set, else one index per device NVML (or nvidia-smi) sees;
    [] on a machine without a GPU."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x.strip() for x in env.split(",") if x.strip() and x.strip() != "-1"]
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no NVML: ask nvidia-smi, else there is no GPU
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]
