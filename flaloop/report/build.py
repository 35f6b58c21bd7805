"""`flaloop report OP`: the final claim, from stored records only (nothing is measured here).

Inputs, all under `profile/<op>-opt/`: bench run records (`runs/*/record.json`), the gate's
`gate/last.json`, the loop's iteration records (`iters/NNNN.json`, absent before a loop), the
profiler's `trace/*/profile.json`, the explanation of the kept win (`explain/*/explain.json`), the
contract, and the cached device ceilings.

Which record is the claim's:
- with a loop, the claim is the best kept iteration's commit (the newest `keep`); without a
  kept iteration the report is a no-go;
- without a loop, the claim is the current tree state (HEAD + hash of the uncommitted diff);
- the record is the loop iteration's own (a no-go: the baseline's A/A), else the newest non-A/A
  bench record whose candidate is that commit (clean, or the dirty tree that was then committed as
  it), with a full green gate of the same tree state; a loop never claims a `bench --cand-env`
  record (the same code in another environment answers the backend question, not the loop's).

It refuses (exit 1, each reason named) to claim a win on a `-k` gate, a red or missing gate, a
blocking guard finding, blocked cells, an `unexplained-speedup`, or records of other commits than
the claim's. Rendering
is in report/markdown.py (markdown) and report/plots.py (PNG).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

from flaloop.bench import evidence, roofline
from flaloop.bench import record as record_mod
from flaloop.bench.evidence import contention_line
from flaloop.bench.model import cli_args
from flaloop.bench.record import RunRecord
from flaloop.core import clock, git
from flaloop.core.errors import UsageError
from flaloop.core.workspace import RECORD_FILE, Workspace
from flaloop.diagnose import explain
from flaloop.diagnose.sanitizer import flow as sanitize_mod
from flaloop.modelcheck import run as modelcheck
from flaloop.report import fmt
from flaloop.report.cells import CellView
from flaloop.task import contract as contract_mod

WIN = ("improvement", "trade-off")
STATE_KEYS = ("head", "dirty", "diff_hash")


@dataclass(frozen=True)
class Refusal:
    reason: str   # gate_signal_only | gate_red | gate_missing | guard_blocked | correctness_blocked | commit_mismatch
    message: str
    hint: str

    def to_dict(self) -> dict:
        return asdict(self)


# -- reading the workspace ----------------------------------------------------------------------

def _read_json(p: Path) -> dict | None:
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_records(ws: Workspace) -> list[RunRecord]:
    """Bench run records, oldest first (their directory names start with the UTC stamp); a record
    that cannot be read (cut short, another flaloop's schema) is left out."""
    out = []
    for p in ws.run_records():
        try:
            r = record_mod.read(p)
        except UsageError:
            continue
        if r.kind == "bench":
            r.path = str(p)
            out.append(r)
    return out


def load_iterations(ws: Workspace) -> list[dict]:
    """The loop's iteration records, by iteration number; [] when no loop ran."""
    its = [d for d in (_read_json(p) for p in ws.iteration_files()) if d]
    return sorted(its, key=lambda d: int(d.get("iter", 0)))


def load_profiles(ws: Workspace) -> list[dict]:
    out = []
    for p in ws.profile_docs():
        d = _read_json(p)
        if d:
            d["_path"] = str(p)
            out.append(d)
    return out


def same_state(a: dict | None, b: dict | None) -> bool:
    return bool(a) and bool(b) and all(a.get(k) == b.get(k) for k in STATE_KEYS)


def _git_out(root: Path, *args: str) -> bytes | None:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"})
    return proc.stdout if proc.returncode == 0 else None


def commit_states(root: Path, commit: str) -> list[dict]:
    """Tree states (as git.tree_state writes them) that are this commit: the clean checkout,
    and the dirty tree over its parent that was committed as it (new files tracked or not)."""
    states = [{"head": commit, "dirty": False, "diff_hash": None}]
    parent = (_git_out(root, "rev-parse", "--verify", "--quiet", f"{commit}^") or b"").decode().strip()
    if not parent:
        return states
    full = _git_out(root, "diff", "--binary", parent, commit)
    if full is None:
        return states
    digests = [hashlib.sha256(full).hexdigest()[:12]]
    added = (_git_out(root, "diff", "--name-only", "--diff-filter=A", parent, commit) or b"").decode().split()
    if added:  # new files that were untracked when the bench ran: hashed by name and content
        h = hashlib.sha256(_git_out(root, "diff", "--binary", "--diff-filter=a", parent, commit) or b"")
        for rel in sorted(added):
            h.update(rel.encode())
            h.update(_git_out(root, "show", f"{commit}:{rel}") or b"")
        digests.append(h.hexdigest()[:12])
    states += [{"head": parent, "dirty": True, "diff_hash": d} for d in digests]
    return states


def describe_state(s: dict | None) -> str:
    if not s:
        return "?"
    return fmt.tree_state(s.get("head"), s.get("dirty"), s.get("diff_hash"))


# -- the claim ------------------------------------------------------------------------------------

@dataclass
class Claim:
    source: str                 # "loop" or "tree"
    commit: str | None          # the claim's commit (loop) or HEAD of the tree
    states: list[dict]          # candidate tree states that are the claim
    iteration: dict | None = None
    no_go: bool = False         # a loop without a kept iteration
    tree: str | None = None     # the claim's code (a git tree id): a record of a commit with this tree is its record

    def to_dict(self) -> dict:
        it = self.iteration or {}
        return {"source": self.source, "commit": self.commit, "states": self.states, "no_go": self.no_go,
                "iteration": it.get("iter"), "direction": it.get("direction")}


def find_claim(root: Path, iterations: list[dict]) -> Claim:
    if iterations:
        kept = [it for it in iterations if it.get("status") == "keep" and it.get("commit")]
        if kept:
            best = kept[-1]
            return Claim("loop", best["commit"], commit_states(root, best["commit"]), best,
                         tree=_commit_tree(root, best["commit"]))
        base = next((it for it in iterations if it.get("status") == "baseline"), iterations[0])
        commit = base.get("commit")
        return Claim("loop", commit, commit_states(root, commit) if commit else [], base, no_go=True,
                     tree=_commit_tree(root, commit) if commit else None)
    state = git.tree_state(root)
    return Claim("tree", state["head"], [state], tree=None if state["dirty"] else _commit_tree(root, state["head"]))


def _commit_tree(root: Path, commit: str) -> str | None:
    return (_git_out(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{tree}}") or b"").decode().strip() or None


def _candidate_state(record: RunRecord) -> dict:
    c = record.candidate
    return {"head": c.head or c.commit, "dirty": c.dirty, "diff_hash": c.diff_hash}


def pick_record(claim: Claim, records: list[RunRecord]) -> tuple[RunRecord | None, list[Refusal]]:
    """The claim's loop iteration's own record, else the newest non-A/A record of the claim's tree
    state; for a no-go, the baseline's own A/A, else the newest record of the baseline, A/A allowed.
    A loop claims code: a record whose candidate ran in another environment (`bench --cand-env`, a
    backend switched on the same tree) answered another question and is not the loop's. Among
    several, an interrupted record, or one with a cell left unmeasured, stands only where no
    complete one does (`newest`)."""
    def matches(r: RunRecord) -> bool:
        if claim.source == "loop" and r.config.cand_env:
            return False
        return any(same_state(_candidate_state(r), s) for s in claim.states) or bool(
            claim.tree and r.candidate.tree == claim.tree)

    it = claim.iteration or {}
    ref = ((it.get("vs_base") or {}).get("record") or (it.get("vs_best") or {}).get("record")
           or (it.get("baseline") or {}).get("record"))
    # a no-go stands on the baseline's A/A; any other claim on a record of its code that is not an A/A
    own = [r for r in records if ref and _same_path(r.path, ref)
           and ((claim.no_go and r.aa) or (not r.aa and matches(r)))]
    if own:
        return own[-1], []
    if claim.no_go:
        mine = [r for r in records if matches(r) or (r.aa and not r.config.cand_env and r.base.commit == claim.commit)]
        return newest(mine), []
    mine = [r for r in records if not r.aa and matches(r)]
    if mine:
        return newest(mine), []
    others = [r for r in records if not r.aa]
    if not others:
        raise UsageError(f"no bench record under {claim.source == 'loop' and 'the loop' or 'profile/'}: nothing to report",
                         "run `flaloop verify OP` (gate, then the paired bench) first")
    newest_other = newest(others)
    want = describe_state(claim.states[0]) if claim.states else "?"
    return newest_other, [Refusal(
        "commit_mismatch",
        f"no bench record of the claim's tree state {want} ({claim.source}); the newest record "
        f"({Path(newest_other.path).parent.name}) measured {describe_state(_candidate_state(newest_other))}",
        "bench the state you claim: `flaloop verify OP` on that tree (or commit what you measured)")]


def completeness(r: RunRecord) -> int:
    """2: every cell measured, nothing interrupted; 1: some cell measured; 0: an interrupted run or
    one that measured nothing."""
    if r.interrupted or not r.measured:
        return 0
    return 2 if len(r.measured) == len(r.cells) else 1


def newest(records: list[RunRecord]) -> RunRecord | None:
    """The newest of the most complete records (records come oldest first)."""
    if not records:
        return None
    best = max(completeness(r) for r in records)
    return [r for r in records if completeness(r) == best][-1]


def skipped_newer(records: list[RunRecord], chosen: RunRecord) -> list[str]:
    """The records newer than the one a report stands on that it passed over for being less complete."""
    later = records[next((i for i, r in enumerate(records) if r is chosen), len(records)) + 1:]
    return [r.path for r in later if completeness(r) < completeness(chosen)]


def _same_path(record_path: str, ref: str) -> bool:
    """Whether an iteration's `record` (`runs/<run>/record.json` or the run's directory, relative to
    the workspace or absolute) names this record: the run directories' names are unique in a
    workspace, and the comparison holds where the workspace was moved since (copied off a GPU machine)."""
    run = Path(ref).parent.name if Path(ref).name == RECORD_FILE else Path(ref).name
    return Path(record_path).parent.name == run


def gate_evidence(record: RunRecord, claim: Claim, last_gate: dict | None) -> tuple[dict | None, list[Refusal]]:
    """The full green gate of the record's tree state, or the refusal that names why not.

    The newest evidence decides: `gate/last.json` when it was taken of the same tree state (a gate
    that went red after the bench withdraws the claim), then the gate verify ran with this bench,
    the last gate the bench found for its tree state, and the claimed iteration's gate."""
    state = _candidate_state(record)
    found: list[tuple[str, dict]] = []
    if last_gate and same_state(last_gate.get("tree"), state):
        found.append(("gate/last.json", last_gate))
    if record.gate:
        found.append(("the gate run with this bench (verify, baseline or iter)", record.gate))
    if record.last_gate:  # the gate of this exact tree state that `flaloop bench` found
        found.append(("bench record (last gate of this tree state)", record.last_gate))
    it = claim.iteration
    if it and it.get("gate") and any(same_state(state, s) for s in claim.states):
        found.append((f"iteration {it.get('iter')}", it["gate"]))
    if not found:
        return None, [Refusal("gate_missing", f"no gate ran on the measured tree state {describe_state(state)}",
                              "run `flaloop gate OP` on this tree, or `flaloop verify OP` (gate, then bench)")]
    source, g = found[0]
    if g.get("signal_only") or g.get("k_expr"):
        return {"source": source, **_gate_summary(g)}, [Refusal(
            "gate_signal_only", f"the newest gate of this tree state ran a -k subset ({g.get('k_expr')!r}): a "
            "signal, not a promotion gate", "run the full file: `flaloop gate OP` (no -k)")]
    if not g.get("green"):
        return {"source": source, **_gate_summary(g)}, [Refusal(
            "gate_red", f"the gate of this tree state is red ({source})", "fix correctness first: `flaloop gate OP`")]
    return {"source": source, **_gate_summary(g)}, []


def _gate_summary(g: dict) -> dict:
    return {"green": bool(g.get("green")), "signal_only": bool(g.get("signal_only") or g.get("k_expr")),
            "k_expr": g.get("k_expr"), "counts": g.get("counts"), "test_file": g.get("test_file"),
            "started": g.get("started"), "log_path": g.get("log_path"),
            "findings": [f.get("message") if isinstance(f, dict) else str(f) for f in g.get("findings") or []]}


def guard_evidence(record: RunRecord, claim: Claim, contract: dict) -> tuple[dict, list[Refusal]]:
    findings, blocked = [], False
    for source, g in (("bench record", record.guard.to_dict()), ("iteration", (claim.iteration or {}).get("guard"))):
        if g:
            blocked = blocked or bool(g.get("blocked"))
            findings += [{**f, "source": source} for f in g.get("findings") or []]
    out = {"ran": True, "blocked": blocked,
           "findings": findings, "allowed": contract.get("allowed") or []}
    refusals = []
    blocking = [f for f in findings if f.get("blocking") or (f.get("severity") == "block" and not f.get("allowed"))]
    if blocked or blocking:
        names = ", ".join(sorted({f.get("rule", "?") for f in blocking})) or "see the record"
        refusals.append(Refusal("guard_blocked", f"the guard blocked this candidate ({names})",
                                "fix what the finding names, or record a justified exception in the contract"))
    return out, refusals


# -- per-cell evidence ----------------------------------------------------------------------------

def cell_rows(record: RunRecord, ceilings: roofline.Ceilings | None, family: roofline.Family | None) -> list[dict]:
    """The report's row of each cell (report/cells.CellView's dict), with its roofline reading."""
    if record.roofline is None:  # a record finished without a roofline: arithmetic on its stored numbers
        scratch = RunRecord.from_dict(record.to_dict())
        roofline.annotate(scratch, ceilings, family)
        roofs = [c.roofline for c in scratch.cells]
    else:
        roofs = [c.roofline for c in record.cells]
    return [CellView.of(cell, roof).to_dict() for cell, roof in zip(record.cells, roofs, strict=True)]


def conclusion(geo: dict | None, rows: list[dict], claim: Claim, target: float | None) -> dict:
    if claim.no_go:
        return {"kind": "no-go", "text": "no-go: no iteration of the loop was kept"}
    if not geo:
        return {"kind": "no-go", "text": "no-go: no cell could be measured"}
    slower = [r["id"] for r in rows if r["verdict"] == "SLOWER"]
    g, lo, hi = geo["speedup"], geo["ci_low"], geo["ci_high"]
    if lo > 1.0 and not slower:
        kind, text = "improvement", f"improvement: {g:.3f}x geomean, 95% CI [{lo:.3f}, {hi:.3f}], no cell slower"
    elif lo > 1.0:
        kind, text = "trade-off", f"trade-off: {g:.3f}x geomean, but slower on {', '.join(slower)}"
    elif hi < 1.0:
        kind, text = "regression", f"regression: {g:.3f}x geomean, 95% CI [{lo:.3f}, {hi:.3f}]"
    else:
        kind, text = "neutral", f"neutral: {g:.3f}x geomean, 95% CI [{lo:.3f}, {hi:.3f}] includes 1"
    if target and kind in WIN:
        text += f"; target {target:g}x {'met' if g >= target else 'not met'}"
    return {"kind": kind, "text": text}


def risks(rows: list[dict], record: RunRecord, env: dict, aa: dict | None, profiled: bool,
          refusals: list[Refusal]) -> list[str]:
    """The evidence gaps of a report (`profiled`: a profile or an explanation of this tree state)."""
    out = [f"{r.reason}: {r.message}" for r in refusals]
    lb = [r["id"] for r in rows if r["launch_bound"]]
    if lb:
        out.append(f"launch-bound cells (host time > device time; eager latency is what a user sees): {', '.join(lb)}")
    unsure = [r["id"] for r in rows if r["verdict"] == "UNSURE"]
    if unsure:
        out.append(f"cells without a verdict (UNSURE): {', '.join(unsure)}")
    split = [r["id"] for r in rows if r["rounds_disagree"]]
    if split:
        out.append(f"rounds disagreed beyond their CIs on {', '.join(split)} (a per-process effect)")
    above = [r["id"] for r in rows if (r["roofline"] or {}).get("above_100")]
    if above:
        out.append(f"IMPLAUSIBLE: above 100% of the roofline floor on {', '.join(above)}: suspect a skipped path")
    bad = [r["id"] for r in rows if r["status"] not in ("ok",)]
    if bad:
        out.append(f"cells not measured: {', '.join(bad)}")
    if env.get("device") == "cpu":
        out.append("measured on the CPU: no GPU evidence")
    idle = env.get("idle") or {}
    if idle.get("available") and idle.get("idle") is False:
        out.append("GPU not idle before measuring: " + "; ".join(idle.get("not_idle_because") or []))
    shared = contention_line(env.get("contention"))
    if shared:
        out.append(shared)
    if aa is None:
        out.append("no A/A self-check of this base in the records (`flaloop bench OP --aa`)")
    if not profiled:
        out.append("no profiler reading of this tree state (`flaloop profile OP` or `flaloop explain OP`)")
    if not [r for r in rows if r["varlen"]]:
        out.append("no varlen (cu_seqlens) cells measured (`--varlen`)")
    return out


def trajectory(iterations: list[dict]) -> list[dict]:
    rows = []
    for it in iterations:
        vb = it.get("vs_base") or {}
        geo = vb.get("geomean") or {}
        rows.append({"iter": it.get("iter"), "status": it.get("status"), "direction": it.get("direction"),
                     "commit": it.get("commit"), "speedup": geo.get("speedup"), "ci_low": geo.get("ci_low"),
                     "ci_high": geo.get("ci_high"), "verdict": vb.get("verdict"),
                     "worst_cell": it.get("worst_cell"), "gate_green": (it.get("gate") or {}).get("green"),
                     "note": it.get("note") or ""})
    return rows


def _newest_aa(records: list[RunRecord], base_commit: str) -> dict | None:
    aas = [r for r in records if r.aa and r.base.commit == base_commit]
    if not aas:
        return None
    r = aas[-1]
    return {"record": r.path, "created": r.created,
            "geomean": asdict(r.summary.geomean) if r.summary.geomean else None, "command": r.command}


def _tree_of(root: Path, state: dict) -> str | None:
    """The git tree (the code, not the commit) of a clean tree state."""
    if not state.get("head") or state.get("dirty"):
        return None
    return (_git_out(root, "rev-parse", "--verify", "--quiet", f"{state['head']}^{{tree}}") or b"").decode().strip() or None


def _profile_for(root: Path, profiles: list[dict], state: dict) -> dict | None:
    """The newest profile of a record's candidate tree state; else of the same code at another commit
    (a loop's reverts leave HEAD on a new commit whose tree is the base's)."""
    mine = [p for p in profiles if same_state((p.get("candidate") or {}), state)]
    if not mine and (code := _tree_of(root, state)):
        mine = [p for p in profiles if _tree_of(root, p.get("candidate") or {}) == code]
    return mine[-1] if mine else None


def _explanation_for(ws: Workspace, claim: Claim, iterations: list[dict]) -> dict | None:
    """The newest explanation of the claim's kept iteration against its vs-base measurement."""
    it = claim.iteration or {}
    vs = it.get("vs_base") or {}
    if claim.no_go or not claim.commit or not vs.get("base_commit"):
        return None
    return explain.latest(ws, vs["base_commit"], claim.commit, vs.get("record"))


def _sanitizer_for(ws: Workspace, claim: Claim, cells: list[str], contract: dict) -> dict | None:
    """The newest compute-sanitizer run of the claim's kept commit against its base (the contract's,
    as `sanitize` and the go take it): one that ran every tool on every measured cell (what a go
    needs) when there is one, else the newest at all."""
    base = ((claim.iteration or {}).get("vs_base") or {}).get("base_commit") or contract.get("base_commit")
    if claim.no_go or not claim.commit or not base:
        return None
    return sanitize_mod.latest(ws, base, claim.commit, cells) or sanitize_mod.latest(ws, base, claim.commit, [], ())


def _model_for(ws: Workspace, claim: Claim, contract: dict) -> dict | None:
    """The newest model check (`flaloop model`) of the claim's kept commit against its base."""
    base = ((claim.iteration or {}).get("vs_base") or {}).get("base_commit") or contract.get("base_commit")
    if claim.no_go or not claim.commit or not base:
        return None
    rec = modelcheck.latest(ws, base, claim.commit)
    return modelcheck.summary(rec) if rec else None


# options of a recorded command line that name the measuring machine's paths or ask for the
# machine-readable output: a reader runs the command in their own checkout, without them
MACHINE_OPTIONS = {"--repo": True, "--python": True, "--json": False}  # name: takes a value


def portable_command(cmd: str) -> str:
    """A recorded command line as a reader runs it in their own checkout (MACHINE_OPTIONS dropped),
    quoted for a shell; the text itself when it does not parse."""
    try:
        argv = shlex.split(cmd)
    except ValueError:
        return cmd
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = a.partition("=")
        if name in MACHINE_OPTIONS:
            skip = MACHINE_OPTIONS[name] and not eq
            continue
        out.append(a)
    return shlex.join(out)


def reproduce_commands(op: str, record: RunRecord, contract: dict, claim: Claim) -> dict:
    """The commands that measure the claim again, each quoted for a shell: the gate, `verify` with
    the record's own options against its base (never `iter`, which would commit), the A/A, the
    profile and this report; run in a checkout of `commit` (the claim's, or the measured snapshot's)."""
    ns = SimpleNamespace(**{k: contract.get(k) for k in ("modes", "varlen", "input_overrides")})
    shapes = list(dict.fromkeys(c.cell.shape_name for c in record.cells if not c.cell.varlen))
    pick = [] if shapes == list(contract.get("shapes") or []) else [x for sh in shapes for x in ("--shapes", sh)]
    args = ["--base", record.base.commit, *pick, *cli_args(record.config, ns)]
    commit = claim.commit if claim.tree and claim.tree == record.candidate.tree else record.candidate.commit
    return {"commit": commit, "commands": [
        shlex.join(["flaloop", "gate", op]),
        shlex.join(["flaloop", "verify", op, *args]),
        shlex.join(["flaloop", "bench", op, "--aa", *args]),
        shlex.join(["flaloop", "profile", op]),
        shlex.join(["flaloop", "report", op])]}


# -- the whole report -----------------------------------------------------------------------------

def build(target, op: str, family: roofline.Family | None = None, ceilings: roofline.Ceilings | None = None) -> dict:
    """Assemble the report's data from the workspace. Raises UsageError when there is nothing
    to report; refusals are in `doc["refused"]` (the CLI exits 1 when `claim_ok` is False)."""
    ws = target.workspace(op)
    contract = _read_json(ws.contract)
    if contract is None:
        raise contract_mod.no_contract(target, op)
    records, iterations = load_records(ws), load_iterations(ws)
    claim = find_claim(target.root, iterations)
    record, refusals = pick_record(claim, records)
    if record is None:
        raise UsageError(f"no bench record of the baseline {str(claim.commit)[:12]} to report",
                         "run `flaloop bench OP` on the baseline")
    env = dict(record.env or {})
    if ceilings is None:
        ceilings = roofline.load_ceilings(env.get("device_uuid"))
    rows = cell_rows(record, ceilings, family)
    summary = record.summary
    geo = asdict(summary.geomean) if summary.geomean else None
    last_gate = _read_json(ws.gate_last)
    gate, gate_refusals = gate_evidence(record, claim, last_gate)
    guard, guard_refusals = guard_evidence(record, claim, contract)
    refusals += gate_refusals + guard_refusals
    if summary.n_blocked:
        blocked = [r["id"] for r in rows if r["status"] == "blocked"]
        refusals.append(Refusal("correctness_blocked", f"base and candidate differ on {', '.join(blocked)}",
                                "the candidate computes something else on the bench inputs: fix it"))
    if record.aa and not claim.no_go:  # a no-go stands on the baseline's A/A by design
        refusals.append(Refusal("commit_mismatch", "the only record of this state is an A/A self-check",
                                "bench the candidate: `flaloop verify OP`"))
    env.setdefault("during", evidence.during_evidence(evidence.readings_of(record)))
    env.setdefault("idle", {"available": False, "reason": env.get("nvml") or "not recorded by this bench"})
    aa = _newest_aa(records, record.base.commit)
    profile = _profile_for(target.root, load_profiles(ws), _candidate_state(record))
    explanation = _explanation_for(ws, claim, iterations)
    if explanation and explanation.get("blocked"):
        refusals.append(Refusal("unexplained_speedup", "; ".join(f["message"] for f in explanation["findings"]),
                                "the kernels do not account for the measured win: `flaloop explain OP` shows where"))
    sanitized = _sanitizer_for(ws, claim, [r["id"] for r in rows], contract)
    for reason, message in sanitize_mod.go_missing(sanitized) if sanitized and sanitized.get("blocked") else []:
        refusals.append(Refusal(reason, message, "compute-sanitizer sees an error only the candidate has: "
                                                 "`flaloop sanitize OP --commit C` shows it"))
    in_model = _model_for(ws, claim, contract)
    if in_model and in_model.get("blocked"):
        refusals.append(Refusal("model_trajectory", "; ".join(f["message"] for f in in_model["findings"] if f.get("blocking")),
                                "inside the model the change moves training past the op's tolerance: "
                                "`flaloop model OP` shows where"))
    concl = conclusion(geo, rows, claim, contract.get("target_speedup"))
    reproduce = reproduce_commands(op, record, contract, claim)
    claim_ok = not (refusals and concl["kind"] in WIN)
    verdicts = [r["verdict"] for r in rows]
    doc = {
        "ok": claim_ok, "op": op, "kind": "report", "repo": str(target.root),
        "created": clock.now_iso(),
        "claim": claim.to_dict(), "claim_ok": claim_ok, "conclusion": concl,
        "refused": [r.to_dict() for r in refusals] if not claim_ok else [],
        "summary": {"geomean": geo, "n_cells": summary.n_cells, "n_measured": summary.n_measured,
                    **{f"n_{v.lower()}": verdicts.count(v) for v in ("FASTER", "SLOWER", "SAME", "UNSURE")},
                    "target_speedup": contract.get("target_speedup"),
                    "target_met": bool(geo and contract.get("target_speedup")
                                       and geo["speedup"] >= contract["target_speedup"])},
        "test_plan": {"gate": gate, "test_file": contract.get("test_file"),
                      "command": f"flaloop gate {op}", "frozen": [f.get("path") for f in contract.get("frozen") or []]},
        "cells": rows,
        "coverage": {"dense": [r["id"] for r in rows if not r["varlen"]], "varlen": [r["id"] for r in rows if r["varlen"]],
                     "modes": sorted({r["mode"] for r in rows if r["mode"]}),
                     "l2": sorted({r["l2"] for r in rows}),
                     "shapes": sorted({r["shape_name"] for r in rows if r["shape_name"]})},
        "reproduce": reproduce,
        "commands": {"bench": portable_command(record.command or ""), "gate": f"flaloop gate {op}",
                     "aa": portable_command(aa["command"]) if aa else f"flaloop bench {op} --aa",
                     "sanitize": shlex.join(["flaloop", "sanitize", op, "--commit", claim.commit[:12]])
                     if claim.commit and not claim.no_go else f"flaloop sanitize {op}",
                     "profile": portable_command((profile or {}).get("command") or "") or f"flaloop profile {op}",
                     "explain": f"flaloop explain {op}", "report": f"flaloop report {op}"},
        "commits": {"base_ref": record.base.ref, "base_commit": record.base.commit,
                    "candidate": _candidate_state(record), "claim_commit": claim.commit},
        "environment": env, "aa": aa, "roofline": {"family": family.name if family else None,
                                                   "title": family.title if family else None,
                                                   "ceilings": ceilings.to_dict() if ceilings else None},
        "profile": profile, "explanation": explanation, "sanitizer": sanitized, "guard": guard, "model": in_model,
        "trajectory": trajectory(iterations), "opt_log": str(ws.opt_log) if ws.opt_log.exists() else None,
        "records": {"claim": record.path, "claim_complete": ("complete", "partial", "interrupted or empty")[
                        2 - completeness(record)], "skipped": skipped_newer(records, record),
                    "aa": aa["record"] if aa else None,
                    "profile": profile["_path"] if profile else None,
                    "explanation": explanation["_path"] if explanation else None,
                    "sanitizer": sanitized.get("path") if sanitized else None,
                    "model": in_model["path"] if in_model else None},
    }
    # a report that claims no win lists its evidence gaps as risks instead of refusing
    doc["risks"] = risks(rows, record, env, aa, bool(profile or explanation), refusals if claim_ok else [])
    if explanation is None and concl["kind"] in WIN:
        doc["risks"].append(f"no explanation of the win by its kernels (`flaloop explain {op}`)")
    if concl["kind"] in WIN:
        doc["risks"] += sanitizer_risks(sanitized, doc["commands"]["sanitize"])
        if in_model is None and modelcheck.named(SimpleNamespace(model=contract.get("model"))):
            doc["risks"].append(f"no model check of the kept commit (`flaloop model {op}`; `stop --go` runs the "
                                "contract's)")
    return doc


def sanitizer_risks(doc: dict | None, command: str) -> list[str]:
    """What a kept win's sanitizer evidence leaves open: no run, tools that could not run, cells not
    fully checked (a blocking finding is a refusal, not a risk)."""
    if doc is None:
        return [f"no compute-sanitizer run of the kept commit (`{command}`; `stop --go` runs one)"]
    out = []
    missing = [t for t in sanitize_mod.TOOLS if t not in (doc.get("tools") or {})]
    why: dict[str, list[str]] = {}
    for t, e in (doc.get("tools") or {}).items():
        if not e.get("available"):
            why.setdefault(str(e.get("reason")), []).append(t)
    off = [f"{', '.join(ts)} ({reason})" for reason, ts in why.items()]
    if missing:
        out.append(f"compute-sanitizer did not run {', '.join(missing)} on the kept commit (`{command}`)")
    if off:
        out.append("compute-sanitizer could not check: " + "; ".join(off))
    if doc.get("failed"):
        out.append("not every cell was fully checked by compute-sanitizer: " + "; ".join(doc["failed"]))
    return out
