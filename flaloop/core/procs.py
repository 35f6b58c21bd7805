"""Child processes that never outlive flaloop, and interrupts that cannot cut a cleanup short.

Three layers keep a worker or pytest from running on after flaloop is gone:
  1. normal cleanup kills the child's whole process group, SIGTERM then SIGKILL, each wait
     bounded (`kill_group`, `kill_popen`);
  2. `spawn` asks the kernel to SIGKILL the child when its parent dies (Linux
     `prctl(PR_SET_PDEATHSIG)` in a preexec function), which covers a SIGKILL of flaloop;
  3. the child watches its parent itself (`inside/scripts/flaloop_lifeline.py`, armed by the bench
     worker and the gate's pytest plugin, and so also in every pytest-xdist worker, which is a
     grandchild and gets no PDEATHSIG from us).

PDEATHSIG fires when the *thread* that forked the child ends, not the process: a child spawned
from a short-lived thread would be killed with that thread. So `spawn` sets it only on the main
thread; elsewhere the lifeline alone guards the child.

Interrupts: `install_signal_handlers` makes the first SIGINT or SIGTERM raise KeyboardInterrupt
(commands unwind and clean up); every later one prints "cleaning up, please wait" once and is
otherwise ignored, so a second Ctrl-C cannot abort the cleanup the first one started. Code that
must not be cut in two (creating a worktree and locking it) runs under `deferred_interrupts()`:
a first signal inside is held and raised when the block ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

PR_SET_PDEATHSIG = 1
LIFELINE_ENV = "FLALOOP_LIFELINE"  # children arm their watchdog when this is set


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved in the parent: the forked child only calls it


def spawn(cmd: list[str], *, env: dict[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
    """Popen in a new session (so a terminal's Ctrl-C reaches only flaloop, which then cleans up),
    killed by the kernel when flaloop dies, with the lifeline armed in children that support it."""
    run_env = dict(os.environ if env is None else env)
    run_env[LIFELINE_ENV] = "1"
    preexec = None
    if _PRCTL is not None and threading.current_thread() is threading.main_thread():
        preexec = _pdeathsig(os.getpid())
    return subprocess.Popen(cmd, env=run_env, start_new_session=True, preexec_fn=preexec, **popen_kwargs)


def run(cmd: list[str], *, timeout: float | None = None, input: str | bytes | None = None,
        capture_output: bool = False, **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` through `spawn`: the child dies with flaloop, and on a timeout or an
    interrupt its whole process group is killed (raises subprocess.TimeoutExpired like run)."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    with spawn(cmd, **popen_kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:
            kill_popen(proc)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _pdeathsig(parent: int) -> Callable[[], None]:
    prctl = _PRCTL

    def preexec() -> None:  # runs in the child between fork and exec: keep it tiny
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def exists(pid: int) -> bool:
    """Whether a process `pid` exists (anyone's, a zombie too), by signal 0: no /proc needed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    return True


def follow(proc: subprocess.Popen, stream, on_line: Callable[[str], None], timeout: float) -> bool:
    """Hand each line of `stream` (one of `proc`'s pipes) to `on_line` until it ends, then wait for
    `proc`; kill its group after `timeout` seconds, or on any exception (re-raised). Returns
    whether the timeout killed it."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        kill_popen(proc)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        for line in stream:
            on_line(line)
        proc.wait()
    except BaseException:
        kill_popen(proc)
        raise
    finally:
        timer.cancel()
    return expired.is_set()


def running(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone): for processes that are not our children."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_group(pid: int, alive: Callable[[], bool], wait: Callable[[float], bool],
               signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGKILL), wait_s: float = 5.0) -> None:
    """End the process group led by `pid`: each signal in turn, waiting at most `wait_s` after each.

    `alive()` says whether the leader still runs, `wait(t)` waits up to t seconds for it to end.
    The group is signalled even after its leader exited: pytest-xdist workers, or a worker's
    helpers, may still be in it.
    """
    for sig in signals:
        if not alive() and not _group_alive(pid):
            return
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return  # no process of the group is left
        if wait(wait_s) and not _group_alive(pid):
            return


def kill_popen(proc: subprocess.Popen, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGKILL),
               wait_s: float = 5.0) -> None:
    """`kill_group` for a child started by `spawn`; it is reaped too."""

    def wait(t: float) -> bool:
        try:
            proc.wait(timeout=t)
            return True
        except subprocess.TimeoutExpired:
            return False

    kill_group(proc.pid, lambda: proc.poll() is None, wait, signals, wait_s)
    wait(wait_s)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# -- bounded logs -------------------------------------------------------------------------------

class CappedLog:
    """A child's output stream kept in `path`, bounded: the first `head` bytes, then only the last
    `tail` bytes (appended when the log is closed, after a line saying how much was dropped).

    Pass `fd` as the child's stdout/stderr, call `started()` once the child runs (the parent's copy
    of the write end must close, or the log never sees EOF), and `close()` when done (again is a
    no-op). The read end belongs to the pump thread, which closes it at EOF: closed from another
    thread, its number could be reused by a file opened meanwhile, and the pump, or a second close,
    would then read or close that file.
    """

    def __init__(self, path: Path, head: int = 8 << 20, tail: int = 1 << 20, header: str = ""):
        self.path, self.head_cap, self.tail_cap = path, head, tail
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        if header:
            self._file.write(header.encode())
            self._file.flush()
        self._written = len(header.encode())
        self._dropped = 0
        self._ring = bytearray()
        self._lock = threading.Lock()
        self._closed = False
        self._read, self.fd = os.pipe()
        self._thread = threading.Thread(target=self._pump, daemon=True, name=f"log-{path.name}")
        self._thread.start()

    def fileno(self) -> int:
        """The write end, for the child (Popen's stdout/stderr accept this object)."""
        return self.fd

    def started(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _pump(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self._read, 65536)
                except OSError:
                    break
                if not chunk or not self._keep(chunk):
                    break
        finally:
            with contextlib.suppress(OSError):
                os.close(self._read)

    def _keep(self, chunk: bytes) -> bool:
        """Keep what the child wrote; False once the log is closed (what a grandchild writes after
        that is not kept)."""
        with self._lock:
            if self._file.closed:
                return False
            room = max(0, self.head_cap - self._written)
            if room:
                self._file.write(chunk[:room])
                self._file.flush()
                self._written += min(room, len(chunk))
            self._dropped += max(0, len(chunk) - room)
            self._ring += chunk
            del self._ring[:-self.tail_cap]
            return True

    def drain(self, timeout: float = 2.0) -> None:
        """Wait (briefly) until everything the child wrote has been read: call after it exited."""
        self._thread.join(timeout)

    def tail(self, n: int = 4000) -> str:
        with self._lock:
            return bytes(self._ring[-n:]).decode(errors="replace")

    def close(self, timeout: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.started()
        # a grandchild may still hold the pipe: don't wait for it (the pump then ends, and closes
        # the read end, when that grandchild exits)
        self._thread.join(timeout)
        with self._lock:
            if self._dropped and not self._file.closed:
                kept = bytes(self._ring[-min(self._dropped, self.tail_cap):])
                self._file.write(f"\n[flaloop: {self._dropped - len(kept)} bytes of output dropped here "
                                 f"(log cap {self.head_cap} bytes); the last {len(kept)} follow]\n".encode())
                self._file.write(kept)
            self._file.close()


# -- interrupts ---------------------------------------------------------------------------------

class _Interrupts:
    """State of the one signal handler (per process: signals are per process)."""

    def __init__(self) -> None:
        self.count = 0
        self.depth = 0  # nesting of deferred_interrupts()
        self.pending = False
        self.installed = False

    def handler(self, signum, frame) -> None:
        self.count += 1
        if self.count == 1:
            if self.depth:
                self.pending = True
                return
            raise KeyboardInterrupt
        if self.count == 2:
            with contextlib.suppress(OSError):
                os.write(2, b"\ncleaning up, please wait\n")


_STATE = _Interrupts()


def install_signal_handlers() -> None:
    """First SIGINT/SIGTERM: KeyboardInterrupt. Later ones: a notice, never a second exception.

    SIGINT is installed explicitly: a parent that ignores it (a background job of a script, an
    xdist worker) would otherwise leave us deaf to the interrupt it forwards.
    """
    signal.signal(signal.SIGINT, _STATE.handler)
    signal.signal(signal.SIGTERM, _STATE.handler)
    _STATE.installed = True


def interrupted() -> bool:
    """Whether a SIGINT/SIGTERM has arrived (the command is unwinding)."""
    return _STATE.count > 0


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold a first interrupt until the block ends, then raise it: for steps that must not be
    cut in two. Later interrupts are ignored anyway (see install_signal_handlers). Signals reach
    the main thread only: in any other thread (a sweep's measurements) this holds nothing, and the
    main thread withdraws that thread's work when it is interrupted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.depth -= 1
        if _STATE.depth == 0 and _STATE.pending:
            _STATE.pending = False
            raise KeyboardInterrupt
