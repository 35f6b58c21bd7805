"""Worker processes seen from the orchestrator: how they come to exist and how we talk to them.

A `WorkerClient` speaks JSON lines over pipes (flaloop/bench/worker/protocol.py). It runs either as a
plain subprocess of the target's interpreter, or as a child forked by a warm fork server that
imported torch and the target's third-party libraries once (bench/forkservers.py): with FLA
that turns a 16-19 s import per process into the import of FLA's own modules. The fork server
is an optimisation only: when none is warm, or a forked child cannot use the GPU, the session
spawns plain subprocesses and says so in the run record.

Every worker is the leader of its own process group, dies with its parent (parent-death signal
for spawned ones, a watchdog thread in the worker for all), and is killed group-wide on close
(flaloop/procs.py). Its stderr is a bounded log (procs.CappedLog).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from flaloop import procs
from flaloop.errors import MeasurementError
from flaloop.procs import kill_group

if TYPE_CHECKING:
    from flaloop.bench.forkservers import ForkServer

WORKER = Path(__file__).parent / "worker" / "__main__.py"


class WorkerFailed(MeasurementError):
    """The worker process died or stopped answering; `stderr` has its last words."""

    def __init__(self, side: str, what: str, stderr: str):
        super().__init__(f"the {side} worker {what}", f"its stderr ends with:\n{stderr[-3000:]}")
        self.side, self.stderr = side, stderr


class SpawnedProc:
    """A worker started with Popen (its own session, killed if we die)."""

    def __init__(self, argv: list[str], cwd: Path, env: dict | None, log) -> None:
        self.p = procs.spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                             bufsize=1, cwd=cwd, env=env)
        self.pid, self.stdin, self.stdout = self.p.pid, self.p.stdin, self.p.stdout

    def poll(self) -> int | None:
        return self.p.poll()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        kill_group(self.pid, lambda: self.p.poll() is None, lambda t: self.wait(t) is not None)


class ForkedProc:
    """A worker forked by the fork server (not our child: watched through /proc)."""

    # A process whose main thread has exited shows as a zombie while its other threads (torch's
    # pool) are still being torn down, and its parent cannot reap it until they are gone: the
    # server then has no status yet. Asked again for this long before the status counts as lost.
    REAP_GRACE_S = 2.0

    def __init__(self, server: ForkServer, pid: int, stdin, stdout) -> None:
        self.server, self.pid, self.stdin, self.stdout = server, pid, stdin, stdout
        self._code: int | None = None
        self._gone_at: float | None = None

    def poll(self) -> int | None:
        if self._code is None and not procs.running(self.pid):
            self._code = self.server.returncode(self.pid)
            if self._code is None:
                now = time.monotonic()
                self._gone_at = self._gone_at or now
                if now - self._gone_at >= self.REAP_GRACE_S:
                    self._code = -1  # gone, and the server never reported its status
        return self._code

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll() is not None:
                return self._code
            time.sleep(0.05)
        return None

    def kill(self) -> None:
        kill_group(self.pid, lambda: self.poll() is None, lambda t: self.wait(t) is not None)
        for f in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                f.close()


class WorkerClient:
    """One long-lived worker process speaking JSON lines over pipes."""

    def __init__(self, side: str, python: str, tree: Path, registry: Path, op: str, device: str,
                 log_path: Path, env: dict[str, str] | None = None, server: ForkServer | None = None,
                 env_extra: dict[str, str] | None = None, import_mode: str = "full"):
        self.side, self.tree, self.log_path = side, tree, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = procs.CappedLog(log_path)  # a chatty op cannot fill the disk
        args = ["--tree", str(tree), "--registry", str(registry), "--op", op, "--side", side,
                "--workdir", str(log_path.parent)]
        if device != "auto":
            args += ["--device", device]
        if import_mode != "full":
            args += ["--import-mode", import_mode]
        self.forked = server is not None
        try:
            if server is not None:
                self.proc = server.spawn(args, tree, {**(env or os.environ), **(env_extra or {})}, self._log)
            else:
                self.proc = SpawnedProc([python, "-u", str(WORKER), *args], tree,
                                        {**(env or {}), **(env_extra or {})} if env is not None else None, self._log)
        except BaseException:
            self._log.close()
            raise
        self._log.started()  # the child holds the log's write end now
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.dead = False
        self.hello: dict = {}

    def _pump(self) -> None:
        try:
            for line in self.proc.stdout:
                self._replies.put(line)
        except (OSError, ValueError):
            pass
        self._replies.put(None)

    def stderr_tail(self) -> str:
        if self.proc.poll() is not None:
            self._log.drain()  # its last words may still be in the pipe
        return self._log.tail(4000)

    def request(self, cmd: str, timeout: float, **payload) -> dict:
        self.send(cmd, **payload)
        return self.receive(cmd, timeout)

    def send(self, cmd: str, **payload) -> None:
        """Ask without waiting: the answer is `receive`d later (both sides of a pair work at once)."""
        if self.dead:
            raise WorkerFailed(self.side, "is gone", self.stderr_tail())
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **payload}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._die()
            raise WorkerFailed(self.side, f"died before `{cmd}`", self.stderr_tail()) from None

    def receive(self, cmd: str, timeout: float) -> dict:
        """The answer to the request `send` made last."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._die()
                raise WorkerFailed(self.side, f"hung: no answer to `{cmd}` within {timeout:.0f}s",
                                   self.stderr_tail()) from None
            if line is None:
                self._die()
                code = self.proc.wait(10.0)
                raise WorkerFailed(self.side, f"crashed during `{cmd}` (exit {_describe(code)})", self.stderr_tail())
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue  # not ours: the protocol fd is private, but be forgiving

    def _die(self) -> None:
        self.dead = True
        self.proc.kill()

    def close(self) -> None:
        if not self.dead and self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(3.0)  # an idle worker quits at once; a busy one is killed
            except (OSError, ValueError):
                pass
        self.proc.kill()
        self._log.close()


def _describe(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return f"{code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            return str(code)
    return str(code)
