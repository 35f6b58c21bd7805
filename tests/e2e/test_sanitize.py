"""`flaloop sanitize OP`: the contract's cells under compute-sanitizer on the base and the candidate.

This machine has no GPU and no compute-sanitizer, so the story is told twice: without the tool
(every tool says it is unavailable, nothing blocks), and with a stand-in `compute-sanitizer` put
first on PATH that runs the real step script on minifla and prints, in the real tool's format
(records copied from compute-sanitizer 2025.3 on an H200), the errors that the tree it runs in
plants in `.sanitizer-plant.json`. The base and the candidate each plant their own.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from support.cli import flaloop
from support.procs import wait_for
from support.repos import OP, fresh_copy, git, make_repo

from flaloop.bench import record as record_mod
from flaloop.bench.model import BenchConfig, Cell, CellResult
from flaloop.bench.record import RunRecord, TreeRef
from flaloop.cli.measure import bench_exit, print_sanitize, sanitize_record
from flaloop.core import git as git_mod
from flaloop.core import procs
from flaloop.diagnose.sanitizer import flow as sanitize_mod
from flaloop.diagnose.sanitizer import run as sanitizer_run
from flaloop.task.contract import Contract
from flaloop.task.target import Target

SHAPE = "B1_T64_H2_D32"
FWD, FWDBWD = f"{SHAPE}/fwd", f"{SHAPE}/fwdbwd"
PLANT = ".sanitizer-plant.json"
REFUSED = {"racecheck": "refuse", "initcheck": "refuse", "synccheck": "refuse"}  # keeps the test fast

FAKE = r'''#!@PYTHON@
"""A stand-in for compute-sanitizer: runs the command after the options, passes its output through,
and after each `flaloop-cell <id>` line prints the records that ./.sanitizer-plant.json plants."""
import json, os, subprocess, sys, time

MEMCHECK = """========= Invalid __global__ write of size 4 bytes
=========     at {kernel}+0x70 in chunk.py:88
=========     by thread ({t},0,0) in block (0,0,0)
=========     Access to 0x7f497c5784{t:02x} is out of bounds
=========     and is 160,924,161 bytes after the nearest allocation at 0x7f4972c00000 of size 512 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: launch [0x1d7e] in __triton_launcher.cpython-312-x86_64-linux-gnu.so
========= """
RACE = """========= Error: Race reported between Write access at {kernel}+0xa0 in chunk.py:80
=========     and Read access at {kernel}+0xb0 in chunk.py:81 [{t}56 hazards]
========= """

args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Compute Sanitizer\nVersion 2099.1.0 (a test's stand-in)")
    sys.exit(0)
if args == ["--help"]:
    print("Options:\n  --tool arg   the tool\n  --padding arg  bytes after each allocation\n  --print-limit arg")
    sys.exit(0)
opts = {}
while args and args[0].startswith("--"):
    opts[args[0]], args = args[1], args[2:]
tool = opts["--tool"]
plant = json.load(open(".sanitizer-plant.json")) if os.path.exists(".sanitizer-plant.json") else {}
mine = plant.get(tool, [])
print("========= COMPUTE-SANITIZER", flush=True)
if mine == "refuse":
    print("========= Error: Device not supported. Please refer to the \"Supported Devices\" section of the "
          "sanitizer documentation", flush=True)
    sys.exit(255)
stamps = os.environ.get("FAKE_SANITIZER_STAMPS")  # a test's record of when each process ran
if stamps:
    with open(stamps, "a") as fh:
        fh.write(f"start {tool} {os.getpid()} {time.time()}\n")
    time.sleep(float(os.environ.get("FAKE_SANITIZER_SLEEP", "0")))
proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env={**os.environ, "FAKE_SANITIZER_TOOL": tool})
if stamps:
    with open(stamps, "a") as fh:
        fh.write(f"child {tool} {proc.pid} {time.time()}\n")
n = 0
for line in proc.stdout:
    sys.stdout.write(line)
    if line.startswith("flaloop-cell "):
        for rec in [r for r in mine if r["cell"] == line.split(" ", 1)[1].strip()]:
            for t in range(rec.get("times", 2)):
                print((RACE if tool == "racecheck" else MEMCHECK).format(kernel=rec["kernel"], t=t))
                n += 1
    sys.stdout.flush()
rc = proc.wait()
if stamps:
    with open(stamps, "a") as fh:
        fh.write(f"end {tool} {os.getpid()} {time.time()}\n")
if tool == "racecheck":
    print(f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)")
else:
    print(f"========= ERROR SUMMARY: {n} error{'' if n == 1 else 's'}")
sys.exit(int(opts["--error-exitcode"]) if n else rc)
'''


def plant(repo: Path, **tools) -> None:
    (repo / PLANT).write_text(json.dumps(tools))


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fake-cuda")
    exe = d / "compute-sanitizer"
    exe.write_text(FAKE.replace("@PYTHON@", sys.executable))
    exe.chmod(0o755)
    return d


@pytest.fixture(scope="module")
def fwd_only(tmp_path_factory) -> Path:
    """minifla with a contract of one shape, fwd only: copy it, don't edit it."""
    repo = make_repo(tmp_path_factory.mktemp("fwd-only") / "minifla")
    r = flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd")
    assert r.code == 0, r.stderr
    return repo


@pytest.fixture(scope="module")
def both_modes(tmp_path_factory) -> Path:
    """minifla with a contract of one shape, fwd and fwdbwd, whose base commits its own sanitizer
    errors: a memcheck error in the fwd kernel on the fwd cell, and racecheck refused. Copy it, don't
    edit it."""
    repo = make_repo(tmp_path_factory.mktemp("both-modes") / "minifla")
    plant(repo, memcheck=[{"cell": FWD, "kernel": "chunk_linear_attn_fwd_kernel"}], **REFUSED)
    git(repo, "add", PLANT)
    git(repo, "commit", "-q", "-m", "the base's own sanitizer errors")
    r = flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd,fwdbwd")
    assert r.code == 0, r.stderr
    return repo


@pytest.fixture(scope="module")
def planted(tmp_path_factory, both_modes, fake_bin) -> tuple[Path, dict]:
    """minifla with one shape, fwd and fwdbwd (`both_modes`). The base has a memcheck error in the fwd
    kernel on the fwd cell and refuses racecheck; the candidate has the same error, and one more of its
    own in the backward kernel on the fwdbwd cell. One `flaloop sanitize --json` over memcheck and
    racecheck."""
    repo = fresh_copy(both_modes, tmp_path_factory.mktemp("sanitize") / "minifla")
    plant(repo, memcheck=[{"cell": FWD, "kernel": "chunk_linear_attn_fwd_kernel", "times": 3},
                          {"cell": FWDBWD, "kernel": "chunk_linear_attn_bwd_dq_kernel"}], **REFUSED)
    r = flaloop(repo, "sanitize", OP, "--tool", "memcheck,racecheck", "--json",
                env={"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"})
    assert r.code in (0, 1), r.stdout + r.stderr
    return repo, {"code": r.code, "doc": r.json, "stderr": r.stderr}


def test_without_compute_sanitizer_every_tool_says_unavailable_and_nothing_blocks(both_modes, tmp_path):
    if any(Path(d, "compute-sanitizer").exists() for d in ("/usr/local/cuda/bin",)):
        pytest.skip("this machine has a real compute-sanitizer in /usr/local/cuda/bin")
    # the base's planted errors are read only by the stand-in tool, which is not on this PATH
    repo = fresh_copy(both_modes, tmp_path / "minifla")
    bare = tmp_path / "bin"
    bare.mkdir()
    path = os.pathsep.join([str(bare), str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    r = flaloop(repo, "sanitize", OP, env={"PATH": path, "CUDA_HOME": str(tmp_path), "CUDA_PATH": None})
    assert r.code == 0, r.stdout + r.stderr
    for tool in sanitize_mod.TOOLS:
        assert f"{tool}: unavailable: compute-sanitizer is not on PATH" in r.stdout
    doc = json.loads(next((repo / "profile" / f"{OP}-opt" / "sanitize").glob("*/sanitize.json")).read_text())
    assert doc["blocked"] is False and doc["findings"] == [] and doc["cells"] == [FWD, FWDBWD]
    assert all(not t["available"] for t in doc["tools"].values())


def test_an_error_only_the_candidate_has_blocks_naming_the_cell_and_the_kernel(planted):
    _, res = planted
    doc = res["doc"]
    assert res["code"] == 1 and doc["exit_code"] == 1 and doc["blocked"] is True
    [f] = doc["findings"]
    assert f["rule"] == "sanitizer-memcheck" and f["blocking"] and f["severity"] == "block"
    assert f["cell"] == FWDBWD and f["side"] == "cand"
    assert "chunk_linear_attn_bwd_dq_kernel (chunk.py:88)" in f["message"]
    assert "Invalid __global__ write (out of bounds)" in f["message"] and "2x" in f["message"]
    assert "fix the masks" in f["fix"]


def test_an_error_the_base_has_too_is_pre_existing_and_does_not_block(planted):
    _, res = planted
    mem = res["doc"]["tools"]["memcheck"]
    [old] = mem["pre_existing"]
    assert (old["cell"], old["kernel"], old["count"]) == (FWD, "chunk_linear_attn_fwd_kernel", 3)  # 3 vs 2: same bug
    assert [r["kernel"] for r in mem["new"]] == ["chunk_linear_attn_bwd_dq_kernel"]
    base = mem["sides"]["base"]
    assert base["errors"] == 2 and [(r["cell"], r["count"]) for r in base["records"]] == [(FWD, 2)]
    shown = io.StringIO()
    print_sanitize(res["doc"], Console(file=shown, width=200))
    assert (f"pre-existing (the base has them too): {FWD}: Invalid __global__ write (out of bounds) in "
            "chunk_linear_attn_fwd_kernel, 3x") in shown.getvalue()
    assert "memcheck: base 2 error(s) in" in shown.getvalue() and "1 only on the candidate, 1 pre-existing" in shown.getvalue()


def test_a_tool_the_device_refuses_is_unavailable_with_the_reason(planted):
    _, res = planted
    race = res["doc"]["tools"]["racecheck"]
    assert race["available"] is False and "Device not supported" in race["reason"]
    assert list(race["sides"]) == ["base"]  # the candidate is not run once the device said no
    assert not any(f["rule"] == "sanitizer-racecheck" for f in res["doc"]["findings"])


def test_the_document_records_both_sides_every_cell_and_what_each_cost(planted):
    repo, res = planted
    doc = res["doc"]
    path = Path(doc["path"])
    assert path.parent.parent == repo / "profile" / f"{OP}-opt" / "sanitize"
    assert json.loads(path.read_text())["findings"] == doc["findings"]
    assert doc["kind"] == "sanitize" and doc["cells"] == [FWD, FWDBWD] and doc["failed"] == []
    assert doc["base_commit"] == git(repo, "rev-parse", "HEAD").strip() and doc["candidate"]["dirty"] is True
    assert "2099.1.0" in doc["sanitizer"]["version"]
    mem = doc["tools"]["memcheck"]
    for side in ("base", "cand"):
        run = mem["sides"][side]
        assert run["status"] == "ok" and run["device"] == "cpu" and run["exit_code"] == sanitizer_run.ERROR_EXIT
        assert [c["id"] for c in run["cells"]] == [FWD, FWDBWD] and all(c["ok"] for c in run["cells"])
        assert Path(run["log"]).is_file() and "flaloop-cell " + FWD in Path(run["log"]).read_text()
        assert doc["cost"]["per_tool_s"]["memcheck"][side] > 0
        assert doc["cost"]["per_cell_s"][FWDBWD]["memcheck"][side] > 0
        # the stand-in lists --padding in its --help: memcheck runs with a guard after every allocation
        assert run["flags"] == ["--padding", str(sanitizer_run.MEMCHECK_PADDING)]
    base_log = mem["sides"]["base"]["log"]
    assert "/base" in json.loads(Path(base_log).with_suffix(".json").read_text())["hello"]["op_module_file"]
    # before any tool, each side ran the step once plainly (its compiling and tuning at full speed)
    for side, warm in doc["warm"].items():
        assert warm["status"] == "ok" and warm["reason"] == "" and warm["device"] == "cpu", warm
        assert [c["id"] for c in warm["cells"]] == [FWD, FWDBWD] and all(c["ok"] for c in warm["cells"])
        text = Path(warm["log"]).read_text()
        assert "flaloop-cell " + FWD in text and "COMPUTE-SANITIZER" not in text  # no tool around it
        assert doc["cost"]["warm_s"][side] == warm["wall_s"] > 0
    assert list(doc["warm"]) == ["base", "cand"]


def test_verify_and_iter_sanitize_the_measured_snapshot_and_block_its_run_record(planted, fake_bin, monkeypatch,
                                                                                tmp_path):
    repo, _ = planted
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    target = Target.discover(str(repo))
    c = Contract.load(target, OP)
    snapshot = git_mod.snapshot(repo)  # what the bench measures: the working tree as a commit
    cells = [CellResult(Cell(SHAPE, {}, m), status="ok", verdict="FASTER") for m in ("fwd", "fwdbwd")]
    record = RunRecord(op=OP, created="now", base=TreeRef(c.base_commit), candidate=TreeRef(snapshot),
                       config=BenchConfig(), cells=cells)
    record_mod.write(tmp_path, record)
    done: dict = {}
    doc = sanitize_record(target, c, record, Console(file=io.StringIO()), done)
    assert doc["candidate"] == {"commit": snapshot} and done == {snapshot: doc}
    assert [x.verdict for x in record.cells] == ["FASTER", "BLOCKED"] and record.guard.blocked
    stored = record_mod.read(tmp_path / "record.json")
    assert bench_exit(stored) == 1 and stored.guard.findings[0].rule == "sanitizer-memcheck"
    again = RunRecord(op=OP, created="now", base=TreeRef(c.base_commit), candidate=TreeRef(snapshot),
                      config=BenchConfig(), cells=[CellResult(Cell(SHAPE, {}, "fwdbwd"), status="ok", verdict="SAME")])
    assert sanitize_record(target, c, again, Console(file=io.StringIO()), done) is doc  # iter's second bench
    assert again.cells[0].verdict == "BLOCKED"


def test_memcheck_pads_allocations_only_where_the_installed_tool_lists_the_option(tmp_path):
    """An older compute-sanitizer without --padding, or one whose --help fails, gets no flag it
    would refuse; the other tools never get it."""
    for name, text, want in (("new", "  --padding arg  bytes\n  --tool arg", True), ("old", "  --tool arg", False)):
        exe = tmp_path / name
        exe.write_text(f"#!/bin/sh\nprintf '%s\\n' '{text}'\n")
        exe.chmod(0o755)
        got = sanitizer_run.tool_flags(str(exe), "memcheck")
        assert got == (["--padding", str(sanitizer_run.MEMCHECK_PADDING)] if want else []), (name, got)
        assert sanitizer_run.tool_flags(str(exe), "initcheck") == []
    assert sanitizer_run.tool_flags(str(tmp_path / "missing"), "memcheck") == []


def test_a_bad_tool_name_is_a_usage_error(tmp_path):
    repo = make_repo(tmp_path / "minifla")
    r = flaloop(repo, "sanitize", OP, "--tool", "memchek")
    assert r.code == 2 and "memchek" in r.stderr and "memcheck, racecheck" in r.stderr


def test_a_contract_cell_filter_names_the_known_cells(fwd_only, tmp_path):
    repo = fresh_copy(fwd_only, tmp_path / "minifla")
    target = Target.discover(str(repo))
    c = Contract.load(target, OP)
    assert [x.id for x in sanitize_mod.contract_cells(target, c)] == [FWD]
    with pytest.raises(Exception, match="unknown cell"):
        sanitize_mod.contract_cells(target, c, ["nope/fwd"])


def _interrupt_when(proc, started, ready, limit: float) -> tuple[str, str]:
    """Wait (up to `limit` s) until `started()`, run `ready()` (its checks), then one SIGINT; the
    process's output. It is killed if anything fails on the way."""
    try:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not started():
            time.sleep(0.2)
        ready()
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def _outliving(pids: list[int]) -> list[int]:
    """Those of `pids` still running after up to 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(procs.running(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if procs.running(p)]


# appended to minifla's chunk.py: the module hangs at import when `when` holds, saying its pid first
HANG = """
import os as _os
import time as _t

if {when}:
    with open(_os.environ.get("HANG_PIDS", _os.devnull), "a") as _fh:
        _fh.write(f"{{_os.getpid()}}\\n")
    _t.sleep(300)
"""


def _pids(path: Path) -> list[int]:
    """The pids that hanging imports wrote to `path` (HANG_PIDS) so far."""
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _stamps(path: Path) -> list[tuple[str, str, int, float]]:
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(kind, tool, int(pid), float(t)) for kind, tool, pid, t in rows]


def test_the_tools_run_at_once_and_jobs_1_runs_them_one_after_another(fwd_only, tmp_path, fake_bin):
    repo = fresh_copy(fwd_only, tmp_path / "minifla")
    spans = {}
    for jobs in ("4", "1"):
        stamps = tmp_path / f"stamps-{jobs}"
        # at once, each tool's processes wait half a second before their step, so the spans overlap
        # for certain; one after another, each tool's two steps alone span seconds
        r = flaloop(repo, "sanitize", OP, "--tool", "memcheck,initcheck", "--jobs", jobs, "--json",
                    env={"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
                         "FAKE_SANITIZER_STAMPS": str(stamps), "FAKE_SANITIZER_SLEEP": "0.5" if jobs == "4" else "0"})
        assert r.code == 0, r.stdout + r.stderr
        assert list(r.json["tools"]) == ["memcheck", "initcheck"]  # the document keeps the tools' order
        assert all(set(t["sides"]) == {"base", "cand"} for t in r.json["tools"].values())
        rows = _stamps(stamps)
        spans[jobs] = {tool: (min(t for k, x, _, t in rows if x == tool and k == "start"),
                              max(t for k, x, _, t in rows if x == tool and k == "end"))
                       for tool in ("memcheck", "initcheck")}
    (m0, m1), (i0, i1) = spans["4"]["memcheck"], spans["4"]["initcheck"]
    assert max(m0, i0) < min(m1, i1), spans  # both tools ran at the same time
    (m0, m1), (i0, i1) = spans["1"]["memcheck"], spans["1"]["initcheck"]
    assert m1 <= i0, spans  # one after another, in the order asked


def test_an_interrupt_kills_every_running_sanitizer_and_its_step_and_removes_the_worktrees(fwd_only, tmp_path,
                                                                                           fake_bin):
    """Three tools at once; the candidate's op hangs at import (a step that runs for ever under the
    tool, the step script being the sanitizer's child and flaloop's grandchild). One SIGINT: exit
    130, every sanitizer and every step gone, both worktrees removed."""
    repo = fresh_copy(fwd_only, tmp_path / "minifla")
    chunk = repo / "minifla" / "ops" / "linear_attn" / "chunk.py"  # it hangs under the tool only
    chunk.write_text(chunk.read_text() + HANG.format(when='_os.environ.get("FAKE_SANITIZER_TOOL")'))
    git(repo, "commit", "-q", "-am", "a candidate that hangs at import")
    stamps, hangs = tmp_path / "stamps", tmp_path / "hangs"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
           "FAKE_SANITIZER_STAMPS": str(stamps), "HANG_PIDS": str(hangs)}
    proc = subprocess.Popen([sys.executable, "-m", "flaloop", "sanitize", OP, "--commit", "HEAD", "--tool",
                             "memcheck,racecheck,initcheck"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    def started() -> bool:  # three base sides done, three candidate sides started
        return len([r for r in _stamps(stamps) if r[0] == "child"]) >= 6

    def ready() -> None:
        rows = _stamps(stamps)
        assert len([r for r in rows if r[0] == "child"]) == 6, rows
        # the candidates' steps are inside the hanging import: each wrote its pid just before it sleeps
        assert wait_for(lambda: len(_pids(hangs)) >= 3, 60), _pids(hangs)

    out, err = _interrupt_when(proc, started, ready, 240)
    assert proc.returncode == 130, out + err
    pids = [pid for kind, _, pid, _ in _stamps(stamps) if kind in ("start", "child")] + _pids(hangs)
    assert not _outliving(pids), "a sanitizer or its step outlived the interrupt"
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_a_side_that_hangs_with_no_tool_is_not_run_under_one_and_an_interrupt_in_the_warm_up_cleans_up(
        fwd_only, tmp_path, fake_bin):
    """A candidate that hangs at import even without a tool: its plain warm-up run is killed at
    --timeout, no tool runs on it (each would hang as long), the base is checked, exit 3. Then the
    same candidate, interrupted in its warm-up: exit 130, its step gone, the worktrees removed."""

    repo = fresh_copy(fwd_only, tmp_path / "minifla")
    chunk = repo / "minifla" / "ops" / "linear_attn" / "chunk.py"
    chunk.write_text(chunk.read_text() + HANG.format(when="True"))
    git(repo, "commit", "-q", "-am", "a candidate that hangs at import")
    stamps, hangs = tmp_path / "stamps", tmp_path / "hangs"
    env = {"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "FAKE_SANITIZER_STAMPS": str(stamps),
           "HANG_PIDS": str(hangs)}
    # the timeout bounds the base's steps too: each took 4.6-5.5 s on the 2-core machine with three busy
    # loops beside it (docs/lab/2026-12-04-cpu.md R30), so 15 s leaves them room while the hanging
    # warm-up waits it out
    r = flaloop(repo, "sanitize", OP, "--commit", "HEAD", "--tool", "memcheck,initcheck", "--timeout", "15",
                "--json", env=env)
    assert r.code == 3, r.stdout + r.stderr
    warm = r.json["warm"]
    assert warm["base"]["status"] == "ok" and warm["cand"]["status"] == "timeout", warm
    assert "killed after 15s" in warm["cand"]["reason"]
    for tool in ("memcheck", "initcheck"):
        cand = r.json["tools"][tool]["sides"]["cand"]
        assert cand["status"] == "timeout" and cand["reason"].startswith("not run: the plain warm-up run was killed")
        assert r.json["tools"][tool]["sides"]["base"]["status"] == "ok"
        assert any(line.startswith(f"{tool}/cand: not run") for line in r.json["failed"])
    starts = [row for row in _stamps(stamps) if row[0] == "start"]
    assert sorted(tool for _, tool, _, _ in starts) == ["initcheck", "memcheck"], starts  # the base sides only
    assert not [p for p in map(int, hangs.read_text().split()) if procs.running(p)]
    assert len(git(repo, "worktree", "list").splitlines()) == 1

    hangs.unlink()
    proc = subprocess.Popen([sys.executable, "-m", "flaloop", "sanitize", OP, "--commit", "HEAD", "--tool", "memcheck"],
                            cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # once the candidate's warm-up is inside the hanging import
    out, err = _interrupt_when(proc, lambda: hangs.exists() and bool(hangs.read_text().strip()), lambda: None, 120)
    assert proc.returncode == 130, out + err
    [pid] = map(int, hangs.read_text().split())
    assert not _outliving([pid]), "the warm-up's step outlived the interrupt"
    assert len(git(repo, "worktree", "list").splitlines()) == 1
