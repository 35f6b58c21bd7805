"""A watchdog for processes flaloop starts: when the parent is gone, this process goes too.

Standard library only; never imports flaloop (it runs in the target's interpreter). Armed by
the bench worker's main and by the gate's pytest plugin, so by pytest and by each of its xdist
workers, whenever flaloop set FLALOOP_LIFELINE in the environment (see flaloop/core/procs.py).

A daemon thread compares the parent pid with the one seen when armed, twice a second: after
the parent dies the kernel gives this process a new parent (init or a subreaper). A worker
forked by flaloop's fork server (which outlives runs) watches the flaloop process named in
FLALOOP_LIFELINE_PID instead: gone, or a new process under that pid (another start time). Then the
process kills its own process group if it leads one (taking its helpers along), else itself.
The kernel's PR_SET_PDEATHSIG covers flaloop's direct children; this covers the rest (xdist
workers are grandchildren) and a PDEATHSIG that could not be set.
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "FLALOOP_LIFELINE"
PID_ENV = "FLALOOP_LIFELINE_PID"
INTERVAL_S = 0.5
_armed = False


def arm(interval: float = INTERVAL_S) -> bool:
    """Start watching the current parent (or FLALOOP_LIFELINE_PID); True when armed (once per process)."""
    global _armed
    if _armed or not os.environ.get(ENV):
        return _armed
    named = os.environ.get(PID_ENV, "")
    if named.isdigit() and int(named) > 1:
        pid = int(named)
        started = _start_time(pid)
        if started is None:  # flaloop is already gone
            _die()
        alive = lambda: _start_time(pid) == started  # noqa: E731
    else:
        parent = os.getppid()
        if parent == 1:  # already orphaned before we could watch
            _die()
        alive = lambda: os.getppid() == parent  # noqa: E731
    threading.Thread(target=_watch, args=(alive, interval), daemon=True, name="flaloop-lifeline").start()
    _armed = True
    return True


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None when it is gone or a zombie
    (without /proc: "alive" while a signal 0 reaches it)."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
            return "alive"
        except ProcessLookupError:
            return None
        except PermissionError:
            return "alive"
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return None if not fields or fields[0] == "Z" else fields[19]


def _watch(alive, interval: float) -> None:
    while True:
        time.sleep(interval)
        if not alive():
            _die()


def _die() -> None:
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
