"""One flaloop process at a time per op workspace (`profile/<op>-opt/`).

Every command that writes the workspace (init, gate, bench, verify, clean, and the loop's
commands) holds `workspace_lock(target, op)`: an exclusive `fcntl.flock` on
`profile/<op>-opt/.lock`. A second command on the same op waits, saying whom it waits for
(the holder writes its pid, host, command and start time into the file), or fails at once
with `wait=False` (`--no-wait`, exit 2). Different ops of one repo have different workspaces
and run side by side. Taking it again inside a block that holds it is a no-op.

flock belongs to the open file: the kernel drops it when the holder exits however it exits
(SIGKILL included), so a lock is never left stale. The file itself is never deleted (deleting
a lock file others may hold open would let two processes "hold" it at once); it is emptied
when released. The descriptor is not inherited by children, so an orphaned worker could not
keep the lock either.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from flaloop.core import clock, fsutil, git
from flaloop.core.errors import Busy
from flaloop.core.workspace import Workspace

# Locks this process holds. flock conflicts between two descriptors of one process, so taking a
# held lock again would wait for ourselves forever; nested use is allowed instead.
_HELD: dict[str, Holder] = {}


@dataclass
class Holder:
    pid: int | None = None
    host: str | None = None
    command: str | None = None
    started: str | None = None

    def describe(self) -> str:
        if self.pid is None:
            return "another flaloop process"
        where = "" if self.host in (None, socket.gethostname()) else f" on {self.host}"
        return f"flaloop pid {self.pid}{where} ({self.command or 'a command'}, started {self.started or '?'})"


def read_holder(fd: int) -> Holder:
    """Holder info from the lock file; empty while the holder is still writing it."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return Holder(**{k: data.get(k) for k in ("pid", "host", "command", "started")})
    except (OSError, ValueError, TypeError):
        return Holder()


@contextlib.contextmanager
def workspace_lock(target, op: str, wait: bool = True, command: str | None = None,
                   on_wait: Callable[[Holder], None] | None = None) -> Iterator[Holder]:
    """Hold the op's workspace exclusively for the block.

    `wait=False`: raise Busy (exit 2) when another process holds it. `on_wait(holder)` is called
    once before blocking, so the caller can say whom it waits for. Yields this process's Holder.
    The workspace is made (and git-ignored) when it does not exist yet.
    """
    ws = target.workspace(op)
    if not ws.path.exists():  # git ignores the workspace before anything lands in it
        git.ensure_ignored(target.root, os.path.relpath(ws.path, target.root))
    with lock_dir(ws, wait, command, on_wait, label=os.path.relpath(ws.path, target.root) + "/") as me:
        yield me


@contextlib.contextmanager
def lock_dir(ws: Workspace, wait: bool = True, command: str | None = None,
             on_wait: Callable[[Holder], None] | None = None, label: str | None = None,
             busy_hint: str = "wait for it to finish, or rerun without --no-wait to queue behind it",
             ) -> Iterator[Holder]:
    """`workspace_lock` for a workspace given as one (`label`: how messages name it)."""
    path = ws.lock_file
    label = label or f"{ws.path.name}/"
    key = os.path.realpath(path)
    if key in _HELD:  # nested in this process (a command calling another's code): already ours
        yield _HELD[key]
        return
    try:
        ws.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise fsutil.storage_error(exc, path) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise fsutil.storage_error(exc, path) from exc
            holder = read_holder(fd)
            if not wait:
                raise Busy(f"{label} is in use by {holder.describe()}", busy_hint) from None
            if on_wait is not None:
                on_wait(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)  # an interrupt while waiting raises here, as it should
        me = Holder(os.getpid(), socket.gethostname(), command, clock.now_iso())
        with contextlib.suppress(OSError):  # the info is a courtesy; the flock is the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
        _HELD[key] = me
        try:
            yield me
        finally:
            del _HELD[key]
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def waiting_message(holder: Holder, rel_ws: str) -> str:
    return f"waiting for {holder.describe()} to finish with {rel_ws}"
