"""compute-sanitizer's findings, in-process: records parsed per kind and kernel, faults and CUDA API
errors counted, a cell the base never checked, and a run record blocked by name. `flaloop sanitize`
under a stand-in tool is in tests/e2e/test_sanitize.py."""

from __future__ import annotations

from support.repos import OP

from flaloop.bench.model import BenchConfig, Cell, CellResult
from flaloop.bench.record import RunRecord, TreeRef
from flaloop.diagnose.sanitizer import flow as sanitize_mod
from flaloop.diagnose.sanitizer import log as sanitizer_log
from flaloop.diagnose.sanitizer import run as sanitizer_run

SHAPE = "B1_T64_H2_D32"


FWD, FWDBWD = f"{SHAPE}/fwd", f"{SHAPE}/fwdbwd"


def test_a_cell_that_faults_on_the_candidate_only_is_reported_not_fully_checked():
    # racecheck on an H200, a candidate whose load reads far past q: no race, but an illegal address
    ok = [{"id": FWD, "ok": True}, {"id": FWDBWD, "ok": True}]
    dead = [{"id": FWD, "ok": False, "error": "AcceleratorError: CUDA error: an illegal memory access was encountered"},
            {"id": FWDBWD, "ok": False, "error": "AcceleratorError: CUDA error: an illegal memory access was encountered"}]
    base = sanitizer_run.SideRun("base", "racecheck", errors=0, cells=ok)
    cand = sanitizer_run.SideRun("cand", "racecheck", errors=0, cells=dead)
    entry, found = sanitize_mod.tool_result("racecheck", base, cand)
    assert found == [] and entry["available"] is True
    assert [u.split(" failed")[0] for u in entry["unchecked"]] == [FWD, FWDBWD]
    assert "illegal memory access" in entry["unchecked"][0]


def test_an_error_where_the_base_was_never_checked_blocks_without_saying_the_base_lacks_it():
    # the base's plain warm-up timed out, so no tool ran on it: its (empty) records prove nothing
    warm = {"log": "warm-base.log", "reason": "killed after 25s (--timeout)"}
    base = sanitizer_run.not_run("memcheck", "base", warm)
    cand = sanitizer_run.SideRun("cand", "memcheck", errors=3, cells=[{"id": FWD, "ok": True}],
                                records=[sanitizer_log.ErrorRecord(FWD, "Invalid __global__ read", "fwd_kernel", count=3)])
    entry, [f] = sanitize_mod.tool_result("memcheck", base, cand)
    assert f.blocking and f.cell == FWD and "never on the base" not in f.message, f.message
    assert "the base was not checked there (timeout: not run: the plain warm-up run was killed after 25s" in f.message
    assert "whether it has it too is unknown" in f.message and "base: not run" in entry["reason"]
    # a base that finished the cell still says so
    base_ok = sanitizer_run.SideRun("base", "memcheck", errors=0, cells=[{"id": FWD, "ok": True}])
    [f] = sanitize_mod.tool_result("memcheck", base_ok, cand)[1]
    assert "3x on the candidate, never on the base" in f.message
    # a base killed after its first cell: the cell it reported on is compared, the other is not
    cut = sanitizer_run.SideRun("base", "memcheck", status="timeout", reason="killed after 240s (--timeout)",
                               cells=[{"id": FWD, "ok": True}])
    two = sanitizer_run.SideRun("cand", "memcheck", errors=2, cells=[{"id": FWD, "ok": True}, {"id": FWDBWD, "ok": True}],
                               records=[sanitizer_log.ErrorRecord(FWD, "Invalid __global__ read", "k"),
                                        sanitizer_log.ErrorRecord(FWDBWD, "Invalid __global__ read", "k")])
    first, second = sanitize_mod.tool_result("memcheck", cut, two)[1]
    assert "never on the base" in first.message and "not checked there (timeout: killed after 240s" in second.message


def test_cuda_api_errors_after_a_kernel_fault_are_counted_into_its_finding():
    new = [sanitizer_log.ErrorRecord(FWD, "Invalid __global__ read (out of bounds)", "fwd_kernel", count=256),
           sanitizer_log.ErrorRecord(FWD, 'Program hit cudaErrorLaunchFailure on cudaGetLastError', None),
           sanitizer_log.ErrorRecord(FWDBWD, 'Program hit cudaErrorLaunchFailure on cudaStreamIsCapturing', None)]
    [f] = sanitize_mod.findings_for("memcheck", new, {})
    assert f.cell == FWD and "fwd_kernel" in f.message and "then 2 failed CUDA API call(s)" in f.message
    [api] = sanitize_mod.findings_for("memcheck", new[1:2], {})  # on its own, an API error is a finding
    assert api.blocking and api.message.startswith("Program hit cudaErrorLaunchFailure")


def test_a_cpu_run_of_the_real_tool_is_zero_errors_not_a_refusal():
    # compute-sanitizer 2025.3 on a program that makes no CUDA call (exit 255, no summary)
    log = sanitizer_log.parse_log("========= COMPUTE-SANITIZER\nflaloop-cell X/fwd\n"
                                 "========= Error: Target application terminated before first instrumented API call\n")
    assert log.no_cuda and log.problem is None and log.records == []


def test_real_racecheck_and_synccheck_records_read_as_one_kind_per_kernel():
    text = """========= COMPUTE-SANITIZER
flaloop-cell X/fwd
========= Error: Race reported between Write access at race_kernel(int *)+0xa0
=========     and Write access at race_kernel(int *)+0xa0 [64 hazards]
=========     and Read access at race_kernel(int *)+0xb0 [256 hazards]
=========
flaloop-cell X/fwdbwd
========= Barrier error detected. Divergent thread(s) in warp.
=========     at 0x000000b0 in div.cu:10:div_kernel(int *)
=========     by thread (0,0,0) in block (0,0,0)
=========
========= Barrier error detected. Divergent thread(s) in warp.
=========     at 0x000000b0 in div.cu:10:div_kernel(int *)
=========     by thread (1,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 16 errors
========= ERROR SUMMARY: 14 errors were not printed. Use --print-limit option to adjust the number of printed errors
"""
    log = sanitizer_log.parse_log(text)
    race, barrier = log.records
    assert (race.cell, race.kernel, race.kind) == ("X/fwd", "race_kernel",
                                                   "Race reported between Write access and Read / Write access")
    assert (barrier.cell, barrier.kernel, barrier.where, barrier.count) == ("X/fwdbwd", "div_kernel", "div.cu:10", 2)
    assert log.errors == 16 and log.truncated


def test_attach_blocks_the_named_cell_of_a_run_record():
    cells = [CellResult(Cell(SHAPE, {}, m), status="ok", verdict="FASTER") for m in ("fwd", "fwdbwd")]
    record = RunRecord(op=OP, created="now", base=TreeRef("a" * 40), candidate=TreeRef("b" * 40),
                       config=BenchConfig(), cells=cells)
    f = sanitize_mod.findings_for("memcheck", [sanitizer_log.ErrorRecord(FWDBWD, "Invalid __global__ read", "k")], {})
    assert sanitize_mod.attach(record, {"findings": [x.to_dict() for x in f]}) is True
    assert [c.verdict for c in record.cells] == ["FASTER", "BLOCKED"]
    assert "sanitizer-memcheck" in record.cells[1].reason and record.guard.blocked
    assert record.summary.n_blocked == 1
