"""A session's worker processes, started ahead and in pairs, from the launcher it was given.

A run needs a fresh pair of processes per round (and one for the warm-up when it compiles), and
each pays the target's import. The pool starts every pair the run is known to need at once, so
their imports overlap one another and the warm-up. A pair is greeted (hello, provenance check)
only when its round begins; until then its processes wait on their stdin, idle.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flaloop.bench.launcher import Launcher
from flaloop.bench.workers import WorkerClient, WorkerFailed
from flaloop.core.errors import MeasurementError

SIDES = ("base", "cand")


def _inside(path: str | None, tree: Path) -> bool:
    return bool(path) and os.path.realpath(path).startswith(os.path.realpath(tree) + os.sep)


def _raised_at(traceback_text: str, tree: Path) -> str:
    """' (at path:line)' of the innermost frame of a traceback that lies inside `tree`."""
    root = os.path.realpath(tree) + os.sep
    spots = [(f, n) for f, n in re.findall(r'File "([^"]+)", line (\d+)', traceback_text)
             if os.path.realpath(f).startswith(root)]
    return f" (at {os.path.relpath(os.path.realpath(spots[-1][0]), root)}:{spots[-1][1]})" if spots else ""


class WorkerPool:
    def __init__(self, *, launcher: Launcher, op: str, trees: dict[str, Path], run_dir: Path,
                 hello_timeout: float, import_mode: str = "full"):
        self.launcher, self.op, self.trees, self.run_dir = launcher, op, trees, run_dir
        self.hello_timeout = hello_timeout
        self.import_mode = import_mode
        self.started: list[WorkerClient] = []
        self.ahead: dict[str, tuple[tuple[str, str], dict[str, WorkerClient]]] = {}

    def start_pair(self, order: tuple[str, str], label: str, import_mode: str | None = None) -> dict[str, WorkerClient]:
        """Start one process per side, in `order` (the round's start order); don't wait for them."""
        pair = {}
        for side in order:
            w = self.launcher.start(side, self.trees[side], self.run_dir / f"{side}-{label}.stderr",
                                    import_mode or self.import_mode)
            self.started.append(w)
            pair[side] = w
        return pair

    def greet(self, pair: dict[str, WorkerClient], order: tuple[str, str]) -> dict[str, dict]:
        """hello from each side (in order), each proving its op came from its own tree."""
        hellos = {}
        for side in order:
            w = pair[side]
            w.hello = w.request("hello", self.hello_timeout)
            hellos[side] = w.hello
            self.launcher.note_imported(w.hello.get("preload") or [])
            if not w.hello.get("ok"):
                tb = w.hello.get("traceback", "")
                raise MeasurementError(f"the {side} worker could not import {self.op}: {w.hello.get('error')}"
                                       f"{_raised_at(tb, w.tree)}",
                                       "fix the import in that tree (rerun with --debug for the worker's traceback)",
                                       detail=tb[-4000:])
            for key in ("op_module_file", "op_func_file"):
                if not _inside(w.hello.get(key), w.tree):
                    raise MeasurementError(
                        f"the {side} worker imported {self.op} from {w.hello.get(key)}, not from its tree {w.tree}",
                        "an installed copy shadows the tree; uninstall it or fix sys.path: "
                        "refusing to measure the wrong code")
        return hellos

    def prestart(self, label: str, order: tuple[str, str], import_mode: str | None = None) -> None:
        """Start the pair a later round will take, now: its import overlaps the current work."""
        if label not in self.ahead:
            self.ahead[label] = (order, self.start_pair(order, label, import_mode))

    def take(self, label: str, order: tuple[str, str]) -> tuple[dict[str, WorkerClient], dict[str, dict]]:
        """A greeted pair for `label`: the one started ahead, else a new one. A forked pair that
        cannot even say hello (a library that broke under fork, CUDA initialised before the fork)
        is replaced by spawned processes, and nothing is forked after that."""
        started = self.ahead.pop(label, None)
        pair = started[1] if started and started[0] == order else self.start_pair(order, label)
        if started and started[0] != order:
            self.close_pair(started[1])
        try:
            return pair, self.greet(pair, order)
        except (MeasurementError, WorkerFailed) as exc:
            if not any(w.forked for w in pair.values()):
                raise
            self.close_pair(pair)
            self.launcher.fall_back(f"a forked worker failed to start ({exc.message}); spawned instead")
            for _, other in self.ahead.values():
                self.close_pair(other)
            self.ahead.clear()
            pair = self.start_pair(order, label + "-spawned")
            return pair, self.greet(pair, order)

    def drop(self, label: str) -> None:
        """A pair started ahead that will not be needed."""
        started = self.ahead.pop(label, None)
        if started:
            self.close_pair(started[1])

    def pids(self) -> list[int]:
        """Every process of ours that may hold the GPU (idle evidence must not count them)."""
        return self.launcher.pids()

    def kill_all(self) -> None:
        for w in list(self.started):
            w.kill()

    @staticmethod
    def close_pair(pair: dict[str, WorkerClient]) -> None:
        for w in pair.values():
            w.close()

    def close(self) -> None:
        for w in self.started:
            try:
                w.close()
            except OSError:
                pass
