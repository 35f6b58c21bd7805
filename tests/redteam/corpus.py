"""The red-team corpus's shared machinery: plant a candidate into a copy of examples/minifla, run the
layer that must stop it, return what that layer found.

Two layers run here on the CPU, each set up once per test process and shared by every class module:

- `static_blocks(edits)`: the static audit (`flaloop.guard.audit.audit`), in-process, on one minifla
  git repo with a contract; the edits go into its working tree and are put back afterwards.
- `probed(name, edits)`: the bench's warm-up and self-check, driven through the real worker protocol
  as the session drives them (bench/warmup.py, bench/sampling.self_check): one base worker, forked
  from the warm fork server and shared, and one candidate worker per planted tree; `hello`
  (`timer-patched`), the differential check (`differs-from-base`, and `precision-narrowed`: the
  candidate dumps, the base judges), the probes and the comparison on inputs changed in place
  (`guard.dynamic.cell_findings`), timed samples then `selfcheck` (`self-check`), and with `unseen`
  the unseen-shape comparison (`unseen-shape-differs`, `precision-narrowed`). The findings are
  judged by the same functions the session calls.
- `host_timed(name, edits)`: paired samples as the session takes them, each side's request timed
  around its round trip in this process, judged by `timer-host-gap` (guard/timing.py) with the
  integrity watch's violations kept apart.

On a GPU, `Subject(device="cuda")` runs the same on minifla's compiled kernels and `fla_subject()` on
real FLA at the repo's `.fla/` (tests marked `gpu`).

An edit is a tuple: `after(path, anchor, text)`, `replace(path, old, new)`, `append(path, text)` or
`new_file(path, text)`. Plants are written in the disguises a static rule does not read where that
makes sense (names built at run time, state on tensors, closures, function attributes), and each
module pairs its cheats with honest changes that must pass.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from support.cli import flaloop
from support.repos import MINIFLA, OP, make_repo

CHUNK = "minifla/ops/linear_attn/chunk.py"
INIT = "minifla/__init__.py"

# anchors in examples/minifla (`after` inserts after one, `replace` replaces its first occurrence)
TOP = "CHUNK_SIZE = 32\n"                                                            # chunk.py, module level
CALL = "    N, scale, max_len = check_inputs(q, k, v, scale, initial_state, cu_seqlens)\n"  # the op's entry
FWD = "    o = torch.empty_like(v)\n"                                                # chunk_linear_attn_fwd
END_INIT = "__version__ = '0.1.0'\n"
APPLY = ("    return ChunkLinearAttnFunction.apply(\n"
         "        q, k, v, scale, initial_state, output_final_state, cu_seqlens, N, max_len,\n    )\n")

# the bench's cell for the corpus: fwd, fp32, the contract's CPU shape. A candidate's worker calls the
# op 13 times by the end of setup, 20 by the end of the warm-up's checks and probes, and 32 by the end
# of the samples: a plant that changes after 24 calls is honest for the checks and not for the timing
SHAPE = {"B": 1, "T": 64, "H": 2, "D": 32}
DIFF_TOL = 0.005          # BenchConfig.diff_tol's default
SAMPLES = 12
# a shape no bench cell uses, off the chunk and power-of-two grid (what bench/unseen.py draws)
UNSEEN = {"B": 1, "T": 33, "H": 1, "D": 24}


def after(path: str, anchor: str, text: str) -> tuple:
    return (path, "after", anchor, text)


def replace(path: str, old: str, new: str) -> tuple:
    return (path, "replace", old, new)


def append(path: str, text: str) -> tuple:
    return (path, "append", None, text)


def new_file(path: str, text: str | bytes) -> tuple:
    return (path, "new", None, text)


def apply(root: Path, edits: list[tuple]) -> dict[Path, bytes | None]:
    """Write `edits` into the tree at `root`; return what each touched file held before (None: absent)."""
    saved: dict[Path, bytes | None] = {}
    for rel, how, anchor, text in edits:
        p = root / rel
        if p not in saved:
            saved[p] = p.read_bytes() if p.exists() else None
        if how == "new":
            p.parent.mkdir(parents=True, exist_ok=True)
            (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
            continue
        old = p.read_text()
        if how == "append":
            p.write_text(old + text)
            continue
        assert anchor in old, f"anchor {anchor!r} not in {rel}"
        i = old.index(anchor)
        p.write_text(old[:i] + text + old[i + len(anchor):] if how == "replace"
                     else old[:i + len(anchor)] + text + old[i + len(anchor):])
    return saved


def restore(saved: dict[Path, bytes | None]) -> None:
    for p, blob in saved.items():
        if blob is None:
            p.unlink(missing_ok=True)
        else:
            p.write_bytes(blob)


# -- the static audit ---------------------------------------------------------------------------------

_lock = threading.Lock()
_shared: dict[str, object] = {}


def _scratch() -> Path:
    import tempfile

    if "scratch" not in _shared:
        root = Path(tempfile.mkdtemp(prefix="flaloop-redteam-"))
        atexit.register(shutil.rmtree, root, True)
        _shared["scratch"] = root
    return _shared["scratch"]


def static_repo() -> Path:
    """minifla as a git repo with a contract (`flaloop init`; no gate: the audit needs none), made
    once per test process."""
    with _lock:
        if "static" not in _shared:
            repo = make_repo(_scratch() / "static" / "minifla")
            r = flaloop(repo, "init", OP, "--shapes", "B1_T64_H2_D32")
            assert r.code == 0, r.stderr
            _shared["static"] = repo
        return _shared["static"]


def audit_findings(edits: list[tuple]) -> list:
    """The static audit's findings on minifla with `edits` in the working tree."""
    from flaloop.guard.audit import audit
    from flaloop.task.contract import Contract
    from flaloop.task.target import Target

    repo = static_repo()
    with _lock:
        saved = apply(repo, edits)
        try:
            target = Target.discover(repo)
            return audit(target, Contract.load(target, OP)).findings
        finally:
            restore(saved)


def static_blocks(edits: list[tuple]) -> set[str]:
    """The rule ids of the audit's blocking findings."""
    return {f.rule for f in audit_findings(edits) if f.blocking}


# -- the bench's dynamic layer ------------------------------------------------------------------------

def _cell(cid: str, shape: dict, subject: Subject | None = None, **kw) -> dict:
    subject = subject or MINI
    return {"id": cid, "shape": dict(shape), "mode": "fwd", "dtype": subject.dtype, "seed": 1,
            "inputs": dict(subject.inputs), "seqlens": None, "k": None, "timer": "auto", "sample_ms": 0.2, **kw}


@dataclass
class Probed:
    """What the bench's dynamic layer found on one planted candidate."""
    findings: list = field(default_factory=list)
    diff: dict | None = None         # the differential check's reply
    selfcheck: dict | None = None
    unseen: dict | None = None       # the base's comparison of the candidate's unseen-shape dump
    times_ms: list = field(default_factory=list)  # the candidate's timed samples, per call
    error: str | None = None         # a worker that failed a request (a crash, a refusal)
    probes: dict = field(default_factory=dict)  # both sides' probe reports ({"base": ..., "cand": ...})

    @property
    def blocking(self) -> set[str]:
        return {f.rule for f in self.findings if f.blocking}

    def show(self) -> str:
        """The findings, a worker's error, and what the probes that judge the GPU's side channels
        read on each side (streams, L2), so that a miss says which reading was not there."""
        lines = [f"{f.severity} {f.rule}: {f.message}" for f in self.findings] or ["(no finding)"]
        if self.error:
            lines.append(f"error: {self.error}")
        if not self.probes:
            lines.append(f"the probes did not run (differential check: {None if self.diff is None else self.diff.get('match')})")
        for side, rep in self.probes.items():
            census = rep.get("census") or {}
            lines.append(f"{side} census: " + (str(census["error"]) if "error" in census else
                         f"{census.get('n_streams')} stream(s), calling stream {census.get('calling_stream')} "
                         f"(by {census.get('calling_stream_by')}), side-stream kernels "
                         f"{census.get('side_stream_kernels')}, own kernels {census.get('own_gpu_kernels')}"))
            lines.append(f"{side} l2: {rep.get('l2')}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Subject:
    """A target the dynamic layer runs on: a source tree copied per candidate (its `.git` left out),
    its op, the device, the cell's shape, dtype and input transforms (`--input`, as pairs).
    minifla on the CPU by default; `fla_subject()` on a GPU."""
    root: Path = MINIFLA
    op: str = OP
    device: str = "cpu"
    shape: tuple = tuple(SHAPE.items())
    dtype: str = "float32"
    inputs: tuple = ()


MINI = Subject()
FLA_ROOT = Path(__file__).resolve().parents[2] / ".fla"


# FLA's registry draws q and k from randn; the delta rules need unit-norm keys (their tests normalize
# them), else the state grows without bound and the base gives non-finite values
FLA_INPUTS = (("q", "l2norm"), ("k", "l2norm"))


def fla_subject(op: str = "chunk_delta_rule") -> Subject:
    """Real FLA at the repo's `.fla/` on the GPU, at a shape of FLA's own registry, in bf16 (the
    registry's dtype: FLA's delta rules refuse fp32) with unit-norm q and k."""
    return Subject(FLA_ROOT, op, "cuda", (("B", 4), ("T", 1024), ("H", 8), ("D", 64)), "bfloat16", FLA_INPUTS)


def _tree(name: str, edits: list[tuple], subject: Subject = MINI) -> Path:
    root = _scratch() / "trees" / f"{subject.op}-{subject.device}" / name
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(subject.root, root, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".pytest_cache"))
    apply(root, edits)
    return root


def _base(subject: Subject = MINI):
    """The base's worker and its reports, once per test process and subject."""
    from support.worker import Driver

    key = ("base", subject)
    with _lock:
        if key not in _shared:
            w = Driver(_tree("base", [], subject), subject.op, "base", device=subject.device, forked=True)
            atexit.register(w.close)
            hello = w.ok("hello")
            setup = w.ok("setup", cell=_cell("c", dict(subject.shape), subject))
            bad = {n: c for n, c in (setup.get("nonfinite") or {}).items() if c}
            assert not bad, f"the base gives non-finite values on {subject}: {bad} (an input transform missing?)"
            probes = w.ok("probe", cell="c")["probes"]
            dumps = _scratch() / "dumps" / f"{subject.op}-{subject.device}"
            w.ok("dump", cell="c", path=str(dumps / "base.pt"))
            w.ok("dump", cell="c", mutated=True, path=str(dumps / "base-mutated.pt"))
            _shared[key] = (w, hello, probes, dumps)
        return _shared[key]


def base_times_ms(subject: Subject = MINI) -> list[float]:
    """The base's timed samples of the cell, per call (taken once per process and subject)."""
    key = ("base-times", subject)
    w = _base(subject)[0]
    with _lock:
        if key not in _shared:
            _shared[key] = list(w.ok("sample", cell="c", n=SAMPLES).get("times_ms") or [])
        return _shared[key]


def probed(name: str, edits: list[tuple], unseen: bool = False, samples: int = SAMPLES,
           subject: Subject = MINI) -> Probed:
    """Run the bench's dynamic checks of one cell of `subject` with `edits` planted (see the module)."""
    from support.worker import Driver

    from flaloop.guard import dynamic

    base, base_hello, base_probes, dumps = _base(subject)
    w = Driver(_tree(name, edits, subject), subject.op, "cand", device=subject.device, forked=True)
    out = Probed()
    seen: list[str] = []  # the timing-integrity violations: they ride on every reply (sticky)
    try:
        def ask(cmd: str, **kw) -> dict | None:
            r = w.req(cmd, **kw)
            seen.extend(v for v in r.get("integrity") or [] if v not in seen)
            if not r.get("ok"):
                out.error = f"{cmd}: {r.get('error')}"
                return None
            return r

        # a violation the base's hello shows too is the libraries' (torch._dynamo replaces
        # torch.manual_seed on import), not the candidate's: only one of its own stops the checks
        base_seen = base_hello.get("integrity") or []
        if ask("hello") is None or any(v not in base_seen for v in seen):
            return out
        if ask("setup", cell=_cell("c", dict(subject.shape), subject, reference=True)) is None:
            return out
        def judged(mutated: bool) -> dict | None:
            """The candidate dumps; the base judges (warmup.exchange): nothing of the base's in its process."""
            path = dumps / f"{name}{'-mutated' if mutated else ''}.pt"
            if ask("dump", cell="c", path=str(path), mutated=mutated) is None:
                return None
            with _lock:  # the base's own results were dumped once at its setup: the same call, not repeated
                return base.ok("compare", cell="c", subject=str(path), tol=DIFF_TOL, mutated=mutated,
                               ref=str(dumps / f"base{'-mutated' if mutated else ''}.pt"))

        out.diff = judged(False)
        if out.diff is None:
            return out
        if not out.diff.get("match"):
            out.findings.append(dynamic.finding("differs-from-base", f"{out.diff.get('tensors')}", "c"))
            return out
        narrowed = dynamic.precision_finding("c", "float32", out.diff)
        cand = ask("probe", cell="c")
        mutated = judged(True)
        if cand is None or mutated is None:
            return out
        out.findings += [narrowed] if narrowed else []
        out.probes = {"base": base_probes, "cand": cand["probes"]}
        out.findings += dynamic.cell_findings("c", base_probes, cand["probes"], mutated, DIFF_TOL)
        if out.blocking:
            return out
        timed = ask("sample", cell="c", n=samples) if samples else None
        if timed is not None:
            out.times_ms = list(timed.get("times_ms") or [])
            out.selfcheck = ask("selfcheck", cell="c", tol=DIFF_TOL)
            changed = [n for n, c in ((out.selfcheck or {}).get("checks") or {}).items() if c.get("match") is False]
            if changed:
                out.findings.append(dynamic.self_check_finding("c", 1, changed, out.selfcheck["checks"]))
        if unseen and not out.blocking:
            out.unseen = _unseen(base, ask, name, dumps)
            if out.unseen is not None and not out.unseen.get("match"):
                out.findings.append(dynamic.finding("unseen-shape-differs", f"{UNSEEN}: {out.unseen.get('tensors')}"))
            narrowed = dynamic.precision_finding("unseen", "float32", out.unseen or {})
            out.findings += [narrowed] if narrowed else []
        return out
    finally:
        out.findings += dynamic.integrity(base_hello.get("integrity") or [], seen)
        w.close()


HOST_PAIRS = 12       # pairs of the round-trip check (guard/timing.timer_host_gap): ABBA blocks
SETTLE = 3           # unpaired samples of the fresh candidate before its pairs (the session's settle pair)
HOST_SAMPLE_MS = 20.0  # its cell's sample: long enough that a hidden share of it stands out of the pipe's jitter


@dataclass
class HostTimed:
    """The round-trip check's pairs on one planted candidate, what it found, and what the integrity
    watch saw meanwhile (kept apart, so that a test can show the check stands without it)."""
    pairs: list = field(default_factory=list)
    finding: object = None
    integrity: list = field(default_factory=list)


def host_timed(name: str, edits: list[tuple], pairs: int = HOST_PAIRS, subject: Subject = MINI) -> HostTimed:
    """Paired samples as `bench/sampling.pair` takes them: a cell of `HOST_SAMPLE_MS` set up on both
    sides with the base's k, then `pairs` pairs in ABBA order, each side's `sample` request timed
    around its round trip on this process's monotonic clock (the orchestrator's, out of the
    candidate's reach), judged by `guard.timing.timer_host_gap`. The integrity watch's violations
    are returned, not judged."""
    import time

    from support.worker import Driver

    from flaloop.bench.model import Pair
    from flaloop.guard import timing

    base = _base(subject)[0]
    cell = _cell("h", dict(subject.shape), sample_ms=HOST_SAMPLE_MS)
    with _lock:
        if ("host-k", subject) not in _shared:
            _shared["host-k", subject] = base.ok("setup", cell=cell)["k"]
        k = _shared["host-k", subject]
    w = Driver(_tree(name, edits, subject), subject.op, "cand", device=subject.device, forked=True)
    out = HostTimed()
    try:
        hello = w.ok("hello")
        out.integrity = list(hello.get("integrity") or [])
        w.ok("setup", cell={**cell, "k": k})
        for _ in range(SETTLE):  # a fresh fork's first samples touch its pages: the base's are long touched
            w.ok("sample", cell="h", n=1)
        for i in range(pairs):
            got = {}
            for side in (("base", "cand") if i % 4 in (0, 3) else ("cand", "base")):
                drv = base if side == "base" else w
                t0 = time.monotonic()
                with _lock if side == "base" else contextlib.nullcontext():
                    r = drv.ok("sample", cell="h", n=1)
                got[side] = ((time.monotonic() - t0) * 1e3, r["times_ms"][0], r["k"])
                out.integrity += [v for v in r.get("integrity") or [] if side == "cand" and v not in out.integrity]
            (rb, tb, kb), (rc, tc, kc) = got["base"], got["cand"]
            out.pairs.append(Pair("AB" if i % 4 in (0, 3) else "BA", tb, tc, None, None, round=0, foreign=None,
                                  base_rtt_ms=rb, cand_rtt_ms=rc, base_reported_ms=tb * kb, cand_reported_ms=tc * kc))
        out.finding = timing.timer_host_gap("h", out.pairs)
        return out
    finally:
        w.close()


def _unseen(base, ask, name: str, dumps: Path) -> dict | None:
    """The warm-up's unseen-shape check (warmup.check_unseen): both sides set the shape up with
    inputs only, dump one call each, and the base compares the candidate's dump with its own."""
    with _lock:
        if ("unseen", dumps) not in _shared:  # the dumps' directory is the subject's
            base.ok("setup", cell=_cell("u", UNSEEN, check_only=True, timer="eager"))
            base.ok("dump", cell="u", path=str(dumps / "base-unseen.pt"))
            _shared["unseen", dumps] = True
    if ask("setup", cell=_cell("u", UNSEEN, check_only=True, timer="eager")) is None:
        return None
    if ask("dump", cell="u", path=str(dumps / f"{name}-unseen.pt")) is None:
        return None
    with _lock:
        return base.ok("compare", cell="u", ref=str(dumps / "base-unseen.pt"), subject=str(dumps / f"{name}-unseen.pt"),
                       tol=DIFF_TOL)


# -- assertions the class modules share ---------------------------------------------------------------

def assert_static(edits: list[tuple], rule: str) -> None:
    """The static audit blocks `edits` by `rule`."""
    found = audit_findings(edits)
    assert rule in {f.rule for f in found if f.blocking}, [f"{f.severity} {f.rule} {f.where}" for f in found]


def assert_static_misses(edits: list[tuple]) -> None:
    """No static rule blocks `edits`: the disguise is one the audit does not read, and a later layer
    must stop it."""
    found = [f for f in audit_findings(edits) if f.blocking]
    assert not found, [f"{f.rule} {f.where}: {f.message}" for f in found]


def assert_probed(name: str, edits: list[tuple], rule: str, unseen: bool = False,
                  subject: Subject = MINI) -> Probed:
    """The bench's dynamic layer blocks the planted candidate by `rule`."""
    r = probed(name, edits, unseen=unseen, subject=subject)
    assert rule in r.blocking, r.show()
    return r


def assert_honest(name: str, edits: list[tuple], unseen: bool = False) -> None:
    """An honest change: no blocking static finding, and the dynamic layer passes it."""
    assert_static_misses(edits)
    r = probed(name, edits, unseen=unseen)
    assert r.error is None and not r.blocking, r.show()
    assert r.diff and r.diff.get("match") and r.selfcheck and r.selfcheck.get("match"), r.show()
