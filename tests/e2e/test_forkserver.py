"""The warm fork server: a bench that found none starts one and forks from it; the next forks from
the same one; its forked workers die with the flaloop that asked for them; an edited library
retires it; `flaloop clean` stops it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.cli import flaloop
from support.procs import alive, ppid, wait_for
from support.repos import edit

from flaloop.bench import forkservers
from flaloop.core import git

FAST = Path("toyop/ops/toy/fast.py")
# the unseen-shapes check is off here (it has its own tests, tests/e2e/test_unseen.py): the suite's time
QUICK = ["--device", "cpu", "--min-pairs", "6", "--max-pairs", "8", "--cell-seconds", "20", "--modes", "fwd", "--unseen-shapes", "0"]


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def test_the_next_bench_forks_from_the_server_the_first_left_and_clean_stops_it(toy):
    own = {"FS_TEST_ENV": str(toy)}  # an environment no other test's server has
    first = flaloop(toy, "bench", "toy_attn", "--aa", "--json", *QUICK, env=own)
    assert first.code == 0, first.stderr[-3000:]
    fs = first.json["env"]["forkserver"]
    # none was warm for this key: the run started one and forked its workers from it
    assert fs["used"] is True and fs["started"] is True and fs["why"] == "" and fs["start_wait_s"] > 0, fs
    sock = Path(fs["socket"])
    second = flaloop(toy, "bench", "toy_attn", "--aa", "--json", *QUICK, env=own)
    assert second.code == 0, second.stderr[-3000:]
    fs2 = second.json["env"]["forkserver"]
    assert fs2["used"] is True and fs2["started"] is False and fs2["socket"] == str(sock) and "start_wait_s" not in fs2
    assert fs2["preload"]["n"] >= 2 and not fs2["preload"]["failed"] and fs2["pid"] == fs["pid"], fs2
    assert sock.exists() and not sock.with_suffix(".starting").exists()
    assert all(c["status"] == "ok" and c.get("estimate") for c in second.json["cells"]), second.json["cells"]
    server = fs2["pid"]
    # the server outlives the run, its workers do not (it reaps them within a second)
    assert alive(server) and wait_for(lambda: not children(server), 10), children(server)
    human = flaloop(toy, "bench", "toy_attn", "--aa", *QUICK, "--rounds", "1", env=own)
    assert f"workers forked from a warm fork server (pid {server})" in human.stdout, human.stdout
    # another key: the run starts its own server, says so, and (one per checkout) stops the first
    other = flaloop(toy, "bench", "toy_attn", "--aa", *QUICK, "--rounds", "1", env={"FS_TEST_ENV": f"{toy}/other"})
    assert "workers forked from a fork server this run started" in other.stdout, other.stdout
    cleaned = flaloop(toy, "clean", "toy_attn", "--json")
    assert cleaned.code == 0 and cleaned.json["forkservers_stopped"] >= 1
    assert wait_for(lambda: not alive(server), 10) and not sock.exists()


@pytest.fixture
def private_tmp():
    """A temp dir of this test's runs alone, outside pytest's (whose path holds `test_`, which flaloop
    refuses as TMPDIR): another test's flaloop reaps a killed run's worktrees in the shared one."""
    d = Path(tempfile.mkdtemp(prefix="killed-bench-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_forked_workers_die_with_the_flaloop_that_asked_for_them(toy, tmp_path, private_tmp):
    gate = tmp_path / "sleep-now"
    edit(toy / FAST, "    scale = q.shape",
         "    import os, time\n"
         f"    while os.path.exists({str(gate)!r}):\n"
         "        time.sleep(0.2)\n"
         "    scale = q.shape")
    tmp_env = {"TMPDIR": str(private_tmp)}  # the killed run's worktrees are read below, before the next run
    warm = flaloop(toy, "bench", "toy_attn", "--json", *QUICK, "--rounds", "1", env=tmp_env)
    assert warm.code == 0, warm.stderr[-3000:]
    fs = warm.json["env"]["forkserver"]
    sock = Path(fs.get("left_warm") or fs["socket"])  # left by this run, or used by it
    assert wait_for(sock.exists, 120)
    gate.write_text("sleep")
    # its output kept: a run that never forks must say why (a failure seen once under a full suite's load)
    err = tmp_path / "bench.err"
    with open(err, "w") as err_fd:
        proc = subprocess.Popen([sys.executable, "-m", "flaloop", "bench", "toy_attn", *QUICK], cwd=toy,
                                stdout=subprocess.DEVNULL, stderr=err_fd,
                                env={**os.environ, "TRITON_INTERPRET": "1", **tmp_env})
    server = None
    try:
        def forked() -> list[int]:
            # A forked worker keeps the server's command line, and once pids wrap around (`pid_max` 32768 on
            # the 2-core machine, a few suites' worth of processes) it can be listed before its server:
            # the server is the one process of that command line whose parent does not have it.
            nonlocal server
            found = {}
            for p in Path("/proc").glob("[0-9]*"):
                try:
                    cmd = (p / "cmdline").read_bytes()
                except OSError:
                    continue
                if b"--forkserver" in cmd and str(sock).encode() in cmd:
                    found[int(p.name)] = ppid(int(p.name))
            roots = [pid for pid, parent in found.items() if parent is not None and parent not in found]
            if len(roots) != 1:
                return []
            server = roots[0]
            return children(server)
        assert wait_for(lambda: len(forked()) >= 2, 90), \
            f"no forked workers (server {server}, bench exit {proc.poll()}): {err.read_text()[-3000:]}"
        workers = forked()
        proc.kill()  # SIGKILL: no cleanup at all
        proc.wait()
        assert wait_for(lambda: not [w for w in workers if alive(w)], 10), "a forked worker outlived flaloop"
        assert alive(server)
        # the killed run's base worktree (under the temp dir) is removed by the next run
        left = [p for p in git.list_worktrees(toy) if Path(p) != toy]
        assert left and all(Path(p).exists() for p in left)
        gate.unlink()
        after = flaloop(toy, "bench", "toy_attn", "--json", *QUICK, "--rounds", "1", env=tmp_env)
        assert after.code == 0, after.stderr[-3000:]
        assert not any(Path(p).exists() for p in left) and git.list_worktrees(toy) == [str(toy)]
    finally:
        gate.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
        for p in git.list_worktrees(toy):  # never leave the temp dir a worktree, whatever failed above
            if Path(p) != toy:
                git.remove_worktree(toy, Path(p))


def test_an_edited_library_retires_the_server_and_too_many_servers_make_room(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "toylib_fs.py").write_text("VALUE = 1\n")
    env = {**os.environ, "PYTHONPATH": f"{lib}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    preload = ["json", "toylib_fs"]

    def up(e):
        conn = forkservers.ForkServer.connect(sys.executable, e, preload)
        if conn is None:
            return None
        conn.close()
        return conn.pid

    path = forkservers.start(sys.executable, env, preload)
    assert path is not None and wait_for(path.exists, 120)
    pid = up(env)
    assert pid and alive(pid)
    # a test's name in the environment is not part of the key
    assert up({**env, "PYTEST_CURRENT_TEST": "another test"}) == pid
    # a server that does not answer is not waited for
    os.kill(pid, signal.SIGSTOP)
    try:
        assert forkservers.ForkServer.connect(sys.executable, env, preload, timeout=1.0) is None
    finally:
        os.kill(pid, signal.SIGCONT)
    assert up(env) == pid
    (lib / "toylib_fs.py").write_text("VALUE = 2  # edited\n")
    assert up(env) is None  # stale: it says so, and exits
    assert wait_for(lambda: not alive(pid), 10) and not path.exists()
    # another environment is another server; beyond the cap the least recently used one goes
    monkeypatch.setattr(forkservers, "MAX_SERVERS", 1)
    one, two = {**env, "SOME_SETTING": "1"}, {**env, "SOME_SETTING": "2"}
    assert wait_for(forkservers.start(sys.executable, one, preload).exists, 120)
    first = up(one)
    assert first and wait_for(forkservers.start(sys.executable, two, preload).exists, 120)
    assert wait_for(lambda: not alive(first), 10)
    second = up(two)
    assert second and forkservers.stop_all() == 1 and wait_for(lambda: not alive(second), 10)


def test_a_server_that_cannot_serve_says_why_once_and_clean_lets_it_try_again(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "toylib_cuda.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True  # as if it had\n")
    env = {**os.environ, "PYTHONPATH": f"{lib}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    preload = ["toylib_cuda"]
    path = forkservers.start(sys.executable, env, preload)
    assert path is not None
    assert wait_for(lambda: forkservers.failure(sys.executable, env, preload) is not None, 120)
    assert "initialised CUDA" in forkservers.failure(sys.executable, env, preload)
    assert not path.exists() and forkservers.ForkServer.connect(sys.executable, env, preload) is None
    assert forkservers.start(sys.executable, env, preload) is None  # no second try for this key
    forkservers.stop_all()
    assert forkservers.failure(sys.executable, env, preload) is None


def test_a_worker_forked_with_a_module_of_its_tree_refuses_and_the_run_spawns(toy):
    # a module of the tree on PYTHONPATH, in the remembered preload list: the server imports it
    (toy / "helper_mod.py").write_text("VALUE = 1\n")
    env = {"PYTHONPATH": f"{toy}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "FS_TEST_ENV": str(toy)}
    listing = forkservers.preload_file(sys.executable, "toy_attn", "full")
    learned = listing.read_text() if listing.exists() else None
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text('["torch", "helper_mod"]')
    try:
        # the run starts a server of that list, whose forked workers refuse: it spawns them instead
        first = flaloop(toy, "bench", "toy_attn", "--json", *QUICK, "--rounds", "1", env=env)
        assert first.code == 0, first.stderr[-3000:]
        fs = first.json["env"]["forkserver"]
        assert fs["used"] is False and "modules of the tree were loaded before the worker started" in fs["why"], fs
        assert all(c["status"] == "ok" for c in first.json["cells"])
        # and stops the server it started: one whose workers refuse this tree is not left warm
        assert fs["started"] is True and wait_for(lambda: not Path(fs["socket"]).exists(), 10), fs
    finally:  # the learned list is shared by every test of this op
        if learned is None:
            listing.unlink(missing_ok=True)
        else:
            listing.write_text(learned)


def test_a_run_waits_for_a_starting_server_only_while_it_can_still_come(tmp_path, monkeypatch):
    """The `.starting` marker makes a run wait for a server that is preloading, but a marker whose
    process is gone, or one left so long ago that no preload takes that long, costs no wait."""
    import time

    env = {"ONLY_THIS_TEST": str(tmp_path)}  # a key no other test has, in the session's socket dir
    k = forkservers.key(sys.executable, env, ["torch"])
    marker = forkservers.socket_path(k, "starting")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    marker.write_text(f"{dead.pid}\n")
    t0 = time.monotonic()
    assert forkservers.ForkServer.connect(sys.executable, env, ["torch"]) is None
    assert time.monotonic() - t0 < 5 and not marker.exists()  # its process is gone: removed, no wait
    marker.write_text(f"{os.getpid()}\n")  # alive, but the marker is too old for a preload
    old = time.time() - 4 * forkservers.STARTING_WAIT_S - 10
    os.utime(marker, (old, old))
    t0 = time.monotonic()
    assert forkservers.ForkServer.connect(sys.executable, env, ["torch"]) is None
    assert time.monotonic() - t0 < 5 and not marker.exists()
    monkeypatch.setattr(forkservers, "STARTING_WAIT_S", 1.0)
    marker.write_text(f"{os.getpid()}\n")  # alive and fresh: waited for, up to the limit
    assert forkservers.starting(sys.executable, env, ["torch"]) == forkservers.socket_path(k)
    t0 = time.monotonic()
    assert forkservers.ForkServer.connect(sys.executable, env, ["torch"]) is None
    assert 0.9 <= time.monotonic() - t0 < 5
    # a run that is ending only asks whether one is warm or coming: it never waits, starts no second
    t0 = time.monotonic()
    assert forkservers.ForkServer.connect(sys.executable, env, ["torch"], wait=False) is None
    assert time.monotonic() - t0 < 0.5
    marker.write_text(f"{dead.pid}\n")
    assert forkservers.starting(sys.executable, env, ["torch"]) is None


def test_a_server_started_for_a_run_that_does_not_come_up_in_time_costs_a_spawn_and_is_stopped(tmp_path,
                                                                                                 monkeypatch):
    """A run with no server warm starts one and waits for it at most STARTING_WAIT_S; past that its
    workers are spawned, and a run that leaves nothing warm (interrupted) stops the one still preloading."""
    import time

    from flaloop.bench.launcher import ForkLauncher

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "slow_to_import.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "preload.json").write_text('["slow_to_import"]')
    env = {**os.environ, "PYTHONPATH": str(lib), "ONLY_THIS_TEST": str(tmp_path)}
    monkeypatch.setattr(forkservers, "STARTING_WAIT_S", 2.0)
    t0 = time.monotonic()
    launcher = ForkLauncher(python=sys.executable, op="toy_attn", registry=tmp_path / "registry.py", device="cpu",
                            env=env, preload_file=tmp_path / "preload.json", owner=str(tmp_path))
    try:
        assert 1.9 <= time.monotonic() - t0 < 10
        fs = launcher.describe()
        assert fs["used"] is False and "none came up within 2 s of being started: spawned" in fs["why"], fs
        k = forkservers.key(sys.executable, env, ["slow_to_import"])
        preloading = int(forkservers.socket_path(k, "starting").read_text())
        assert alive(preloading)
    finally:
        launcher.close(leave_warm=False)
    assert wait_for(lambda: not alive(preloading), 10), "the server still preloading outlived the run that started it"
    assert not forkservers.socket_path(k).exists() and not forkservers.socket_path(k, "starting").exists()


def test_two_runs_that_find_none_warm_at_once_start_one_server(tmp_path):
    """Sweep lanes share a key (the device is not part of it): the second start finds the first's
    `.starting` marker live and leaves the starting to it; stopping it kills the one preloading."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "slow_to_import.py").write_text("import time\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(lib), "ONLY_THIS_TEST": str(tmp_path)}
    k = forkservers.key(sys.executable, env, ["slow_to_import"])

    def servers() -> list[int]:
        found = []
        for p in Path("/proc").glob("[0-9]*"):
            try:
                if f"--key\0{k}\0".encode() in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                continue
        return found

    first = forkservers.start(sys.executable, env, ["slow_to_import"])
    marker = forkservers.socket_path(k, "starting")
    pid = int(marker.read_text())
    try:
        assert first is not None and forkservers.start(sys.executable, env, ["slow_to_import"]) is None
        assert int(marker.read_text()) == pid and wait_for(lambda: servers() == [pid], 5), servers()
    finally:
        assert forkservers.stop(first)
    assert wait_for(lambda: not alive(pid), 10) and not marker.exists()


def test_one_server_per_checkout_whatever_shell_started_it_and_clean_stops_only_its_own(tmp_path):
    """The terminal's and the MCP server's environments differ in how output is drawn, not in what is
    imported: one key. A checkout's new server replaces its old one; `clean` (stop_all with an
    owner) stops that checkout's servers, never another's."""
    env, preload = dict(os.environ), ["json"]
    agent = {**env, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "NO_COLOR": "1", "TERM": "dumb"}
    assert forkservers.key(sys.executable, env, preload) == forkservers.key(sys.executable, agent, preload)
    assert forkservers.idle_seconds() <= 300  # conftest's, and the default: a loop's pace, not 20 minutes

    def started(e, owner):
        path = forkservers.start(sys.executable, e, preload, owner=owner)
        assert path is not None and wait_for(path.exists, 120)
        conn = forkservers.ForkServer.connect(sys.executable, e, preload)
        conn.close()
        return conn.pid

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = started({**env, "SOME_SETTING": "1"}, a)
    second = started({**env, "SOME_SETTING": "2"}, a)  # the same checkout: the older one goes
    assert wait_for(lambda: not alive(first), 10) and alive(second)
    other = started({**env, "SOME_SETTING": "1"}, b)  # another checkout's stays
    assert alive(second) and alive(other)
    assert forkservers.stop_all(owner=a) == 1 and wait_for(lambda: not alive(second), 10)
    assert alive(other)
    assert forkservers.stop_all(owner=b) == 1 and wait_for(lambda: not alive(other), 10)


def test_the_op_query_forks_from_a_warm_server_and_answers_as_a_fresh_one(toy, monkeypatch):
    """`init`'s op query (the signature, the files the test's imports resolve to: the frozen set)
    is forked from a warm server of the op's key where one is, and answers as a fresh one does."""
    from flaloop.task.contract import compute_frozen
    from flaloop.task.target import Target

    monkeypatch.setenv(forkservers.DIR_ENV, tempfile.mkdtemp(prefix="query-fs-"))  # no other test's server
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    target = Target.discover(toy)
    spec = target.op("toy_attn")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=toy, capture_output=True, text=True).stdout.strip()
    fresh_frozen, fresh = compute_frozen(target, spec, base)  # none warm: fresh, and none started
    assert "_forked_by" not in fresh and not list(Path(os.environ[forkservers.DIR_ENV]).glob("*.sock"))
    env, preload = dict(os.environ), forkservers.op_preload(target.python, "toy_attn")
    forkservers.start(target.python, env, preload)
    server = wait_for(lambda: forkservers.ForkServer.connect(target.python, env, preload), 120, step=0.5)
    assert server is not None, "the fork server never came up"
    try:
        frozen, forked = compute_frozen(target, spec, base)
        assert forked.pop("_forked_by") == server.pid
        assert forked == fresh and frozen == fresh_frozen
        # a forked query past its timeout is killed, and said so
        from flaloop.core.errors import UsageError
        from flaloop.task.target import run_query
        before = set(children(server.pid))
        with pytest.raises(UsageError, match="took longer than"):
            run_query(target.python, toy, ["registry", "--registry", str(target.registry_file)], timeout=0.01,
                      preload=preload, package=spec.package)
        assert wait_for(lambda: not (set(children(server.pid)) - before), 10), "the timed-out query lives on"
        # a forked query that died before it answered is asked again, fresh
        from flaloop.task import target as target_mod
        monkeypatch.setattr(target_mod, "_forked_query", lambda *a: (-9, server.pid))
        assert compute_frozen(target, spec, base) == (fresh_frozen, fresh)
    finally:
        server.close()
        forkservers.stop_all()
