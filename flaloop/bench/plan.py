"""Plan a measurement: what a session needs to know, decided on the orchestrator.

    plan     (here)             contract, cells, static audit, the last gate  -> MeasurePlan
    measure  (bench/measure.py) a session on one device                       -> Measurement
    finish   (bench/finish.py)  analysis, roofline, guard judgement           -> RunRecord

A plan names both sides as commits (the candidate's working tree is snapshotted into one:
git.snapshot), so the measurement can run anywhere the two commits can be checked out: here, on
another GPU of this host, or on a Ray node that was sent them as a git bundle. It is plain data
(`to_dict`, `from_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from flaloop.bench import options as options_mod
from flaloop.bench import unseen as unseen_mod
from flaloop.bench.model import BenchConfig, Cell, make_cells
from flaloop.bench.record import TreeRef
from flaloop.core import git
from flaloop.core.errors import UsageError
from flaloop.task import contract as contract_mod
from flaloop.task import testcalls


@dataclass
class MeasurePlan:
    op: str
    python: str                 # the target's interpreter
    registry_rel: str           # the registry, relative to the tree (read from the base's tree)
    registry_entry: dict        # the op's registry entry (target query JSON): the roofline's family
    cells: list[Cell]
    config: BenchConfig
    base: TreeRef
    candidate: TreeRef
    static: dict | None = None  # the static audit of the candidate against this base (None for an A/A)
    allowed: list[dict] = field(default_factory=list)
    gate: dict | None = None    # the gate this measurement is taken under (verify, iter, sweep)
    last_gate: dict | None = None  # else the last gate recorded for exactly this tree state
    command: str = ""
    label: str = "bench"        # what the run directory is called after: bench, aa, a sweep candidate
    unseen: dict | None = None  # the shapes nobody times the warm-up checks (bench/unseen.plan), with options
    test_calls: dict | None = None  # the test's own calls the warm-up replays (test_calls_plan)
    # the op's inputs declared in flaloop.toml or read from recorded calls (opdecl, opcalls): the
    # workers build them from this rather than from a registry (registry_rel is then "")
    declared: dict | None = None

    @property
    def same_tree(self) -> bool:
        return self.config.aa

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(cells=[c.to_dict() for c in self.cells], config=self.config.to_dict(), base=asdict(self.base),
                 candidate=asdict(self.candidate))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MeasurePlan:
        nested = ("cells", "config", "base", "candidate")
        return cls(cells=[Cell.from_dict(c) for c in d["cells"]], config=BenchConfig.from_dict(d["config"]),
                   base=TreeRef.from_dict(d["base"]), candidate=TreeRef.from_dict(d["candidate"]),
                   **{k: v for k, v in d.items() if k in {f.name for f in fields(cls)} - set(nested)})


def tree_ref(root, ref: str, commit: str | None = None) -> TreeRef:
    """A side of a measurement named by a ref (resolved here unless its `commit` is known)."""
    commit = commit or git.resolve_ref(root, ref)
    return TreeRef(commit=commit, ref=ref, tree=git.tree_of(root, commit))


def base_ref(target, contract, ref: str | None) -> TreeRef:
    """The base of a measurement: `ref` when given, else the contract's base."""
    return tree_ref(target.root, ref) if ref else tree_ref(target.root, contract.base_ref, contract.base_commit)


def working_tree(target, state: dict | None = None) -> TreeRef:
    """The working tree as a candidate: snapshotted into a commit (git.snapshot); `state`, its
    git.tree_state when the caller has it."""
    state = state or git.tree_state(target.root)
    commit = git.snapshot(target.root)
    return TreeRef(commit=commit, ref="working tree", head=state["head"], dirty=state["dirty"],
                   diff_hash=state["diff_hash"], tree=git.tree_of(target.root, commit))


def plan(target, contract, *, base: TreeRef, candidate: TreeRef, shapes: list[str] | None, cfg: BenchConfig,
         static: dict | None = None, gate: dict | None = None, last_gate: dict | None = None,
         command: str = "", label: str | None = None) -> MeasurePlan:
    """The cells and everything else a session on `candidate` against `base` needs (no process starts)."""
    spec = target.declared_at(target.contract_spec(contract), base.commit)
    if spec.declared is not None:  # the worker builds its inputs from the declaration (bench/measure.py)
        registry_rel = ""
    else:
        registry_rel = str(target.registry_file.relative_to(target.root))
        if git.file_at(target.root, base.commit, registry_rel) is None:
            raise UsageError(f"the base {base.commit[:12]} has no {registry_rel}",
                             "choose a base that has the registry (--base)")
    configs = target.shape_configs(spec)
    cells = make_cells(configs, shapes or contract.shapes, cfg.modes, cfg.dtype, cfg.varlen, cfg.l2)
    if not cells:
        raise UsageError("no bench cells: no shapes selected", "pass --shapes or set shapes in the contract")
    cfg.inputs = {**contract.input_overrides, **cfg.inputs}
    contract_mod.check_overrides(spec, cfg.inputs)
    doc = testcalls.load(target.workspace(contract.op), contract.test_file)
    unseen = unseen_mod.plan(cfg, configs, cells, spec.registry)
    if spec.declared and spec.declared.get("recorded") and not unseen["off"]:
        unseen.update(off="the op's shapes are recorded calls: no dimension to vary", shapes=[], on_path=[])
    if not unseen.get("off"):
        unseen["options"] = options_mod.plan(cfg, list(contract.parameters or []), spec.registry or {}, doc,
                                             unseen["shapes"], package=spec.package, func_name=spec.func_name)
    return MeasurePlan(op=contract.op, python=target.python, registry_rel=registry_rel,
                       registry_entry=spec.registry or {}, cells=cells, config=cfg, base=base,
                       candidate=candidate, static=None if cfg.aa else static,
                       allowed=list(getattr(contract, "allowed", None) or []), gate=gate, last_gate=last_gate,
                       command=command, label=label or ("aa" if cfg.aa else "bench"), unseen=unseen, declared=spec.declared,
                       test_calls=test_calls_plan(cfg, doc, package=spec.package, func_name=spec.func_name,
                                                  op=contract.op, backward=not (spec.registry or {}).get("skip_backward")))


def test_calls_plan(cfg: BenchConfig, doc: dict | None, *, package: str, func_name: str, op: str,
                    backward: bool = True) -> dict:
    """The seeded sample of the test's recorded calls the warm-up replays, or why none (`off`)."""
    out = {"n": cfg.test_calls, "seed": cfg.unseen_seed, "dtype": cfg.dtype, "tol": cfg.diff_tol, "aa": bool(cfg.aa),
           "off": None, "recorded": None, "calls": [], "backward": backward}
    if cfg.test_calls <= 0:
        out["off"] = "--test-calls 0"
    elif cfg.aa and cfg.signal:
        out["off"] = "a quick A/A: no candidate to check, and compiling them for later is not quick"
    elif doc is None:
        out["off"] = (f"no test calls recorded at the base: they are recorded when the gate runs on a clean checkout "
                      f"of the base (`flaloop baseline {op}`, or `flaloop gate {op} --regate` there)")
    elif not doc["calls"]:
        out["off"] = "the test made no call into the op's package that returns a tensor (at the base)"
    if out["off"]:
        return out
    out["recorded"] = {"base_commit": doc.get("base_commit"), "calls": len(doc["calls"]),
                       "functions": len({c["fn"] for c in doc["calls"]})}
    out["calls"] = testcalls.sample(doc, cfg.test_calls, cfg.unseen_seed, package=package, func_name=func_name)
    return out
