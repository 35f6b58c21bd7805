"""`--executor ray`: one Ray task per job (a candidate's gate and paired session) on a Ray cluster.

Imported only for `--executor ray` (ray is an optional extra: `pip install 'flaloop[ray]'`).

- Without `--address`, a local Ray instance is started for the sweep and stopped after it.
- Each task asks for one GPU (`num_gpus=1`: Ray sets its CUDA_VISIBLE_DEVICES); on a cluster
  without GPUs, for every CPU of a node, so that a node measures one candidate at a time.
- The tree states travel as one git bundle (the base and every candidate commit), put in Ray's
  object store once; a task clones it into its own directory on the node, which it removes when
  it ends. A task killed outright leaves that directory; the next task on the node removes it
  (its owner pid is dead), and a local instance's are removed when the sweep ends.
- Each node warms its own fork server and keeps its own Triton cache (the user cache,
  `triton/<op>`), reads its own NVML evidence and its own roofline ceilings; results come back as
  plain dicts (sweep/job.JobResult), finished into run records by the orchestrator.
- A task whose worker process or node dies (WorkerCrashedError, NodeDiedError, ...) is started
  again up to `retries` times, on another node where there is one, then reported `failed` with
  every attempt's reason. An error the job itself raised is not retried: it would fail again.
- A cancel (Ctrl-C) cancels every task (force: their processes are killed, and with them the
  workers and pytest they started, by the parent-death signal and the workers' lifeline).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from flaloop.core import fsutil, git, procs
from flaloop.core.errors import UsageError
from flaloop.sweep.job import Job, JobContext, JobResult, run_job

try:
    import ray
    import ray.exceptions as rex
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # pragma: no cover - the CLI says how to install it
    raise UsageError("--executor ray needs the ray package, which is not installed",
                     "pip install 'flaloop[ray]'  (or: pip install ray)") from exc

# Ray's own failures (the task's process or node went away): worth another attempt elsewhere
LOST = (rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError, rex.OwnerDiedError,
        rex.ObjectLostError, rex.RaySystemError, rex.OutOfMemoryError, rex.ActorDiedError)
# What a task's environment keeps of the orchestrator's: flaloop's and Triton's own settings, the
# user cache (tests isolate it), the interpreter's thread count
ENV_PREFIXES = ("FLALOOP_", "TRITON_", "XDG_CACHE_HOME", "OMP_NUM_THREADS", "PYTHONDONTWRITEBYTECODE")
OWNER = "owner"  # "<pid> <host>" of the task that uses a node directory


def node_root() -> Path:
    return Path(tempfile.gettempdir()) / f"flaloop-ray-{os.getuid()}"


def _reap(root: Path) -> None:
    """Remove the directories of tasks on this node whose process is gone (killed outright)."""
    host = socket.gethostname()
    for owner in root.glob(f"*/*/{OWNER}"):
        try:
            pid, where = owner.read_text().split()
            if where == host and not procs.exists(int(pid)):
                shutil.rmtree(owner.parent, ignore_errors=True)
                with contextlib.suppress(OSError):
                    owner.parent.parent.rmdir()  # the sweep's directory, once its last task's is gone
        except (OSError, ValueError):
            continue


def _events(queue, key: str) -> Callable[..., None]:
    """A job's coarse progress to the orchestrator (not every pair: each is an actor call)."""
    def on_event(kind: str, **info) -> None:
        if kind in ("gate", "bench", "warm", "round", "prime"):
            with contextlib.suppress(Exception):
                queue.put_nowait((key, kind, {k: v for k, v in info.items() if k != "key"}))

    return on_event


def measure_on_node(job: dict, bundle: bytes, sweep_id: str, queue) -> dict:
    """The body of a Ray task: clone the bundle, run the job, return its result (a dict)."""
    j = Job.from_dict(job)
    node = ray.get_runtime_context().get_node_id()
    with contextlib.suppress(Exception):
        queue.put_nowait((j.key, "start", {"where": f"{socket.gethostname()} ({node[:8]})", "node": node,
                                           "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}))
    root = node_root()
    root.mkdir(parents=True, exist_ok=True)
    _reap(root)
    git.reap_stale_tempdirs()  # the worktrees and gate dirs of tasks killed on this node
    work = root / sweep_id / f"{j.key}-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    (work / OWNER).write_text(f"{os.getpid()} {socket.gethostname()}\n")
    try:
        (work / "tree.bundle").write_bytes(bundle)
        repo = work / "repo"
        git.clone_bundle(work / "tree.bundle", repo)
        if not os.path.exists(j.plan.get("python") or ""):
            j.plan["python"] = sys.executable  # the orchestrator's interpreter is not on this node
        ctx = JobContext(repo=repo, home=work / "home", run_dir=work / "run",
                         triton_cache=fsutil.user_cache_dir() / "triton" / j.plan["op"], gpu=None,
                         on_event=_events(queue, j.key))
        out = run_job(j, ctx)
        out.host = f"{socket.gethostname()} ({node[:8]})"
        return out.to_dict()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _reachable(address: str) -> None:
    """Refuse an address nothing listens on, at once (ray.init waits minutes for a cluster that is not there)."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address!r} is not HOST:PORT or ray://HOST:PORT",
                         "e.g. --address ray://head:10001 (Ray Client) or --address head:6379 (on the cluster)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        raise UsageError(f"could not reach the Ray cluster at {address!r}: {exc}",
                         "check the address, that the head node runs (`ray status` there), and that this machine "
                         "may connect to its port") from exc


class RayExecutor:
    def __init__(self, *, repo: Path, address: str | None, retries: int = 2,
                 cancel: threading.Event | None = None, say: Callable[[str], None] = lambda m: None):
        self.repo, self.address, self.retries = repo, address, retries
        self.cancel = cancel or threading.Event()
        self.say = say
        self.started_local = address is None
        self.sweep_id = f"{os.getpid()}-{int(time.time())}"
        if address is not None:
            _reachable(address)
        # Ray's driver threads print what its raylets say ("(raylet) A worker died ...") to stdout,
        # which `--json` keeps for its one document: they go to stderr while Ray runs
        self._stdout, sys.stdout = sys.stdout, sys.stderr
        env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
        runtime_env: dict = {"env_vars": env}
        if address is not None:  # a remote node runs this flaloop, not whatever it has installed
            runtime_env["py_modules"] = [str(Path(__file__).resolve().parents[1])]
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                     runtime_env=runtime_env, configure_logging=True)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError, OSError) as exc:
            sys.stdout = self._stdout
            raise UsageError(f"could not reach the Ray cluster at {address!r}: {exc}" if address else
                             f"could not start a local Ray instance: {exc}",
                             "check the address (ray://HEAD:10001, or HEAD:6379 on the cluster itself) and that "
                             "the cluster runs the same Ray version" if address else
                             "see `ray start --head` for what Ray needs") from exc
        resources = ray.cluster_resources()
        self.gpus = int(resources.get("GPU", 0))
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.node_cpus = max((int(n.get("Resources", {}).get("CPU", 1)) for n in nodes), default=1)
        self.slots = self.gpus or len(nodes) or 1
        self.queue = None

    def describe(self) -> dict:
        return {"kind": "ray", "address": self.address or "local instance", "slots": self.slots, "gpus": self.gpus,
                "nodes": len([n for n in ray.nodes() if n.get("Alive")]), "retries": self.retries,
                "ray": ray.__version__}

    def _options(self, avoid: str | None) -> dict:
        opts: dict = {"max_retries": 0, "name": "flaloop_measure"}
        if self.gpus:
            opts["num_gpus"] = 1
        else:
            opts["num_cpus"] = self.node_cpus  # one job a node: a CPU measures one candidate at a time
        if avoid:
            others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != avoid]
            if others:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=others[0], soft=True)
        return opts

    def run(self, jobs: list[Job], on_event: Callable[..., None]) -> Iterator[JobResult]:
        if not jobs:
            return
        from ray.util.queue import Queue

        self.queue = Queue(actor_options={"num_cpus": 0})
        commits = [c for j in jobs for c in (j.plan["base"]["commit"], j.plan["candidate"]["commit"])]
        with tempfile.TemporaryDirectory(prefix="flaloop-bundle-") as tmp:
            data = git.bundle(self.repo, commits, Path(tmp) / "trees.bundle").read_bytes()
        bundle = ray.put(data)
        task = ray.remote(measure_on_node)
        by_key = {j.key: j for j in jobs}
        attempts: dict[str, list[dict]] = {j.key: [] for j in jobs}
        node_of: dict[str, str] = {}
        refs: dict = {}

        def submit(job: Job, avoid: str | None = None) -> None:
            ref = task.options(**self._options(avoid)).remote(job.to_dict(), bundle, self.sweep_id, self.queue)
            refs[ref] = job.key

        for j in jobs:
            submit(j)
        try:
            while refs:
                if self.cancel.is_set():
                    raise KeyboardInterrupt
                self._drain(on_event, node_of)
                done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
                for ref in done:
                    key = refs.pop(ref)
                    try:
                        result = JobResult.from_dict(ray.get(ref))
                    except LOST as exc:
                        self._drain(on_event, node_of)
                        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                        attempts[key].append({"host": node_of.get(key), "why": why})
                        if len(attempts[key]) <= self.retries:
                            on_event("retry", key=key, why=why)
                            self.say(f"{by_key[key].ref}: its task was lost ({why}); starting it again"
                                     + (" elsewhere" if len(ray.nodes()) > 1 else ""))
                            submit(by_key[key], avoid=node_of.get(key))
                            continue
                        result = JobResult(key=key, status="failed",
                                           reason=f"its task was lost {len(attempts[key])} time(s), the last: {why}")
                    except rex.RayTaskError as exc:
                        result = JobResult(key=key, status="failed",
                                           reason=f"the task raised {str(exc).strip().splitlines()[-1][:300]}")
                    except rex.TaskCancelledError:
                        continue
                    result.attempts = attempts[key]
                    yield result
        except BaseException:
            self.cancel.set()
            for ref in list(refs):
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            raise

    def _drain(self, on_event: Callable[..., None], node_of: dict[str, str]) -> None:
        if self.queue is None:
            return
        try:
            items = self.queue.get_nowait_batch(self.queue.qsize())
        except Exception:  # noqa: BLE001 - progress is a nicety
            return
        for key, kind, info in items:
            if kind == "start":
                node_of[key] = info.get("node")
            on_event(kind, key=key, **info)

    def close(self) -> None:
        try:
            self._close()
        finally:
            sys.stdout = self._stdout

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            if self.queue is not None:
                self.queue.shutdown(force=True)
        if self.started_local:
            with contextlib.suppress(Exception):
                ray.shutdown()
            # this machine is the only node: what a killed task left is ours to remove
            shutil.rmtree(node_root() / self.sweep_id, ignore_errors=True)
        else:
            with contextlib.suppress(Exception):
                ray.shutdown()
