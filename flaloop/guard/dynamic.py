"""Judging the dynamic probes: the workers report facts about each side (flaloop/inside/worker/
probes.py, integrity.py, the wall time beside each sample); these pure functions compare the
candidate with the base and return findings. A rule fires on what the candidate does and the
base does not, so behaviour the base already has (its own streams, its own nondeterminism) is
never held against the candidate. docs/GUARD.md has a section per probe id.
"""

from __future__ import annotations

import math

from flaloop.guard import catalogue
from flaloop.guard.findings import WARN, Finding
from flaloop.guard.timing import (  # noqa: F401  (the timing checks)
    below_floor,
    eager_disagrees,
    same_code_speedup,
    timer_wall_gap,
)


def finding(rule: str, message: str, cell: str | None = None, side: str | None = "cand",
            severity: str | None = None) -> Finding:
    """A probe finding: the rule's words come from guard/catalogue.py (PROBE_RULES)."""
    f = catalogue.finding(rule, message, severity=severity)
    return Finding(**{**f.__dict__, "cell": cell, "side": side})


def _by_func(snap: dict) -> dict[str, str]:
    """{function: the backend(s) that served it} of one operation's snapshot."""
    got: dict[str, list[str]] = {}
    for s in snap.get("served") or []:
        func, _, be = s.partition(" -> ")
        got.setdefault(func, []).append(be)
    return {f: ", ".join(sorted(v)) for f, v in got.items()}


def _switches(switches: dict, *names: str | None) -> set[str]:
    """The environment variables that switch the named backends ("a, b" lists several)."""
    return {switches[n] for name in names if name for n in name.split(", ") if switches.get(n)}


def backend_differences(base: dict, cand: dict) -> list[tuple[str, set[str]]]:
    """What served the calls differently on the two sides (snapshots taken at the same point): per
    operation and function a line ('op.func: base tilelang, candidate (its own code)') and the
    environment variables that switch the backends involved."""
    lines = []
    for op in sorted(set(base) | set(cand)):
        b, c = base.get(op) or {}, cand.get(op) or {}
        fb, fc = _by_func(b), _by_func(c)
        switches = {**(b.get("registered") or {}), **(c.get("registered") or {})}
        for func in sorted(set(fb) | set(fc)):
            if fb.get(func) != fc.get(func):
                lines.append((f"{op}.{func}: base {fb.get(func) or '(its own code)'}, "
                              f"candidate {fc.get(func) or '(its own code)'}",
                              _switches(switches, fb.get(func), fc.get(func))))
        rb, rc = sorted(b.get("registered") or {}), sorted(c.get("registered") or {})
        if rb != rc:
            lines.append((f"{op}: backends registered base {rb}, candidate {rc}",
                          _switches(switches, *(set(rb) ^ set(rc)))))
    return lines


def backend_keys(snapshot: dict | None, which: str = "served") -> list[str]:
    """"op.func -> backend" for every call a backend served (or, with which="rejected", whose verifier
    declined it) in a snapshot (inside/worker/backends.py)."""
    return sorted(f"{op}.{s}" for op, snap in (snapshot or {}).items() for s in snap.get(which) or [])


def backend_findings(cell: str, base: dict, cand: dict, cand_env: dict | None = None) -> list[Finding]:
    """What FLA's backend registries say served the calls differently on the two sides (snapshots
    after the same cell's setup, inside/worker/backends.py): blocking, unless the backends involved
    are switched by a variable that --cand-env sets (then a warning that names it)."""
    out = []
    for line, switches in backend_differences(base, cand):
        asked = sorted(switches & set(cand_env or {}))
        if asked:
            out.append(finding("backend-differs", f"{line} (expected: --cand-env {', '.join(asked)})", cell,
                               severity=WARN))
        else:
            out.append(finding("backend-differs", line, cell))
    return out


# -- integrity and timing (per run, per cell) ---------------------------------------------------------

def integrity(base: list[str], cand: list[str], aa: bool = False) -> list[Finding]:
    """Violations of the timing-path watch the candidate shows and the base does not."""
    if aa:
        return []
    extra = [v for v in cand if v not in set(base)]
    return [finding("timer-patched", v, cell=None) for v in extra]


def lean_import(lean: dict[str, dict], full: dict[str, dict]) -> list[Finding]:
    """`--import lean` against the real import of the same tree: the numeric settings each side's
    process had right after importing the op (hello's `numeric_at_import`) must not differ. A package
    __init__ the lean import skipped may set TF32, a matmul precision or TRITON_*/FLA_* variables:
    then the lean processes measured code under settings no user of the package gets."""
    out = []
    for side in sorted(set(lean) & set(full)):
        diffs = numeric_differences(full[side] or {}, lean[side] or {}, ("real import", "lean import"))
        if diffs:
            out.append(finding("lean-import-differs", f"{side}: " + "; ".join(diffs[:8]), cell=None, side=side))
    return out


def lean_kernels(side: str, cell: str, lean: dict | None, real: dict | None) -> list[Finding]:
    """The census of one call under the lean and the real import: the same Triton launches and GPU
    kernels, as many of each."""
    if lean is None or real is None:
        return []
    diffs = []
    for key, what in (("triton_launches", "Triton launches"), ("kernels", "GPU kernels")):
        a, b = real.get(key) or {}, lean.get(key) or {}
        if a != b:
            only_real = sorted(set(a) - set(b))[:4]
            only_lean = sorted(set(b) - set(a))[:4]
            counts = sorted(k for k in set(a) & set(b) if a[k] != b[k])[:4]
            diffs.append(f"{what} differ: only with the real import {only_real}, only lean {only_lean}, "
                         f"other counts {counts}")
    return [finding("lean-import-differs", f"{side}, {cell}: " + "; ".join(diffs), cell=cell, side=side)] if diffs else []


# -- the probes of one cell ---------------------------------------------------------------------------

def _err(cell: str, side: str, name: str, report: dict) -> Finding | None:
    e = (report or {}).get("error")
    return finding("probe-error", f"{name} probe failed on the {side}: {e}", cell, side) if e else None


def cell_findings(cell: str, base: dict, cand: dict, mutated: dict | None, diff_tol: float,
                  aa: bool = False, cand_env: dict | None = None) -> list[Finding]:
    """Findings from both sides' probe reports of one cell (and the candidate's comparison of its
    results on in-place-mutated inputs with the base's). `cand_env` (--cand-env): environment
    differences asked for, which the numeric-settings probe expects rather than reports."""
    out: list[Finding] = []
    for side, rep in (("base", base), ("cand", cand)):
        for name in ("outputs", "determinism", "poison", "census", "l2", "graph"):
            f = _err(cell, side, name, rep.get(name))
            if f:
                out.append(f)
    if aa:
        return out

    if mutated is not None and not mutated.get("match", True):
        worst = sorted((mutated.get("tensors") or {}).items(), key=lambda kv: -(kv[1].get("rel_rms") or 0))[:2]
        what = ", ".join(f"{n} rel-RMS {t.get('rel_rms')}" for n, t in worst)
        out.append(finding("inputs-mutated", f"after an in-place change of the inputs: {what}", cell))

    bo, co = base.get("outputs") or {}, cand.get("outputs") or {}
    if co.get("subclass"):
        out.append(finding("output-subclass", f"outputs {co['subclass']} are tensor subclasses", cell))
    new_alias = sorted(set(co.get("aliases_input") or []) - set(bo.get("aliases_input") or []))
    if new_alias:
        out.append(finding("output-aliases-input", f"outputs {new_alias} share storage with an input", cell))
    new_late = sorted(set(co.get("changed_after_sync") or []) - set(bo.get("changed_after_sync") or []))
    if new_late:
        out.append(finding("deferred-work", f"outputs {new_late} changed after the calling stream finished", cell))

    bd, cd = base.get("determinism") or {}, cand.get("determinism") or {}
    rel = cd.get("max_rel_diff")
    if rel is not None and not cd.get("bitwise", True):
        base_rel = bd.get("max_rel_diff") or 0.0
        if rel > diff_tol and rel > 4 * base_rel:
            out.append(finding("nondeterministic", f"two calls differ by rel-RMS {rel:.3g} (base {base_rel:.3g}, "
                               f"tolerance {diff_tol:g})", cell))
        elif bd.get("bitwise", False):
            out.append(finding("nondeterministic", f"two calls differ by rel-RMS {rel:.3g} (within tolerance; the "
                               "base is bitwise reproducible)", cell, severity=WARN))

    bp, cp = (base.get("poison") or {}).get("nonfinite") or {}, (cand.get("poison") or {}).get("nonfinite") or {}
    unwritten = {n: c for n, c in cp.items() if c and c > (bp.get(n) or 0)}
    if unwritten:
        out.append(finding("unwritten-output", "non-finite values after poisoned allocation: "
                           + ", ".join(f"{n}: {c}" for n, c in unwritten.items()), cell))

    bc, cc = base.get("census") or {}, cand.get("census") or {}
    if "error" not in bc and "error" not in cc and bc and cc:
        base_own = sum((bc.get("triton_launches") or {}).values()) + (bc.get("own_gpu_kernels") or 0)
        cand_own = sum((cc.get("triton_launches") or {}).values()) + (cc.get("own_gpu_kernels") or 0)
        if base_own > 0 and cand_own == 0:
            out.append(finding("no-own-kernel", f"the base launched {base_own} kernel(s) of its own, the candidate "
                               "none", cell))
        lib_b = sum((bc.get("library_ops") or {}).values()) + sum((bc.get("library_kernels") or {}).values())
        lib_c = sum((cc.get("library_ops") or {}).values()) + sum((cc.get("library_kernels") or {}).values())
        if lib_c > lib_b:
            names = sorted({**(cc.get("library_ops") or {}), **(cc.get("library_kernels") or {})})
            out.append(finding("library-compute", f"{lib_c} library GEMM/attention call(s) vs {lib_b} on the base: "
                               + ", ".join(names[:6]), cell))
        side_b, side_c = bc.get("side_stream_kernels") or {}, cc.get("side_stream_kernels") or {}
        if len(side_c) > len(side_b) or sum(side_c.values()) > sum(side_b.values()):
            # the calling stream is the one the timer's events are recorded on: kernels elsewhere
            # are work it does not wait for, even when the op's every kernel moved to one stream
            out.append(finding("side-stream", f"{sum(side_c.values())} kernel(s) on {len(side_c)} stream(s) other "
                               f"than the calling one (base: {sum(side_b.values())} on {len(side_b)}; "
                               f"{cc.get('n_streams')} stream(s) in all)", cell))
        elif (cc.get("n_streams") or 0) > max(1, bc.get("n_streams") or 0):
            out.append(finding("side-stream", f"kernels on {cc['n_streams']} streams (base: {bc.get('n_streams')})",
                               cell))

    bg, cg = base.get("graph") or {}, cand.get("graph") or {}
    if cg.get("checked") and cg.get("missing"):
        # what the candidate's replay lacks beyond what the base's does (a kernel the base's graph
        # also cannot hold is the harness's blind spot, not the candidate's doing)
        had = bg.get("missing") or {} if bg.get("checked") else {}
        new_missing = {n: c for n, c in cg["missing"].items() if n not in had}
        if new_missing:
            shown = ", ".join(f"{n[:60]} ({c:g}/call eager, {(cg.get('replay_per_call') or {}).get(n, 0):g} "
                              f"replayed)" for n, c in list(new_missing.items())[:3])
            out.append(finding("graph-escape", f"kernels the eager call runs that a replay of the captured graph "
                               f"does not: {shown}", cell))

    bl, cl = base.get("l2") or {}, cand.get("l2") or {}
    if cl.get("checked"):
        # each value read on its own: one the runtime refused (None) leaves the other judged
        # The limit is a device setting the base need not leave at 0 (an unplanted base read 11.25 MiB on
        # the H200, 2026-12-03): a candidate that moves it either way changed what the L2 keeps; a window
        # is the candidate's own ask and counts when it grows.
        limit, window = "persisting_limit_bytes", "window_bytes"
        if cl.get(limit) is not None and bl.get(limit) is not None and cl[limit] != bl[limit]:
            out.append(finding("l2-persisting", f"persisting-L2 limit {cl[limit]} bytes (base {bl[limit]})", cell))
        elif cl.get(limit) is not None and bl.get(limit) is None and cl[limit] > 0:
            out.append(finding("l2-persisting", f"persisting-L2 limit {cl[limit]} bytes (base unread)", cell))
        if cl.get(window) is not None and cl[window] > (bl.get(window) or 0):
            out.append(finding("l2-persisting", f"access-policy window {cl[window]} bytes (base {bl.get(window)})", cell))

    diffs = numeric_differences(base.get("numeric") or {}, cand.get("numeric") or {}, expected=cand_env)
    if diffs:
        out.append(finding("numeric-settings", "; ".join(diffs[:8]), cell))
    return out


def numeric_differences(base: dict, cand: dict, labels: tuple[str, str] = ("base", "candidate"),
                        expected: dict | None = None) -> list[str]:
    """What differs between two numeric reports; an environment variable in `expected` is not a
    difference when the second side has exactly the value asked for."""
    out = []
    for group in ("flags", "triton", "env"):
        b, c = base.get(group) or {}, cand.get(group) or {}
        for key in sorted(set(b) | set(c)):
            if group == "env" and key in (expected or {}) and c.get(key) == str(expected[key]):
                continue
            if b.get(key) != c.get(key):
                out.append(f"{key}: {labels[0]} {b.get(key)!r}, {labels[1]} {c.get(key)!r}")
    return out


SELF_CHECKS = {"replay": "the graph's outputs after one more replay",
               "replay-mutated": "a replay of the graph on inputs changed in place",
               "eager": "one more eager call", "mutated": "a call on inputs changed in place"}


def self_check_finding(cell: str, round_no: int, changed: list[str], checks: dict,
                       pre_existing: bool = False) -> Finding:
    """The candidate's measuring process, after its samples, no longer reproduced what it computed
    at setup; warn only when the base's did not either (then the op varies, not the candidate)."""
    parts = []
    for name in changed:
        worst = sorted(((t.get("rel_rms") if t.get("rel_rms") is not None else float("inf"), n)
                        for n, t in (checks.get(name) or {}).get("tensors", {}).items() if not t.get("match")),
                       reverse=True)[:2]
        what = ", ".join(f"{n} rel-RMS {r:.3g}" if r != float("inf") else f"{n} missing or non-finite"
                         for r, n in worst)
        parts.append(f"{SELF_CHECKS.get(name, name)} differs from setup's ({what})")
    msg = f"round {round_no}, after the timed samples: " + "; ".join(parts)
    if pre_existing:
        msg += " (the base's process changed too: reported, not blocking)"
    return finding("self-check", msg, cell, severity="warn" if pre_existing else None)



# what a verdict says of the tensor that differs most (`worst_tensor`)
WORST_KEYS = ("rel_rms", "max_abs", "nonfinite_self", "shape", "shape_ref", "missing")


def worst_tensor(cmp_: dict, keys: tuple[str, ...] = (*WORST_KEYS, "nonfinite_ref")) -> dict:
    """The tensor of a comparison (inside/worker/outputs.compare_results) that differs most: one that
    does not match first, then by relative RMS; {} when nothing was compared."""
    tensors = cmp_.get("tensors") or {}
    if not tensors:
        return {}

    def badness(kv):
        t = kv[1]
        rel = t.get("rel_rms")
        return (not t.get("match"), t.get("nonfinite_self") or 0, math.inf if rel is None else rel)

    name, t = max(tensors.items(), key=badness)
    return {"tensor": name, **{k: t.get(k) for k in keys}}


def how_differs(worst: dict, tol: object = None, with_tol: bool = False) -> str:
    """How the tensor that differs most (`worst_tensor`) differs: missing on a side, another shape,
    or its relative RMS (with `with_tol`, beside the tolerance `tol`)."""
    name, rel = worst.get("tensor", "-"), worst.get("rel_rms")
    if worst.get("missing"):
        return f"{name} missing on the {'candidate' if worst['missing'] == 'self' else 'base'}"
    if worst.get("shape") != worst.get("shape_ref"):
        return f"{name} shape {worst.get('shape')} vs the base's {worst.get('shape_ref')}"
    within = f" (tol {tol})" if with_tol else ""
    return f"{name} rel-RMS not finite{within}" if rel is None else f"{name} rel-RMS {rel:.3g}{within}"


def output_verdict(cmp_: dict) -> dict:
    """The base's comparison of the candidate's outputs with its own (inside/worker/outputs.
    compare_results) as a verdict of a call nobody times (the unseen shapes, the test's calls, the
    options): `skipped` where the base itself gives non-finite values (the inputs lie outside the
    op's domain), else `match` or `differs` with why; `worst` is the tensor that differs most."""
    tensors = cmp_.get("tensors") or {}
    nonfinite = {n: t["nonfinite_ref"] for n, t in tensors.items() if t.get("nonfinite_ref")}
    if nonfinite:
        return {"status": "skipped", "why": "the base gives non-finite values: " + ", ".join(
            f"{n}: {k}" for n, k in nonfinite.items())}
    worst = worst_tensor(cmp_, WORST_KEYS) or {"tensor": "-", **dict.fromkeys(WORST_KEYS)}
    if cmp_.get("match"):
        return {"status": "match", "worst": worst}
    nf = f", {worst['nonfinite_self']} non-finite (the base none)" if worst.get("nonfinite_self") else ""
    return {"status": "differs", "why": f"candidate differs from base: {how_differs(worst, cmp_.get('tol'), True)}{nf}",
            "worst": worst}


def timed_call_finding(cell: str, at: dict, worst: dict, tol: float | None, aa: bool = False) -> Finding:
    """A timed call of the candidate, checked against the base's same call on the same inputs,
    differs. In an A/A both sides are the base: the op varies between processes, reported only."""
    pairs = f" of {at['of_pairs']}" if at.get("of_pairs") else ""
    where = f"round {at.get('round')}, pair {at.get('pair', 0) + 1}{pairs}, " + (
        "the graph's replay" if at.get("timer") == "cuda_graph" else
        f"call {at.get('call', 0) + 1} of {at.get('k')}")
    nf = f", {worst['nonfinite_self']} non-finite" if worst.get("nonfinite_self") else ""
    msg = f"{where}: the timed call differs from the base's on the same inputs: {how_differs(worst)}{nf} (tol {tol})"
    if aa:
        return finding("timed-call-differs", msg + " (A/A: the base against itself, reported, not blocking)",
                       cell, severity=WARN)
    return finding("timed-call-differs", msg, cell)


# How far (relative RMS) a candidate may differ from the base, per cell dtype, before the difference
# is more than reordering the arithmetic in that dtype explains. An fp32 reduction reordered (other
# chunk sizes, another split of the sum) moves results by a few unit roundoffs times the growth of a
# sum (sqrt(n) for rounding that does not align; n at worst): a linear-attention recurrence over
# T=8192, D=64 in fp32 differs by 3.8e-7 between chunk sizes 32 and 64, and a decay accumulated in a
# long cumsum reads exp(G_i - G_j) with an absolute error near u*|G|, about 5e-5 with |G| in the
# hundreds. Rounding through a narrower dtype is far above that: through fp16 2.1e-4 (the output)
# to 3.5e-4 (the inputs), TF32 products 2e-4 to 4e-4, bf16 1.7e-3 (the output) to 2.9e-3 (the
# inputs) (docs/GUARD.md, "precision-narrowed", has the measurement). fp16 cells hold their
# outputs in fp16: two honest orders differ by up to an fp16 rounding (about 2.8e-4), bf16 by 1.6e-3.
# bf16 cells have no narrower dtype in common use below them; their differences are --diff-tol's.
PRECISION_BOUNDS = {"float32": 1e-4, "float16": 8e-4}
# what rounding through each narrower dtype gives, for the finding's words (fp32 cells)
_NARROWED = "rounding through fp16 gives about 2e-4, TF32 2e-4 to 4e-4, bf16 1.7e-3 to 2.9e-3"


def precision_finding(where: str, dtype: str, cmp_: dict, aa: bool = False,
                      bounds: dict[str, float] | None = None) -> Finding | None:
    """`precision-narrowed` when a comparison that matched within --diff-tol (inside/worker/outputs.
    compare_results: the candidate's results against the base's) still differs by more than the
    cell dtype's arithmetic can explain; None otherwise, or for a dtype with no bound. In an A/A
    both sides are the base: reported, not blocking."""
    bound = (bounds or PRECISION_BOUNDS).get(str(dtype).replace("torch.", ""))
    if bound is None or not cmp_.get("match"):
        return None
    rels = {n: t["rel_rms"] for n, t in (cmp_.get("tensors") or {}).items() if t.get("rel_rms") is not None}
    if not rels:
        return None
    name = max(rels, key=rels.get)
    if rels[name] <= bound:
        return None
    msg = (f"{name} rel-RMS {rels[name]:.3g} against the base on {dtype} inputs, above the {bound:.0e} that "
           f"reordering {dtype} arithmetic explains (within --diff-tol {cmp_.get('tol')}; {_NARROWED})")
    if aa:
        return finding("precision-narrowed", msg + " (A/A: the base against itself, reported, not blocking)",
                       where, severity=WARN)
    return finding("precision-narrowed", msg, where)
