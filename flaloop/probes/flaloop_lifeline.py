"""A watchdog for processes flaloop starts: when the parent is gone, this process goes too.

Standard library only; never imports flaloop (it runs in the target's interpreter). Armed by
the bench worker's main and by the gate's pytest plugin, so by pytest and by each of its xdist
workers, whenever flaloop set FLALOOP_LIFELINE in the environment (see flaloop/procs.py).

A daemon thread compares the parent pid with the one seen when armed, twice a second: after
the parent dies the kernel gives this process a new parent (init or a subreaper). Then the
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
INTERVAL_S = 0.5
_armed = False


def arm(interval: float = INTERVAL_S) -> bool:
    """Start watching the current parent; True when armed (once per process)."""
    global _armed
    if _armed or not os.environ.get(ENV):
        return _armed
    parent = os.getppid()
    if parent == 1:  # already orphaned before we could watch
        _die()
    threading.Thread(target=_watch, args=(parent, interval), daemon=True, name="flaloop-lifeline").start()
    _armed = True
    return True


def _watch(parent: int, interval: float) -> None:
    while True:
        time.sleep(interval)
        if os.getppid() != parent:
            _die()


def _die() -> None:
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
