"""Processes, read through /proc: alive, descendants, and polling for a condition."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def ppid(pid: int) -> int | None:
    """The parent of a process, None when it is gone."""
    st = _stat(pid)
    return st[1] if st else None


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")  # a zombie has finished running


def descendants(pid: int) -> list[int]:
    """Every living process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) and st[0] not in ("Z", "X"):
            children.setdefault(st[1], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _is_fork_server_cmd(pid: int) -> bool:
    try:
        return b"--forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


def fork_servers(pids: list[int]) -> set[int]:
    """The warm fork servers among `pids`: started by a flaloop command, meant to outlive it. A
    process they forked keeps their command line, but its parent is a server."""
    return {p for p in pids if _is_fork_server_cmd(p) and not _is_fork_server_cmd(ppid(p) or 0)}


def wait_for(cond, timeout: float, step: float = 0.1):
    """Poll `cond` until it returns something truthy (returned) or `timeout` s pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(step)
