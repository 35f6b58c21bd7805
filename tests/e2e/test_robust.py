"""Faults and races a user meets: Ctrl-C pressed twice, flaloop killed outright, two runs at once.

Workers and pytest are found through /proc (descendants of the flaloop process, or processes whose
command line names the test's repo). The toy op gets a hook: with TOY_MARK set it appends a line to
that file (so the test knows the op is running), with TOY_SLEEP it then sleeps that long.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.cli import flaloop
from support.procs import alive, descendants, fork_servers, wait_for
from support.repos import edit, git, worktrees

from flaloop.inside import WORKER as WORKER_PKG

FAST = Path("toyop/ops/toy/fast.py")
# the unseen-shapes check is off here (it has its own tests, tests/e2e/test_unseen.py): the suite's time
QUICK = ["--device", "cpu", "--min-pairs", "6", "--max-pairs", "8", "--cell-seconds", "30", "--unseen-shapes", "0"]
WORKER = WORKER_PKG / "__main__.py"


def sleepy(repo: Path) -> None:
    """The candidate's op announces itself in $TOY_MARK and sleeps $TOY_SLEEP seconds."""
    edit(repo / FAST, "    scale = q.shape",
         "    import os, time\n"
         "    if os.environ.get('TOY_MARK'):\n"
         "        open(os.environ['TOY_MARK'], 'a').write('running\\n')\n"
         "    time.sleep(float(os.environ.get('TOY_SLEEP', '0')))\n"
         "    scale = q.shape")


def start(repo: Path, *args: str, env: dict | None = None, stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flaloop", *args], cwd=repo, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})})


def marked(mark: Path, n: int = 1) -> bool:
    return mark.exists() and mark.read_text().count("running") >= n


def test_signals_during_cleanup_cannot_leave_a_worker_or_worktree_behind(toy, tmp_path):
    # Seen on the CPU machine: SIGTERM, then SIGINT 1 s later while a worker warmed up. The second
    # signal aborted the cleanup the first had started, and a worker ran on with its parent gone.
    sleepy(toy)
    mark = tmp_path / "mark"
    # spawned workers (forked ones are flaloop's grandchildren: tests/e2e/test_forkserver.py)
    proc = start(toy, "bench", "toy_attn", "--json", "--no-forkserver", *QUICK,
                 env={"TOY_MARK": str(mark), "TOY_SLEEP": "120"})
    assert wait_for(lambda: marked(mark), 90), "the candidate never reached its warm-up"
    workers = descendants(proc.pid)
    tree = [w for w in worktrees(toy) if w != str(toy)]
    assert len(workers) >= 2 and len(tree) == 2  # the base and the snapshot of the working tree
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)  # lands while the busy candidate is being shut down
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("cleaning up, please wait") == 1
    doc = json.loads(out)
    assert doc["exit_code"] == 130 and json.loads(Path(doc["record"]).read_text())["interrupted"] is True
    assert not [p for p in workers if alive(p)]
    assert worktrees(toy) == [str(toy)]
    assert not [t for t in tree if Path(t).parent.exists()]


def test_flaloop_killed_outright_takes_its_workers_and_the_next_run_removes_its_worktree(toy, tmp_path):
    sleepy(toy)
    mark = tmp_path / "mark"
    proc = start(toy, "bench", "toy_attn", "--no-forkserver", *QUICK, env={"TOY_MARK": str(mark), "TOY_SLEEP": "120"})
    assert wait_for(lambda: marked(mark), 90)
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    proc.kill()  # SIGKILL: no cleanup at all
    proc.communicate()
    assert wait_for(lambda: not [p for p in workers if alive(p)], 5), "a worker outlived flaloop"
    left = [w for w in worktrees(toy) if w != str(toy)]
    assert len(left) == 2  # the base and the snapshot of the working tree
    assert git(toy, "worktree", "list", "--porcelain").count(f"locked flaloop pid={proc.pid} ") == 2
    git(toy, "checkout", "--", str(FAST))  # the user reverts the sleepy op
    r = flaloop(toy, "bench", "toy_attn", *QUICK, "--modes", "fwd", "--rounds", "1")
    assert r.code == 0, r.stderr
    for w in left:
        assert f"removed a worktree left by a killed flaloop run (pid {proc.pid}): {w}" in r.stdout
    assert worktrees(toy) == [str(toy)] and not [w for w in left if Path(w).parent.exists()]


def test_a_worker_whose_parent_dies_exits_by_its_own_watchdog(toy):
    # The middle process starts the worker without flaloop's PDEATHSIG, and the test keeps the
    # worker's stdin open: only the worker's lifeline can end it once the middle process is gone.
    middle = ("import subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, {str(WORKER)!r}, '--tree', {str(toy)!r}, '--registry', "
              f"{str(toy / 'benchmarks/ops/registry.py')!r}, '--op', 'toy_attn', '--side', 'cand'])\n"
              "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", middle], stdin=subprocess.PIPE,
                            env={**os.environ, "FLALOOP_LIFELINE": "1"})
    worker = wait_for(lambda: descendants(proc.pid), 30)
    assert worker
    time.sleep(1.5)  # the worker arms its lifeline first thing
    proc.kill()
    proc.wait()
    try:
        assert wait_for(lambda: not alive(worker[0]), 5), "the orphaned worker kept running"
    finally:
        proc.stdin.close()
        if alive(worker[0]):
            os.kill(worker[0], signal.SIGKILL)


def test_a_killed_gate_takes_pytest_and_its_xdist_workers_along(toy, tmp_path):
    sleepy(toy)
    mark = tmp_path / "mark"
    # a killed gate leaves its small temp dir behind, which the next run removes (its owner is
    # dead); in a private TMPDIR, so that the listing below sees this run's only
    private = Path(tempfile.mkdtemp(prefix="killed-gate-"))
    try:
        proc = start(toy, "gate", "toy_attn", "--workers", "2",
                     env={"TOY_MARK": str(mark), "TOY_SLEEP": "120", "TMPDIR": str(private)})
        assert wait_for(lambda: marked(mark, 2), 120), "the xdist workers never ran the op"
        tree = descendants(proc.pid)
        tree = [p for p in tree if p not in fork_servers(tree)]  # the base collection's warm server stays
        assert len(tree) >= 3  # pytest and two xdist workers
        proc.kill()
        proc.communicate()
        assert wait_for(lambda: not [p for p in tree if alive(p)], 5), "pytest or an xdist worker outlived flaloop"
        left = sorted(d.name for d in private.glob("flaloop-*"))
        assert [n for n in left if n.startswith("flaloop-gate-")], left
        git(toy, "checkout", "--", str(FAST))
        r = flaloop(toy, "bench", "toy_attn", *QUICK, "--modes", "fwd", "--rounds", "1", env={"TMPDIR": str(private)})
        assert r.code == 0, r.stderr
        assert not list(private.glob("flaloop-gate-*")) and not list(private.glob("flaloop-wt-*")), \
            sorted(d.name for d in private.iterdir())
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_a_killed_gate_takes_its_pytest_forked_by_the_warm_server_along(toy, tmp_path, monkeypatch):
    """Without xdist workers the gate's pytest is the fork server's child, not flaloop's: killed
    outright, flaloop cannot take it along, and its lifeline must."""
    from flaloop.bench import forkservers
    from flaloop.task.contract import Contract
    from flaloop.task.gate import warm_preload
    from flaloop.task.pytest_run import clean_env
    from flaloop.task.target import Target

    sleepy(toy)
    mark = tmp_path / "mark"
    for name, value in (("TOY_MARK", str(mark)), ("TOY_SLEEP", "120"), ("TRITON_INTERPRET", "1")):
        monkeypatch.setenv(name, value)
    target = Target.discover(toy)
    env, preload = clean_env(target.extra_strip_env())[0], warm_preload(target, Contract.load(target, "toy_attn"))
    forkservers.start(target.python, env, preload)  # the gate's key: as a bench of the op leaves one
    server = wait_for(lambda: forkservers.ForkServer.connect(target.python, env, preload), 120, step=0.5)
    assert server is not None, "the fork server never came up"
    server_pid = server.pid
    server.close()
    proc = start(toy, "gate", "toy_attn")
    try:
        assert wait_for(lambda: marked(mark), 120), "the gate's test never ran the op"
        forked = [p for p in descendants(server_pid)]
        assert forked and not [p for p in forked if p in descendants(proc.pid)]  # the server's, not flaloop's
    finally:
        proc.kill()
        proc.communicate()
    assert wait_for(lambda: not [p for p in forked if alive(p)], 10), "the forked pytest outlived flaloop"
    assert alive(server_pid)


# -- two runs at once -----------------------------------------------------------------------------

def test_a_second_run_on_the_same_op_waits_or_fails_with_no_wait(toy, tmp_path):
    sleepy(toy)
    mark = tmp_path / "mark"
    first = start(toy, "bench", "toy_attn", "--json", *QUICK, env={"TOY_MARK": str(mark), "TOY_SLEEP": "120"})
    assert wait_for(lambda: marked(mark), 90)
    r = flaloop(toy, "bench", "toy_attn", "--no-wait", "--json", *QUICK)
    assert r.code == 2
    assert f"profile/toy_attn-opt/ is in use by flaloop pid {first.pid} (bench, started " in r.stderr
    assert r.json["exit_code"] == 2 and "--no-wait" in r.json["hint"]
    log = tmp_path / "second.stderr"
    with open(log, "w") as fh:
        second = start(toy, "bench", "toy_attn", "--json", *QUICK, "--modes", "fwd", "--rounds", "1", stderr=fh)
        waiting = f"waiting for flaloop pid {first.pid} (bench, started "
        assert wait_for(lambda: waiting in log.read_text(), 30), log.read_text()
        first.send_signal(signal.SIGINT)
        out1, _ = first.communicate(timeout=60)
        out2, _ = second.communicate(timeout=120)
    assert first.returncode == 130 and second.returncode == 0, log.read_text()
    rec1, rec2 = json.loads(out1)["record"], json.loads(out2)["path"]
    assert Path(rec1).parent != Path(rec2).parent  # never one run directory for two runs
    assert json.loads(Path(rec2).read_text())["summary"]["n_measured"] == 1
    assert "with profile/toy_attn-opt/" in log.read_text()


def test_two_ops_of_one_repo_run_side_by_side(toy):
    a = start(toy, "bench", "toy_attn", "--json", *QUICK, "--modes", "fwd", "--rounds", "1")
    b = start(toy, "bench", "toy_log", "--json", *QUICK, "--modes", "fwd", "--rounds", "1", "--input", "q=sigmoid")
    (out_a, err_a), (out_b, err_b) = a.communicate(timeout=300), b.communicate(timeout=300)
    assert a.returncode == 0 and b.returncode == 0, err_a + err_b
    assert "waiting for" not in err_a + err_b
    rec_a, rec_b = json.loads(out_a), json.loads(out_b)
    assert "/profile/toy_attn-opt/runs/" in rec_a["path"] and "/profile/toy_log-opt/runs/" in rec_b["path"]
    assert worktrees(toy) == [str(toy)]


# -- the plumbing, in small ------------------------------------------------------------------------

SIGNALS = """
import os, signal
from flaloop.core import procs
procs.install_signal_handlers()
try:
    with procs.deferred_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        print("inside: still running", flush=True)
    print("BUG: not raised", flush=True)
except KeyboardInterrupt:
    print("raised when the block ended", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("second: ignored", flush=True)
os.kill(os.getpid(), signal.SIGINT)
print("third: ignored", flush=True)
"""


def test_an_interrupt_is_held_in_a_deferred_block_and_later_ones_only_say_wait():
    r = subprocess.run([sys.executable, "-c", SIGNALS], capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines() == ["inside: still running", "raised when the block ended", "second: ignored",
                                     "third: ignored"], r.stdout + r.stderr
    assert r.stderr.count("cleaning up, please wait") == 1


def test_a_chatty_child_cannot_grow_its_log_past_the_cap(tmp_path):
    from flaloop.core import procs

    log = procs.CappedLog(tmp_path / "child.stderr", head=100_000, tail=10_000)
    chatty = "import sys\nfor i in range(40000): sys.stderr.write(f'line {i:06d} of chatter\\n')\n"
    proc = procs.spawn([sys.executable, "-c", chatty], stderr=log)
    log.started()
    proc.wait(timeout=60)
    log.drain()
    assert log.tail(100).rstrip().endswith("line 039999 of chatter")
    log.close()
    text = (tmp_path / "child.stderr").read_text()
    assert text.startswith("line 000000 of chatter")
    assert "bytes of output dropped here" in text and text.rstrip().endswith("line 039999 of chatter")
    assert len(text) < 100_000 + 10_000 + 200  # of ~960 kB written


def test_a_log_closed_twice_or_written_after_closing_touches_no_other_file(tmp_path):
    """CI once read `OSError: [Errno 9] Bad file descriptor` in a worker log's pump thread: a log
    closed twice closed its pipe's number twice, by then another file's. Closing again is a no-op,
    the read end is the pump's to close, and what a grandchild writes after the close is dropped."""
    import threading

    from flaloop.core import procs

    errors: list = []
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        log = procs.CappedLog(tmp_path / "a.stderr")
        late = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stderr.write('early\\n')\n"
                                 "sys.stderr.flush(); time.sleep(1.5); sys.stderr.write('late\\n')"], stderr=log)
        log.started()
        log.close(timeout=0.3)  # the child still holds the pipe
        other = open(tmp_path / "other.txt", "wb")  # noqa: SIM115 - may take the number a stray close would hit
        log.close()
        other.write(b"kept")
        other.flush()
        other.close()
        late.wait(timeout=30)
        log.drain(5.0)
        assert not log._thread.is_alive()
    finally:
        threading.excepthook = threading.__excepthook__
    assert errors == []
    assert (tmp_path / "other.txt").read_bytes() == b"kept"
    assert (tmp_path / "a.stderr").read_text() == "early\n"


def test_the_suites_state_check_notices_lost_work_and_accepts_a_committed_attempt(tmp_path):
    from support.repos import commit_all
    from support.userstate import assert_user_state_kept, user_state

    repo = tmp_path / "r"
    repo.mkdir()
    (repo / "a.py").write_text("one\n")
    commit_all(repo)
    (repo / "a.py").write_text("two\n")  # the user's uncommitted change
    before = user_state(repo)
    (repo / "a.py").write_text("one\n")  # a command that threw the change away
    with pytest.raises(AssertionError, match="changed the user's files: a.py"):
        assert_user_state_kept(repo, before, ["bench", "op"], 0)
    git(repo, "commit", "-qm", "lost", "--allow-empty")
    with pytest.raises(AssertionError, match="lost the user's a.py"):
        assert_user_state_kept(repo, before, ["iter", "op"], 0)
    (repo / "a.py").write_text("two\n")
    git(repo, "commit", "-qam", "attempt")  # iter commits the attempt, then reverts it
    (repo / "a.py").write_text("one\n")
    git(repo, "commit", "-qam", "revert")
    assert_user_state_kept(repo, before, ["iter", "op"], 0)
