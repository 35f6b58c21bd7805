"""Where a sweep's jobs run. An executor takes jobs and yields their results as they finish, one
measurement per device at a time; the orchestrator of each pair sits on the machine whose device
it measures (the unit of remote work is a whole job, never one side of a pair).

- `LocalExecutor`: this host. One slot per visible GPU (`CUDA_VISIBLE_DEVICES` per job); on a
  machine without one, one slot: the CPU measures one candidate at a time, or they would time
  each other.
- `RayExecutor` (sweep/ray_executor.py, imported only for `--executor ray`): one Ray task per job
  on a Ray cluster.

Both take a cancel event: set (Ctrl-C), every running job is withdrawn and cleaned up, and `run`
raises KeyboardInterrupt once they are.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol

from flaloop.bench import evidence
from flaloop.bench.session import Cancelled
from flaloop.sweep.job import Job, JobContext, JobResult, run_job


class Executor(Protocol):
    slots: int

    def run(self, jobs: list[Job], on_event: Callable[..., None]) -> Iterator[JobResult]: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


class LocalExecutor:
    """Jobs in threads of this process, one per device slot; `triton_cache(op)` is the op's cache
    (the one its benches use: what a sweep compiles, the loop reuses)."""

    def __init__(self, *, repo: Path, home: Path, run_root: Path, triton_cache: Callable[[str], Path],
                 gpus: list[str] | None = None, cancel: threading.Event | None = None):
        self.repo, self.home, self.run_root, self.triton_cache = repo, home, run_root, triton_cache
        found = evidence.visible_gpus() if gpus is None else gpus
        self.devices: list[str | None] = list(found) or [None]
        self.slots = len(self.devices)
        self.cancel = cancel or threading.Event()

    def describe(self) -> dict:
        return {"kind": "local", "slots": self.slots,
                "devices": [d if d is not None else "cpu" for d in self.devices]}

    def run(self, jobs: list[Job], on_event: Callable[..., None]) -> Iterator[JobResult]:
        free: queue.Queue = queue.Queue()
        for d in self.devices:
            free.put(d)

        def one(job: Job) -> JobResult:
            device = free.get()
            try:
                if self.cancel.is_set():
                    raise Cancelled("the sweep was withdrawn")
                on_event("start", key=job.key, where="cpu" if device is None else f"GPU {device}")
                ctx = JobContext(repo=self.repo, home=self.home, run_dir=self.run_root / job.key,
                                 triton_cache=self.triton_cache(job.plan["op"]), gpu=device, on_event=on_event,
                                 cancel=self.cancel)
                return run_job(job, ctx)
            finally:
                free.put(device)

        pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="flaloop-sweep")
        futures: dict[Future, Job] = {pool.submit(one, j): j for j in jobs}
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for f in done:
                    try:
                        yield f.result()
                    except Cancelled:
                        continue
        except BaseException:
            self.cancel.set()  # Ctrl-C (or the caller stopped): every job unwinds its worktrees and workers
            for f in futures:
                f.cancel()
            raise
        finally:
            pool.shutdown(wait=True)
        if self.cancel.is_set():
            raise KeyboardInterrupt

    def close(self) -> None:
        pass
