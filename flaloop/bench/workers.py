"""A worker process seen from the orchestrator: a conversation in JSON lines over its pipes.

The process itself comes from a launcher (bench/launcher.py: spawned, or forked by a warm fork
server); a `WorkerClient` only talks to it (flaloop/inside/worker/protocol.py) and ends it. Every
worker is the leader of its own process group, dies with its parent (parent-death signal for
spawned ones, a watchdog thread in the worker for all), and is killed group-wide on close
(flaloop/core/procs.py). Its stderr is a bounded log (procs.CappedLog).
"""

from __future__ import annotations

import json
import queue
import signal
import threading
import time
from pathlib import Path

from flaloop.core.errors import MeasurementError


class WorkerFailed(MeasurementError):
    """The worker process died or stopped answering; `stderr` has its last words."""

    def __init__(self, side: str, what: str, stderr: str):
        super().__init__(f"the {side} worker {what}", f"its stderr ends with:\n{stderr[-3000:]}")
        self.side, self.stderr = side, stderr
        self.replies: dict = {}  # Session.ask_both: what the other side answered to the same command


class WorkerClient:
    """One long-lived worker process speaking JSON lines over pipes.

    `proc` has `pid`, `stdin`, `stdout`, `poll()`, `wait(timeout)` and `kill()`
    (launcher.SpawnedProc or forkservers.ForkedProc); `log` is its stderr (procs.CappedLog)."""

    def __init__(self, side: str, tree: Path, proc, log, forked: bool = False):
        self.side, self.tree, self.proc, self._log = side, tree, proc, log
        self.log_path = Path(log.path) if hasattr(log, "path") else None
        self.forked = forked
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.dead = False
        self.hello: dict = {}
        # the round trip of the last request answered, on this process's monotonic clock: from the
        # request written to its reply read off the pipe (guard/timing.timer_host_gap holds a sample's
        # reported time against it; the worker cannot reach this clock)
        self._sent_at: float | None = None
        self.round_trip_s: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        try:
            for line in self.proc.stdout:
                # stamped as it is read, so the main thread's own delays stay out of the round trip
                self._replies.put((time.monotonic(), line))
        except (OSError, ValueError):
            pass
        self._replies.put((time.monotonic(), None))

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
            line = json.dumps({"cmd": cmd, **payload}) + "\n"
            self._sent_at, self.round_trip_s = time.monotonic(), None
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._die()
            raise WorkerFailed(self.side, f"died before `{cmd}`", self.stderr_tail()) from None

    def receive(self, cmd: str, timeout: float) -> dict:
        """The answer to the request `send` made last."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                at, line = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._die()
                raise WorkerFailed(self.side, f"hung: no answer to `{cmd}` within {timeout:.0f}s",
                                   self.stderr_tail()) from None
            if line is None:
                self._die()
                code = self.proc.wait(10.0)
                raise WorkerFailed(self.side, f"crashed during `{cmd}` (exit {_describe(code)})", self.stderr_tail())
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue  # not ours: the protocol fd is private, but be forgiving
            if self._sent_at is not None:
                self.round_trip_s = at - self._sent_at
            return reply

    def _die(self) -> None:
        self.dead = True
        self.proc.kill()

    def kill(self) -> None:
        """End it now (a withdrawn run); the next request fails as `WorkerFailed`."""
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
