"""Idle and during-measurement clock evidence (NVML stood in for by a fake GPU), Nsight Compute's
CSV summary and refusals, and FLA's verify.py flags mapped onto flaloop verify."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from flaloop.bench import evidence
from flaloop.bench.evidence import ClockReading
from flaloop.cli.app import with_options
from flaloop.cli.fla_compat import FlaVerifyFlags, check_test_file, resolve
from flaloop.core.errors import UsageError
from flaloop.diagnose import profile as profiling


class FakeGPU:
    """What evidence needs of evidence.Clocks: readings, processes, used memory, the memory clock's max."""

    def __init__(self, readings, procs=()):
        self.readings, self.procs, self.error = list(readings), list(procs), None

    available = True

    def read(self):
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    def processes(self):
        return self.procs

    def mem_max_mhz(self):
        return 3201

    def memory_used_mib(self):
        return 1024


def reading(sm=1980, reasons=0, temp=40, power=120.0):
    return ClockReading(sm_mhz=sm, sm_max_mhz=1980, mem_mhz=3201, throttle_reasons=reasons,
                        temperature_c=temp, power_w=power)


def test_an_idle_gpu_at_full_clock_alone_is_idle():
    ev = evidence.idle_evidence(FakeGPU([reading(), reading(sm=1965)], [{"pid": 7, "used_mib": 500}]),
                                own_pids=[7], samples=2, interval_s=0)
    assert ev["idle"] is True and ev["not_idle_because"] == []
    assert ev["sm_mhz"] == {"min": 1965, "median": 1972.5, "max": 1980} and ev["mem_max_mhz"] == 3201
    assert ev["other_processes"] == [] and ev["own_processes"] == [7]
    # the idle-parked clock (reason gpu_idle) is not a slow clock
    parked = evidence.idle_evidence(FakeGPU([reading(sm=345, reasons=0x1)]), samples=1)
    assert parked["idle"] is True and parked["throttle_reasons"] == ["gpu_idle"]


def test_a_busy_throttled_gpu_is_not_idle_and_says_why():
    ev = evidence.idle_evidence(FakeGPU([reading(sm=900, reasons=0x20 | 0x4, temp=88)],
                                        [{"pid": 4242, "used_mib": 30000}]), samples=1)
    assert ev["idle"] is False
    why = " ".join(ev["not_idle_because"])
    assert "45% of max" in why and "sw_thermal_slowdown" in why and "sw_power_cap" in why and "4242" in why


def test_no_gpu_says_so():
    assert evidence.idle_evidence(None) == {"available": False, "reason": "no GPU"}
    cpu = evidence.Clocks(None)
    assert evidence.idle_evidence(cpu)["reason"] == "no GPU"
    assert evidence.during_evidence([None, None])["available"] is False


def test_during_evidence_summarises_the_pairs_readings():
    rs = [reading().to_dict(), reading(sm=1400, reasons=0x40, temp=85, power=690.0), None, reading(sm=1900)]
    ev = evidence.during_evidence(rs)
    assert ev["n_readings"] == 3 and ev["n_throttled"] == 1 and ev["n_below_floor"] == 1
    assert ev["throttle_reasons"] == ["hw_thermal_slowdown"]
    assert ev["temperature_c"]["max"] == 85 and ev["power_w"]["max"] == 690.0
    from flaloop.bench.record import RunRecord

    pair = {"order": "AB", "base_ms": 1.0, "cand_ms": 1.0}
    record = RunRecord.from_dict({"op": "op", "created": "", "base": {"commit": "b" * 40}, "cells": [
        {"cell": {"shape_name": "S", "shape": {}, "mode": "fwd"},
         "pairs": [{**pair, "clock_before": rs[0], "clock_after": rs[1]},
                   {**pair, "clock_before": None, "clock_after": rs[3]}]}]})
    assert len(evidence.readings_of(record)) == 3


def test_fingerprint_carries_tilelang_and_cutlass():
    fp = evidence.fingerprint({"tilelang": "0.1.6", "cutlass": "4.2.0", "torch": "2.11"}, evidence.Clocks(None))
    assert fp["tilelang"] == "0.1.6" and fp["cutlass"] == "4.2.0" and fp["nvml"] == "no GPU"


# -- Nsight Compute ------------------------------------------------------------------------------

NCU_CSV = '''"ID","Kernel Name","gpu__time_duration.sum","gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active","dram__throughput.avg.pct_of_peak_sustained_elapsed"
"","","us","%","%","%","%"
"0","chunk_fwd_kernel_o","30","80","40","50","78"
"1","chunk_fwd_kernel_h","10","40","60","25","38"
'''


def test_ncu_raw_csv_is_summarised_duration_weighted():
    s = profiling.summarize_ncu_csv(NCU_CSV)
    assert s["n_kernels"] == 2 and s["total_us"] == 40
    assert s["kernels"][0]["name"] == "chunk_fwd_kernel_o"
    assert s["memory_throughput_pct"] == pytest.approx((80 * 30 + 40 * 10) / 40)
    assert s["achieved_occupancy_pct"] == pytest.approx((50 * 30 + 25 * 10) / 40)
    assert s["compute_sol_pct"] == pytest.approx(45.0)
    assert s["dram_throughput_pct"] == pytest.approx((78 * 30 + 38 * 10) / 40)
    # the Speed Of Light section's name for DRAM throughput in other ncu versions
    other = profiling.summarize_ncu_csv(NCU_CSV.replace("dram__throughput", "gpu__dram_throughput"))
    assert other["dram_throughput_pct"] == s["dram_throughput_pct"]


def test_ncu_missing_or_forbidden_is_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    path, why = profiling.ncu_status()
    assert path is None and "not installed" in why
    text = "==PROF== Connected\n==ERROR== ERR_NVGPUCTRPERM - The user does not have permission\n"
    assert "ERR_NVGPUCTRPERM" in profiling.ncu_forbidden(text)
    assert profiling.ncu_forbidden("==PROF== Disconnected") is None


# -- FLA's verify.py flags -----------------------------------------------------------------------

def flags(**kw) -> FlaVerifyFlags:
    return FlaVerifyFlags(**kw)


def test_fla_spellings_map_onto_flaloop_verify():
    call = resolve(None, [], flags(op_flag="chunk_gla", gate_k="T15"), None, None)
    assert (call.op, call.k_expr, call.modes) == ("chunk_gla", "T15", None)
    # `--op chunk_gla --modes fwd fwdbwd`: click hands the second mode over as the positional
    call = resolve("fwdbwd", [], flags(op_flag="chunk_gla"), None, "fwd")
    assert (call.op, call.modes) == ("chunk_gla", "fwd,fwdbwd")
    # `flaloop verify chunk_gla --modes fwd fwdbwd`: the second mode is an extra argument
    call = resolve("chunk_gla", ["fwdbwd"], flags(), None, "fwd")
    assert (call.op, call.modes) == ("chunk_gla", "fwd,fwdbwd")
    assert resolve(None, [], flags(list_ops=True), None, None).list_only
    assert resolve("x", [], flags(profile=True), None, None).profile


def test_fla_spellings_that_cannot_mean_anything_are_refused():
    with pytest.raises(UsageError, match="two ops"):
        resolve("a", [], flags(op_flag="b"), None, None)
    with pytest.raises(UsageError, match="no op"):
        resolve(None, [], flags(), None, None)
    with pytest.raises(UsageError, match="disagree"):
        resolve("a", [], flags(gate_k="x"), "y", None)
    with pytest.raises(UsageError, match="unknown mode"):
        resolve("a", [], flags(), None, "fwd,bwd")
    with pytest.raises(UsageError, match="layer|only 'op'"):
        resolve("a", [], flags(kind="layer"), None, None)
    call = resolve("a", [], flags(test_file="tests/ops/test_other.py"), None, None)
    with pytest.raises(UsageError, match="frozen in the contract"):
        check_test_file(call, "tests/ops/test_gla.py")
    check_test_file(resolve("a", [], flags(test_file="./tests/ops/test_gla.py"), None, None), "tests/ops/test_gla.py")


@dataclass
class ModeOptions:
    modes: Annotated[str | None, typer.Option("--modes")] = None


def test_the_flags_parse_as_verify_would_take_them():
    """A command wired as the report proposes for verify_cmd: optional OP, extra args allowed."""
    app = typer.Typer()
    seen = {}

    @app.command("verify", context_settings={"allow_extra_args": True})
    @with_options(FlaVerifyFlags, ModeOptions)
    def verify(ctx: typer.Context, op: Annotated[str | None, typer.Argument()] = None,
               k_expr: Annotated[str | None, typer.Option("-k")] = None,
               fla_verify_flags: FlaVerifyFlags = None, mode_options: ModeOptions = None) -> None:
        seen["call"] = resolve(op, ctx.args, fla_verify_flags, k_expr, mode_options.modes)

    @app.command("other")
    def other() -> None:  # a second command, so that typer keeps the command name
        pass

    r = CliRunner().invoke(app, ["verify", "--op", "chunk_gla", "--gate-k", "T15", "--modes", "fwd", "fwdbwd"])
    assert r.exit_code == 0, r.output
    c = seen["call"]
    assert (c.op, c.k_expr, c.modes) == ("chunk_gla", "T15", "fwd,fwdbwd")
    r = CliRunner().invoke(app, ["verify", "chunk_gla", "--modes", "fwd", "fwdbwd", "--profile"])
    assert r.exit_code == 0, r.output
    assert (seen["call"].op, seen["call"].modes, seen["call"].profile) == ("chunk_gla", "fwd,fwdbwd", True)
