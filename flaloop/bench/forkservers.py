"""Warm fork servers, seen from the orchestrator: found by key, started detached, stopped by `clean`.

A fork server (flaloop/inside/worker/forkserver.py) imports torch and the target's third-party
libraries once and forks fresh worker processes from then on. It outlives the run that started
it, so the next bench of the loop forks its workers instead of paying the whole import in each
(FLA on the H200: its real import took 1.9 s in a forked worker, 10-17 s in a spawned one). It is found by a Unix socket whose name is a key over everything its imports
depend on: the interpreter, the environment and the list of modules to preload. flaloop's worker
code is among the files the server imported, and the server checks those files at every
connection, so an edit of flaloop, torch or any preloaded library retires it.

With none warm for its key a run starts one, detached (`start`), and waits for it, at most
STARTING_WAIT_S: one import in the server (on the H200 about 10 s) instead of one in every
spawned worker (10-17 s each, a warm-up pair and a pair per round). So does a run that finds one
of its key still preloading. As a run ends it starts one with the modules its workers imported,
when they are more than its server preloaded.
The server exits after FLALOOP_FORKSERVER_IDLE_S seconds without a connection (default 300: a loop's
benches follow each other within minutes, and each server holds ~275 MB). A server belongs to the
checkout whose run started it (its `.owner` file): starting one stops that checkout's other servers
of the same interpreter, so one stays warm per checkout, whichever shell or agent ran the bench,
and `flaloop clean` stops only that checkout's (`stop_all(owner)`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from flaloop import inside
from flaloop.core import fsutil, procs

WORKER = inside.WORKER / "__main__.py"
IDLE_ENV = "FLALOOP_FORKSERVER_IDLE_S"
DIR_ENV = "FLALOOP_FORKSERVER_DIR"  # where the sockets live (default: a private dir in the temp dir)
IDLE_DEFAULT_S = 300.0
# Set per shell, per test, per workspace or per flaloop run, and read by no library at import
# (Triton reads its cache settings when it compiles or tunes, in the forked worker, which has the
# run's exact environment): not part of the key. Every other variable is: an unknown one costs a
# server start, never an import made under other settings.
VOLATILE_ENV = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES", "PYTEST_CURRENT_TEST",
                          "FLALOOP_LIFELINE", "FLALOOP_LIFELINE_PID", "TRITON_CACHE_DIR",
                          # who git says made a commit: read by git, never by a library's import
                          "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL",
                          "FLALOOP_TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING",
                          # the terminal's or the agent's session, and how output is drawn (the MCP
                          # server sets the last four for its children)
                          "TERM", "TERM_PROGRAM", "TERM_PROGRAM_VERSION", "TERM_SESSION_ID", "COLORTERM", "TMUX",
                          "TMUX_PANE", "STY", "WINDOWID", "DISPLAY", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY",
                          "SSH_AUTH_SOCK", "HISTFILE", "HISTSIZE", "PS1", "LS_COLORS", "XDG_SESSION_ID",
                          "VSCODE_PID", "VSCODE_IPC_HOOK_CLI", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE",
                          "TTY_INTERACTIVE"})
REQUEST_TIMEOUT_S = 30.0
STARTING_WAIT_S = 30.0  # the longest a run waits for a server of its key that is still preloading
MAX_SERVERS = 4  # per user: each holds torch and friends in memory; the least recently used goes


def socket_dir() -> Path:
    """The user's private directory for fork server sockets (short: a socket path has ~100 bytes)."""
    if os.environ.get(DIR_ENV):
        d = Path(os.environ[DIR_ENV])
    else:
        base = tempfile.gettempdir()
        d = Path(base if len(base) <= 60 else "/tmp") / f"flaloop-fs-{os.getuid()}"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(d, 0o700)
        st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{d} is not a private directory of this user: no fork server")
    if len(str(d)) > 64:  # a socket's path has 108 bytes: the name and a temporary suffix take ~45
        raise RuntimeError(f"{d} is too long a path for a socket: no fork server")
    return d


def key(python: str, env: dict, preload: list[str]) -> str:
    try:
        st = os.stat(python)
        interp = [os.path.realpath(python), st.st_mtime_ns, st.st_size]
    except OSError:
        interp = [python]
    items = sorted((k, v) for k, v in env.items() if k not in VOLATILE_ENV)
    return hashlib.sha256(json.dumps([interp, items, list(preload)]).encode()).hexdigest()[:24]  # order matters


def preload_file(python: str, op: str, import_mode: str) -> Path:
    """Where the modules that an op's workers imported are remembered, in the user cache: shared by
    every checkout of the op (a fresh clone's first run forks too)."""
    k = hashlib.sha256(json.dumps([os.path.realpath(python), op, import_mode]).encode()).hexdigest()[:20]
    return fsutil.user_cache_dir() / "preload" / f"{k}.json"


def remembered(path: Path) -> list[str]:
    """The modules an op's workers imported, in import order (inside/worker/op_import.py), as kept
    in its preload file; torch and triton where none is kept yet. The bench's workers and the
    gate's test process look for a server of this list, so that one warm server serves both."""
    try:
        names = json.loads(path.read_text())
        return [n for n in names if isinstance(n, str)]
    except (OSError, ValueError, TypeError):
        return ["torch", "triton"]


def op_preload(python: str, op: str) -> list[str]:
    """The module list of the server a bench of `op` leaves warm (its `--import full` workers'):
    what the gate's test process and the op query look for, so that one warm server serves all."""
    return remembered(preload_file(python, op, "full"))


def socket_path(k: str, ext: str = "sock") -> Path:
    """The server's socket, or a file beside it: its log, preload listing, or why it failed."""
    return socket_dir() / f"fs-{k}.{ext}"


def failure(python: str, env: dict, preload: list[str]) -> str | None:
    """Why a server cannot run for this key (its own words, from an earlier start), if it cannot."""
    try:
        return socket_path(key(python, env, preload), "failed").read_text().strip() or "unknown"
    except (OSError, RuntimeError):
        return None


def idle_seconds() -> float:
    try:
        return max(1.0, float(os.environ.get(IDLE_ENV, IDLE_DEFAULT_S)))
    except ValueError:
        return IDLE_DEFAULT_S


class ForkServer:
    """A connection to a warm fork server (closing it leaves the server running)."""

    def __init__(self, sock: socket.socket, ready: dict, path: Path):
        self.sock, self.ready, self.path = sock, ready, path
        self.pid = ready.get("pid")
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, python: str, env: dict, preload: list[str], timeout: float = 10.0,
                wait: bool = True) -> ForkServer | None:
        """The warm server for this key, or None (none runs, or it was stale and has retired).
        With `wait`, one of this key that is still preloading is waited for (STARTING_WAIT_S)."""
        k = key(python, env, preload)
        try:
            path = socket_path(k)
        except (OSError, RuntimeError):
            return None
        if not path.exists() and not (wait and _wait_for_start(k, STARTING_WAIT_S)):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            ready = json.loads(sock.recv(1 << 20).decode() or "{}")
        except (OSError, ValueError):
            sock.close()
            with contextlib.suppress(OSError):  # a socket nobody serves any more
                if not _serving(path):
                    path.unlink()
            return None
        sock.settimeout(REQUEST_TIMEOUT_S)  # a server that stops answering costs a spawn, never a hang
        if not ready.get("ok") or ready.get("key") != k:
            sock.close()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # last used: the server kept longest when there are too many
        return cls(sock, ready, path)

    def _ask(self, req: dict, fds: list[int] | None = None) -> dict:
        with self._lock:
            try:
                data = json.dumps(req).encode()
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.send(data)
                reply = self.sock.recv(1 << 20)
                if not reply:
                    raise RuntimeError("the fork server is gone")
                return json.loads(reply.decode())
            except (OSError, ValueError, RuntimeError):
                self.close()  # a late reply must never answer the next request
                raise

    def spawn(self, argv: list[str], cwd: Path, env: dict, log) -> tuple[int, object, object]:
        """Fork a worker with exactly `env` as its environment, watching this flaloop process: its
        pid and the two ends of its pipes (ForkedProc watches it)."""
        env = {**env, "FLALOOP_LIFELINE": "1", "FLALOOP_LIFELINE_PID": str(os.getpid())}
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            reply = self._ask({"cmd": "spawn", "argv": argv, "cwd": str(cwd), "env": env},
                              [in_r, out_w, log.fileno()])
        except (OSError, ValueError, RuntimeError) as exc:
            os.close(in_w)
            os.close(out_r)
            raise RuntimeError(f"the fork server could not fork: {exc}") from exc
        finally:
            os.close(in_r)
            os.close(out_w)
        if not reply.get("ok"):
            os.close(in_w)
            os.close(out_r)
            raise RuntimeError(f"the fork server could not fork: {reply.get('error')}")
        return reply["pid"], os.fdopen(in_w, "w", buffering=1), os.fdopen(out_r, "r")

    def returncode(self, pid: int) -> int | None:
        try:
            return self._ask({"cmd": "status", "pid": pid}).get("returncode")
        except (OSError, RuntimeError, ValueError):
            return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


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
        procs.kill_group(self.pid, lambda: self.poll() is None, lambda t: self.wait(t) is not None)
        for f in (self.stdin, self.stdout):
            if f is not None:  # the gate's pytest and the op query are forked without pipes
                with contextlib.suppress(OSError):
                    f.close()


def starting(python: str, env: dict, preload: list[str]) -> Path | None:
    """The socket a server of this key will listen on, while one is preloading."""
    try:
        k = key(python, env, preload)
    except (OSError, RuntimeError):
        return None
    return socket_path(k) if _starting_pid(k) is not None else None


def _starting_pid(k: str) -> int | None:
    """The pid of the server of key `k` that is preloading: its `.starting` marker is there, fresh
    (no preload takes 4 x STARTING_WAIT_S), and its process runs. A marker that fails any of these
    is removed."""
    marker = socket_path(k, "starting")
    try:
        pid = int(marker.read_text().strip())
        if time.time() - marker.stat().st_mtime <= 4 * STARTING_WAIT_S and procs.running(pid):
            return pid
    except (OSError, ValueError):
        return None
    with contextlib.suppress(OSError):
        marker.unlink()
    return None


def _wait_for_start(k: str, limit: float) -> bool:
    """True once the server of key `k` that a run started is listening; False at once when none is
    starting (or it died or failed), else after `limit` s."""
    pid = _starting_pid(k)
    if pid is None:
        return False
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if socket_path(k).exists():
            return True
        if not procs.running(pid) or socket_path(k, "failed").exists():
            with contextlib.suppress(OSError):
                socket_path(k, "starting").unlink()
            return False
        time.sleep(0.1)
    return socket_path(k).exists()


def _serving(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(2.0)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _owner_of(sock: Path) -> dict | None:
    try:
        doc = json.loads(sock.with_suffix(".owner").read_text())
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _owned(d: Path, owner: str, python: str | None = None) -> list[Path]:
    """The sockets of the servers `owner` (a checkout's root) started (with `python`, when given)."""
    out = []
    for sock in d.glob("fs-*.sock"):
        doc = _owner_of(sock) or {}
        if doc.get("root") == owner and (python is None or doc.get("python") == os.path.realpath(python)):
            out.append(sock)
    return out


def start(python: str, env: dict, preload: list[str], owner: str | None = None) -> Path | None:
    """Start a fork server for this key, detached (it outlives this flaloop); don't wait for it.
    Its own session, no parent-death signal: the one child of flaloop that is meant to stay. With
    `owner` (the checkout's root), the owner's other servers of this interpreter are stopped first.
    Its socket, or None when it could not start or another run is starting one of this key."""
    k = key(python, env, preload)
    try:
        sock = socket_path(k)
        if socket_path(k, "failed").exists():
            return None
        if not _claim(k):  # another run is starting this key's server: the caller may wait for it
            return None
    except (OSError, RuntimeError):
        return None
    try:
        if owner is not None:
            for other in _owned(sock.parent, owner, python):
                if other != sock:
                    stop(other)
            fsutil.atomic_write_text(socket_path(k, "owner"),
                                     json.dumps({"root": owner, "python": os.path.realpath(python)}))
        _make_room(sock.parent, MAX_SERVERS - 1)
        listing = socket_path(k, "preload")
        fsutil.atomic_write_text(listing, "\n".join(preload) + "\n")
        log = open(socket_path(k, "log"), "w")  # noqa: SIM115 - handed to the child
    except (OSError, RuntimeError):
        _unclaim(k)
        return None
    server_env = {n: v for n, v in env.items() if n not in ("FLALOOP_LIFELINE", "FLALOOP_LIFELINE_PID")}
    try:
        p = subprocess.Popen([python, "-u", str(WORKER), "--forkserver", str(sock), "--preload",
                              str(listing), "--key", k, "--idle", str(idle_seconds())],
                             env=server_env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=str(sock.parent),
                             start_new_session=True, close_fds=True)
    except OSError:
        _unclaim(k)
        return None
    finally:
        log.close()
    with contextlib.suppress(OSError):  # the next run waits for it rather than spawn (the server removes it)
        fsutil.atomic_write_text(socket_path(k, "starting"), f"{p.pid}\n")
    return sock


def _claim(k: str) -> bool:
    """Take key `k`'s `.starting` marker for this process (its pid, until the server's replaces
    it), unless a live one is there: two runs that find no server at once start one, not two
    (sweep lanes on several GPUs share a key: the device is not part of it)."""
    marker = socket_path(k, "starting")
    for _ in range(2):
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if _starting_pid(k) is not None:
                return False
            continue  # a stale marker, removed by _starting_pid: try once more
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        return True
    return False


def _is_server(pid: int, k: str) -> bool:
    """`pid` runs the fork server of key `k` (its command line says so): not a flaloop run whose pid
    the marker holds while it claims the key (`_claim`), which must never be killed as a server."""
    try:
        return f"--key\0{k}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _unclaim(k: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        marker = socket_path(k, "starting")
        if int(marker.read_text().strip()) == os.getpid():
            marker.unlink()


def _make_room(d: Path, keep: int) -> None:
    """Stop the least recently used servers beyond `keep`."""
    socks = []
    for p in d.glob("fs-*.sock"):
        with contextlib.suppress(OSError):
            socks.append((p.stat().st_mtime, p))
    for _, path in sorted(socks, reverse=True)[keep:]:
        stop(path)


def stop(path: Path) -> bool:
    """Ask the server of socket `path` to exit; one of its key still preloading is killed."""
    with contextlib.suppress(OSError, ValueError):
        k = path.name[len("fs-"):-len(".sock")]
        if not path.exists() and (pid := _starting_pid(k)) is not None and _is_server(pid, k):
            os.killpg(pid, signal.SIGKILL)  # its own session (`start`): it and anything it forked
            socket_path(k, "starting").unlink()
            return True
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5.0)
    try:
        s.connect(str(path))
        s.recv(1 << 20)  # the greeting
        s.send(json.dumps({"cmd": "exit"}).encode())
        s.recv(1 << 20)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        return False
    finally:
        s.close()


def stop_all(owner: str | None = None) -> int:
    """Ask every fork server of this user (with `owner`: of that checkout only) to exit; how many were asked."""
    try:
        d = socket_dir()
    except (OSError, RuntimeError):
        return 0
    n = sum(stop(path) for path in (d.glob("fs-*.sock") if owner is None else _owned(d, owner)))
    for f in [p for ext in ("preload", "log", "failed", "starting", "owner") for p in d.glob(f"fs-*.{ext}")]:
        if not (d / (f.name.rsplit(".", 1)[0] + ".sock")).exists():
            with contextlib.suppress(OSError):
                f.unlink()
    return n
