"""Where a session's worker processes come from: the `Launcher` seam.

A session never starts a process itself: it is handed a launcher, and asks it for one worker per
side and round. Two are real:

- `SpawnLauncher`: a plain subprocess of the target's interpreter per worker (each pays the whole
  import of torch and the target: 10-17 s for FLA on the H200);
- `ForkLauncher`: forks workers from a warm fork server that imported the target's third-party
  libraries once (bench/forkservers.py; FLA's own import then took 1.9 s a worker). With none warm
  it starts one and forks from it once it listens: the server pays the import once, where every
  spawned worker would pay it again (a run starts a warm-up pair and a pair per round). It spawns
  when that server does not come up in time or cannot run, and as the run ends it leaves a server
  preloading what its workers imported. A forked child that cannot run (a library broken by fork,
  CUDA initialised before it) makes it spawn from then on (`fall_back`).

Tests hand a session a launcher of scripted fake workers (tests/unit/test_session.py): anything with
`start`, `fall_back`, `note_imported`, `pids`, `describe` and `close` will do.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Protocol

from flaloop import inside
from flaloop.bench import forkservers
from flaloop.bench.forkservers import ForkedProc, ForkServer
from flaloop.bench.workers import WorkerClient
from flaloop.core import fsutil, procs
from flaloop.core.errors import StorageError
from flaloop.core.procs import kill_group

WORKER = inside.WORKER / "__main__.py"


class Launcher(Protocol):
    """Starts the workers of a session; says how it did (the record's `env.forkserver`)."""

    def start(self, side: str, tree: Path, log_path: Path, import_mode: str) -> WorkerClient: ...

    def fall_back(self, why: str) -> None: ...

    def note_imported(self, modules: list[str]) -> None: ...

    def pids(self) -> list[int]: ...

    def describe(self) -> dict: ...

    def close(self, leave_warm: bool = True) -> None: ...


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


def worker_args(side: str, tree: Path, registry: Path, op: str, device: str, workdir: Path,
                import_mode: str) -> list[str]:
    args = ["--tree", str(tree), "--registry", str(registry), "--op", op, "--side", side, "--workdir", str(workdir)]
    if device != "auto":
        args += ["--device", device]
    if import_mode != "full":
        args += ["--import-mode", import_mode]
    return args


class SpawnLauncher:
    """One plain subprocess of the target's interpreter per worker."""

    def __init__(self, *, python: str, op: str, registry: Path, device: str, env: dict,
                 gpu: str | None = None, why: str = "not asked for (--no-forkserver)",
                 side_env: dict[str, dict] | None = None):
        self.python, self.op, self.registry, self.device = python, op, registry, device
        self.env = {**env, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
        self.side_env = {side: dict(e) for side, e in (side_env or {}).items() if e}  # --cand-env
        self.started: list[WorkerClient] = []
        self.forkserver: dict = {"used": False, "why": why}

    def _open(self, side: str, tree: Path, log_path: Path, import_mode: str, server: ForkServer | None):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = procs.CappedLog(log_path)  # a chatty op cannot fill the disk
        args = worker_args(side, tree, self.registry, self.op, self.device, log_path.parent, import_mode)
        env = {**self.env, **self.side_env.get(side, {})}
        try:
            if server is not None:
                pid, stdin, stdout = server.spawn(args, tree, env, log)
                proc = ForkedProc(server, pid, stdin, stdout)
            else:
                proc = SpawnedProc([self.python, "-u", str(WORKER), *args], tree, env, log)
        except BaseException:
            log.close()
            raise
        log.started()  # the child holds the log's write end now
        w = WorkerClient(side, tree, proc, log, forked=server is not None)
        self.started.append(w)
        return w

    def start(self, side: str, tree: Path, log_path: Path, import_mode: str) -> WorkerClient:
        return self._open(side, tree, log_path, import_mode, None)

    def fall_back(self, why: str) -> None:
        self.forkserver = {**self.forkserver, "used": False, "why": why}

    def note_imported(self, modules: list[str]) -> None:
        pass

    def pids(self) -> list[int]:
        return [w.pid for w in self.started]

    def describe(self) -> dict:
        return dict(self.forkserver)

    def close(self, leave_warm: bool = True) -> None:
        for w in self.started:
            with contextlib.suppress(OSError):
                w.close()


class ForkLauncher(SpawnLauncher):
    """Workers forked from the warm fork server of this interpreter, environment and preload list,
    spawned when there is none; leaves one warm for the next run."""

    def __init__(self, *, python: str, op: str, registry: Path, device: str, env: dict, preload_file: Path,
                 gpu: str | None = None, owner: str | None = None):
        super().__init__(python=python, op=op, registry=registry, device=device, env=env, gpu=gpu)
        self.server_env = env  # the key's environment: without the device, which the fork hands each child
        self.preload_file = preload_file
        self.preload = forkservers.remembered(preload_file)
        self.seen: dict[str, None] = {}  # third-party modules this run's workers imported, in order
        self.server: ForkServer | None = None
        self.leaving = True
        self.owner = owner  # the checkout whose server this run leaves warm (forkservers.start)
        self.own_server: Path | None = None  # the socket of the server this run started, if it started one
        self._connect()

    def _connect(self) -> None:
        self.server = ForkServer.connect(self.python, self.server_env, self.preload)
        waited = None  # seconds spent starting a server and waiting for it
        if self.server is None and forkservers.failure(self.python, self.server_env, self.preload) is None:
            # none warm: start one and fork from it once it listens (or spawn, if it does not in time)
            t0 = time.monotonic()
            self.own_server = forkservers.start(self.python, self.server_env, self.preload, owner=self.owner)
            # ours, or one another run began starting a moment ago
            self.server = ForkServer.connect(self.python, self.server_env, self.preload)
            waited = round(time.monotonic() - t0, 2)
        if self.server is not None:
            ready = self.server.ready
            self.forkserver = {"used": True, "why": "", "preload": ready.get("preload"), "pid": ready.get("pid"),
                               "socket": str(self.server.path), "started": self.own_server is not None}
        elif (why := forkservers.failure(self.python, self.server_env, self.preload)) is not None:
            self.forkserver = {"used": False, "why": f"a fork server cannot run for this key: {why}; spawned "
                                                     "(`flaloop clean` lets the next run try again)"}
        else:
            self.forkserver = {"used": False, "why": "no fork server was warm for this interpreter, environment "
                                                     "and preload, and none came up within "
                                                     f"{forkservers.STARTING_WAIT_S:.0f} s of being started: spawned"}
        if waited is not None:
            self.forkserver["start_wait_s"] = waited

    def start(self, side: str, tree: Path, log_path: Path, import_mode: str) -> WorkerClient:
        if self.server is not None:
            try:
                return self._open(side, tree, log_path, import_mode, self.server)
            except RuntimeError as exc:  # the fork server refused: spawn from now on
                self.fall_back(str(exc))
        return self._open(side, tree, log_path, import_mode, None)

    def fall_back(self, why: str) -> None:
        """Stop forking: every later worker is spawned, and no server is left behind."""
        if self.server is not None:
            self.server.close()
            self.server = None
        self.leaving = False
        super().fall_back(why)

    def note_imported(self, modules: list[str]) -> None:
        self.seen.update((m, None) for m in modules if isinstance(m, str))

    def pids(self) -> list[int]:
        return super().pids() + ([self.server.pid] if self.server is not None and self.server.pid else [])

    def _leave_server(self) -> None:
        """Keep the third-party modules this run's workers imported beyond the preload, and leave a
        fork server preloading them all for the next run unless the one used has exactly that key."""
        if not self.leaving or (self.server is None and not self.seen):
            return
        names = list(dict.fromkeys([*self.preload, *self.seen]))
        if names != self.preload:
            with contextlib.suppress(StorageError):  # a cache: the next run just preloads less
                fsutil.atomic_write_json(self.preload_file, names, indent=None)
        if self.server is None or names != self.preload:
            there = ForkServer.connect(self.python, self.server_env, names, wait=False)  # another run's, warm
            if there is not None:
                there.close()
                self.forkserver["left_warm"] = str(there.path)
                return
            coming = forkservers.starting(self.python, self.server_env, names)  # another run's, preloading
            if coming is not None:
                self.forkserver["left_warm"] = str(coming)
                return
            path = forkservers.start(self.python, self.server_env, names, owner=self.owner)
            self.forkserver["left_warm"] = str(path) if path else None

    def close(self, leave_warm: bool = True) -> None:
        super().close()
        if leave_warm:
            self._leave_server()
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.own_server is not None and not (leave_warm and self.leaving):
            # an interrupted run, or one whose forked workers could not run, leaves no server it started
            forkservers.stop(self.own_server)


def make_launcher(*, forkserver: bool, python: str, op: str, registry: Path, device: str, env: dict,
                  import_mode: str, gpu: str | None = None, cand_env: dict | None = None,
                  owner: str | None = None) -> SpawnLauncher:
    """The launcher a real measurement uses: forked workers unless the config says otherwise. With
    `cand_env` (--cand-env) both sides are spawned: a fork server's preloaded libraries read their
    environment at import, before the candidate's could be set, and forking one side only would
    make the sides' processes differ by more than that environment."""
    if cand_env:
        return SpawnLauncher(python=python, op=op, registry=registry, device=device, env=env, gpu=gpu,
                             why="--cand-env: both sides spawned, so that the candidate's environment is there "
                                 "from its first import", side_env={"cand": cand_env})
    if not forkserver:
        return SpawnLauncher(python=python, op=op, registry=registry, device=device, env=env, gpu=gpu)
    return ForkLauncher(python=python, op=op, registry=registry, device=device, env=env, gpu=gpu,
                        preload_file=forkservers.preload_file(python, op, import_mode), owner=owner)


