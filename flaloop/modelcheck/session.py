"""The model check's session: the bench's `Session` with one model cell and its own warm-up.

Everything but the warm-up is the bench's: the pairs started ahead by the pool, a fresh pair for
every round, start order swapped each round, the settle pair, the stopping rule, clock drops,
restarts (bench/session.py, bench/sampling.py). A sample is k training steps (forward, backward,
AdamW) of the model built from each side's own tree (inside/worker/model.py).

The warm-up pair, which measures nothing and is closed before round 1, does what only a model
needs: builds the model on both sides (compiles, autotunes) and checks that both start from the
same weights; trains the trajectories (base and candidate at once, then the base's perturbed runs
that make the band); and the op's share of a step on each side, one side at a time.
"""

from __future__ import annotations

from flaloop.bench.model import CellResult
from flaloop.bench.session import Session, cache_entries
from flaloop.bench.workers import WorkerFailed
from flaloop.modelcheck.spec import ModelSpec


class ModelRefusal(Exception):
    """The model cannot be checked as asked (it does not import, build or fit, or the sides start from
    other weights); the message says which and why."""


class ModelSession(Session):
    def __init__(self, *, spec: ModelSpec, perturb: float, **kw):
        super().__init__(**kw)
        self.spec = spec
        self.perturb = perturb
        self.model: dict = {"trajectories": {}, "opshare": {}, "setup": {}}

    def setup(self, res: CellResult, side: str, k: int | None, timer: str, placements: int = 1,
              reference: bool = False, draw: str | None = None) -> dict:
        # a model step runs on the spec's seeded weights and token stream every round, on both sides:
        # the round's input draw (bench/timed.draw) is for op cells
        cell = res.cell.to_wire(self.cfg, k, timer, 1)
        cell["model"] = self.spec.to_wire()
        return self.ask(side, "setup", self.cfg.worker_timeout, cell=cell)

    def warm(self) -> int:
        res = self.results[0]
        entries = cache_entries(self.triton_cache)
        self.on_event("warm", cell=res.cell.id, index=0, total=3)
        try:
            built = {}
            for side, k in (("base", None), ("cand", None)):
                r = self.setup(res, side, k if side == "base" else built["base"]["k"], "auto")
                if not r.get("ok"):
                    if r.get("model_refused"):
                        raise ModelRefusal(f"{side}: {r.get('error')}")
                    self.fail(res, side, r)
                    return 0
                built[side] = r
            res.setup.update(base=built["base"], cand=built["cand"])
            res.timer, res.k = built["base"]["timer"], built["base"]["k"]
            self.model["setup"] = {side: {key: r.get(key) for key in ("params", "init_digest", "step_ms", "k")}
                                   for side, r in built.items()}
            if built["base"].get("init_digest") != built["cand"].get("init_digest"):
                raise ModelRefusal("the candidate's model starts from other weights than the base's on the same "
                                   "seed: its tree changes the model's construction, not only the op")
            self.mark("model built")
            self._trajectories(res)
            self.mark("trajectories trained")
            self.on_event("warm", cell="the op's share of a step", index=2, total=3)
            for side in self.order():  # one at a time: each side's times alone on the device
                r = self.ask(side, "opshare", self.cfg.worker_timeout, cell=res.cell.id, reps=3)
                if not r.get("ok"):
                    self.fail(res, side, r)
                    return 0
                self.model["opshare"][side] = {k: r.get(k) for k in ("calls", "sites", "op_ms", "step_ms", "share")}
            if not self.model["opshare"]["base"].get("calls"):
                raise ModelRefusal(f"{self.spec.model_class} never called {self.op} in a training step (its layers "
                                   f"reach another function: check the config's mode, e.g. attn_mode)")
            self.mark("op share measured")
            self.release(res)
        except WorkerFailed as exc:
            self.cell_failed(res, exc)
        return cache_entries(self.triton_cache) - entries

    def _trajectories(self, res: CellResult) -> None:
        steps = self.spec.steps
        self.on_event("warm", cell=f"trajectories, {steps} steps", index=1, total=3)
        plain = self.ask_both("trajectory", self.cfg.worker_timeout,
                              {side: {"cell": res.cell.id, "steps": steps} for side in ("base", "cand")})
        runs = {side: r for side, r in plain.items()}
        for i in range(self.spec.band_seeds):
            runs[f"band{i + 1}"] = self.ask("base", "trajectory", self.cfg.worker_timeout, cell=res.cell.id,
                                            steps=steps, perturb=self.perturb, noise_seed=i + 1)
        for name, r in runs.items():
            if not r.get("ok"):
                self.fail(res, "base" if name != "cand" else "cand", r)
                return
            self.model["trajectories"][name] = {k: r.get(k) for k in
                                                ("losses", "grad_norms", "op_calls", "perturb", "noise_seed", "seconds")}
