"""Where a session's worker processes come from: started ahead, in parallel, in pairs.

A run needs a fresh pair of processes per round (and one for the warm-up when it compiles), and
each pays the target's import. The pool starts every pair the run is known to need at once, so
their imports overlap one another and the warm-up, and forks them from a warm fork server when
one is there for this interpreter, environment and preload list (bench/forkservers.py); a run
that found none spawns its workers and leaves one behind, preloading what its workers imported.
A pair is greeted (hello, provenance check) only when its round begins; until then its
processes wait on their stdin, idle.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from flaloop import fsutil
from flaloop.bench import forkservers
from flaloop.bench.forkservers import ForkServer
from flaloop.bench.workers import WorkerClient, WorkerFailed
from flaloop.errors import MeasurementError, StorageError

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
    def __init__(self, *, python: str, op: str, device: str, trees: dict[str, Path], registry: Path,
                 run_dir: Path, env: dict, setup_timeout: float, use_forkserver: bool, preload_file: Path,
                 gpu: str | None = None, import_mode: str = "full"):
        self.python, self.op, self.device = python, op, device
        self.import_mode = import_mode
        self.trees, self.registry, self.run_dir, self.env = trees, registry, run_dir, env
        self.setup_timeout = setup_timeout
        self.preload_file = preload_file
        self.env_extra = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}
        self.server: ForkServer | None = None
        self.forkserver: dict = {"used": False, "why": "not asked for (--no-forkserver)"}
        self.use_forkserver = use_forkserver
        self.preload = self._preload()
        self.seen_preload: dict[str, None] = {}  # third-party modules this run's workers imported, in order
        self.started: list[WorkerClient] = []
        self.ahead: dict[str, tuple[tuple[str, str], dict[str, WorkerClient]]] = {}
        self._n = 0
        if use_forkserver:
            self._connect_server()

    # -- the fork server --

    def _preload(self) -> list[str]:
        try:
            names = json.loads(self.preload_file.read_text())
            return [n for n in names if isinstance(n, str)]  # in import order (worker/target.py)
        except (OSError, ValueError):
            return ["torch", "triton"]

    def _connect_server(self) -> None:
        self.server = ForkServer.connect(self.python, self.env, self.preload)
        if self.server is not None:
            ready = self.server.ready
            self.forkserver = {"used": True, "why": "", "preload": ready.get("preload"), "pid": ready.get("pid"),
                               "socket": str(self.server.path)}
        elif (why := forkservers.failure(self.python, self.env, self.preload)) is not None:
            self.forkserver = {"used": False, "why": f"a fork server cannot run for this key: {why}; spawned "
                                                     "(`flaloop clean` lets the next run try again)"}
        else:
            self.forkserver = {"used": False, "why": "no fork server was warm for this interpreter, environment "
                                                     "and preload: spawned (one is left for the next run)"}

    def fall_back(self, why: str) -> None:
        """Stop forking: every later worker is spawned (a forked child could not run, say)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        self.use_forkserver = False  # and leave none behind
        self.forkserver = {**self.forkserver, "used": False, "why": why}

    def _leave_server(self) -> None:
        """Keep the third-party modules this run's workers imported beyond the preload, and leave a
        fork server preloading them all for the next run unless the one used has exactly that key."""
        if not self.use_forkserver or (self.server is None and not self.seen_preload):
            return
        names = list(dict.fromkeys([*self.preload, *self.seen_preload]))
        if names != self.preload:
            with contextlib.suppress(StorageError):  # a cache: the next run just preloads less
                fsutil.atomic_write_json(self.preload_file, names, indent=None)
        if self.server is None or names != self.preload:
            there = ForkServer.connect(self.python, self.env, names, wait=False)  # another run's, warm
            if there is not None:
                there.close()
                self.forkserver["left_warm"] = str(there.path)
                return
            coming = forkservers.starting(self.python, self.env, names)  # another run's, preloading
            if coming is not None:
                self.forkserver["left_warm"] = str(coming)
                return
            path = forkservers.start(self.python, self.env, names)
            self.forkserver["left_warm"] = str(path) if path else None

    # -- pairs --

    def start_pair(self, order: tuple[str, str], label: str, import_mode: str | None = None) -> dict[str, WorkerClient]:
        """Start one process per side, in `order` (the round's start order); don't wait for them."""
        import_mode = import_mode or self.import_mode
        pair = {}
        for side in order:
            self._n += 1
            log = self.run_dir / f"{side}-{label}.stderr"
            try:
                w = WorkerClient(side, self.python, self.trees[side], self.registry, self.op, self.device, log,
                           env=self.env, server=self.server, env_extra=self.env_extra,
                           import_mode=import_mode)
            except RuntimeError as exc:  # the fork server refused: spawn from now on
                self.fall_back(str(exc))
                w = WorkerClient(side, self.python, self.trees[side], self.registry, self.op, self.device, log,
                           env=self.env, env_extra=self.env_extra, import_mode=import_mode)
            self.started.append(w)
            pair[side] = w
        return pair

    def greet(self, pair: dict[str, WorkerClient], order: tuple[str, str]) -> dict[str, dict]:
        """hello from each side (in order), each proving its op came from its own tree."""
        hellos = {}
        for side in order:
            w = pair[side]
            w.hello = w.request("hello", self.setup_timeout)
            hellos[side] = w.hello
            self.seen_preload.update((m, None) for m in (w.hello.get("preload") or []) if isinstance(m, str))
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
            self.fall_back(f"a forked worker failed to start ({exc.message}); spawned instead")
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
        out = [w.proc.pid for w in self.started]
        if self.server is not None:
            out.append(self.server.pid)
        return out

    @staticmethod
    def close_pair(pair: dict[str, WorkerClient]) -> None:
        for w in pair.values():
            w.close()

    def close(self, leave_server: bool = True) -> None:
        for w in self.started:
            try:
                w.close()
            except OSError:
                pass
        if leave_server:
            self._leave_server()
        if self.server is not None:
            self.server.close()
            self.server = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(leave_server=exc_type is None)  # an interrupted or failed run starts nothing new
