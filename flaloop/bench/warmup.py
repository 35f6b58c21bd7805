"""The session's warm-up of each cell, in the warm-up pair (which then measures nothing).

For every cell, both sides before any timed sample: set up (build inputs, compile, autotune,
capture and prove the CUDA graph; the base calibrates k), the base's results finite (else the
inputs are outside the op's domain: refused), the candidate's equal to the base's (else blocked),
and the guard's probes on both sides, the mutation probe among them (docs/GUARD.md). Results
cross from base to candidate as CUDA IPC handles on a GPU, a file otherwise
(bench/worker/compare.py).

A mixin of `Session` (bench/session.py), which holds the state these methods use.
"""

from __future__ import annotations

import time

from flaloop.bench.analysis import tuning_differences
from flaloop.bench.model import CellResult
from flaloop.bench.workers import WorkerFailed
from flaloop.guard import dynamic
from flaloop.guard.findings import apply_allowances


class WarmUp:
    def _warm_all(self) -> None:
        for i, res in enumerate(self.results):
            self.on_event("warm", cell=res.cell.id, index=i, total=len(self.results))
            try:
                self._warm(res)
                if not self.broken:
                    self._release(res)
            except WorkerFailed as exc:
                self._cell_failed(res, exc)
                if not self._restart(exc.message):
                    return
            if self.broken and not self._restart(self.broken):
                return
            if self._blocked_run():
                return

    def _warm(self, res: CellResult) -> None:
        base = self._setup(res, "base", None, "auto")
        res.setup["base"] = base
        if not base.get("ok"):
            return self._fail(res, "base", base)
        nonfinite = {n: c for n, c in base.get("nonfinite", {}).items() if c}
        if nonfinite:
            res.status, res.reason = "refused", (
                "inputs outside the op's domain: the BASE gives non-finite values "
                + ", ".join(f"{n}: {c}" for n, c in nonfinite.items())
                + " (override an input transform in the contract, e.g. --input k=l2norm)")
            return None
        cand = self._setup(res, "cand", base["k"], "auto")
        res.setup["cand"] = cand
        if not cand.get("ok"):
            return self._fail(res, "cand", cand)
        res.tuning_differs = tuning_differences(base.get("tuning") or {}, cand.get("tuning") or {})
        if cand["timer"] != base["timer"]:  # both sides must be timed the same way
            why = cand.get("capture_error") or base.get("capture_error")
            base = self._setup(res, "base", base["k"], "eager")
            cand = self._setup(res, "cand", base["k"], "eager")
            res.setup.update(base=base, cand=cand, timer_note=f"one side could not be captured: {why}")
            if not (base.get("ok") and cand.get("ok")):
                return self._fail(res, "base" if not base.get("ok") else "cand", base if not base.get("ok") else cand)
        res.timer, res.k = base["timer"], base["k"]
        cmp_ = self._exchange(res, mutated=False)
        if cmp_ is None:
            return None
        res.diff = cmp_
        if not cmp_.get("match"):
            worst = sorted(cmp_.get("tensors", {}).items(), key=lambda kv: -(kv[1].get("rel_rms") or 0))[:3]
            res.status, res.reason = "blocked", (
                "candidate differs from base: " + ", ".join(
                    f"{n} rel-RMS {t.get('rel_rms')}, non-finite {t.get('nonfinite_self')}" for n, t in worst))
            found = dynamic.finding("differs-from-base", res.reason, res.cell.id)
            res.findings = [f.to_dict() for f in apply_allowances([found], [])]  # never allowable: it is wrong
            return None
        if self.cfg.probes:
            self._probe(res)
        return None

    def _exchange(self, res: CellResult, mutated: bool) -> dict | None:
        """The base's results on set 0 (with `mutated`: on inputs changed in place) compared in the
        candidate with its own; None when a side failed (the cell is failed). On a GPU the results
        cross as CUDA IPC handles; where that is impossible, as a file in the run directory."""
        dump = self.run_dir / f"{'mutated' if mutated else 'dump'}-{self.results.index(res)}.pt"
        share = self.transfer["how"] == "cuda-ipc"
        try:
            d = self._ask("base", "dump", self.cfg.setup_timeout, cell=res.cell.id, path=str(dump),
                          mutated=mutated, share=share)
            if not d.get("ok"):
                return self._fail(res, "base", d)
            if share and not d.get("shared"):
                self.transfer = {"how": "file", "why": d.get("share_error") or "the base could not share"}
            ref = {"shared": d["shared"]} if d.get("shared") else {"ref": str(dump)}
            c = self._ask("cand", "compare", self.cfg.setup_timeout, cell=res.cell.id, tol=self.cfg.diff_tol,
                          mutated=mutated, **ref)
            if d.get("shared"):
                self._ask("base", "unshare", 120)
                if c.get("shared_error"):  # the candidate could not map the handles: the file, from now on
                    self.transfer = {"how": "file", "why": f"the candidate could not map them: {c['shared_error']}"}
                    return self._exchange(res, mutated)
        finally:
            dump.unlink(missing_ok=True)
        if not c.get("ok"):
            return self._fail(res, "cand", c)
        return c

    def _probe(self, res: CellResult) -> None:
        t0 = time.monotonic()
        try:
            # one side after the other: each alone on the GPU, as the determinism probe must see it
            replies = {}
            for side in self._order():
                replies[side] = self._ask(side, "probe", self.cfg.setup_timeout, cell=res.cell.id)
                if not replies[side].get("ok"):
                    return self._fail(res, side, replies[side])
            b, c = replies["base"], replies["cand"]
            mutated = self._exchange(res, mutated=True)
            if mutated is None:
                return None
        finally:
            self.probe_seconds += time.monotonic() - t0
        res.probes = {"base": b["probes"], "cand": c["probes"], "mutated": mutated,
                      "seconds": {"base": b.get("seconds"), "cand": c.get("seconds"),
                                  "mutated": mutated.get("seconds")}}
        found = dynamic.cell_findings(res.cell.id, b["probes"], c["probes"], mutated,
                                           self.cfg.diff_tol, aa=self.cfg.aa)
        res.findings = [f.to_dict() for f in apply_allowances(found, self.allowed)]
        blocking = sorted({f["rule"] for f in res.findings if f["blocking"]})
        if blocking:
            res.status, res.reason = "blocked", "guard: " + ", ".join(blocking)
        return None
