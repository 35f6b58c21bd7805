"""benchmarks/run.py's `timed` suite (issue 37, item 1) on FLA's chunk_delta_rule: what checking a
random timed call of every round against the base's costs a bench (the copy of that call's results,
the transfer to the base and its comparison: `guard.timed_calls` in the record), as a share of a
warm bench; then a plant the timed check alone must block: a path taken only while a CUDA graph is
captured, right on the graph proof's replay and wrong on every later (timed) one; then the same
plant on minifla, the GPU test of tests/redteam/test_timed_calls.py (the selftest suite collects
tests/unit and tests/e2e only)."""

from __future__ import annotations

import sys

from harness import OP, SMALL, Ctx, cells_line, fla_copy, goal, init, record_of, run, write

PAIRS = ["--min-pairs", "8", "--max-pairs", "40", "--cell-seconds", "10"]
CHUNK = "fla/ops/delta_rule/chunk.py"
# Appended to FLA's module: the op's name rebound to a wrapper (functools.wraps keeps its signature
# for the registry). Each captured call takes a device counter of its own from a buffer an eager
# call allocated; every replay increments it, and past 1 the output is zeroed.
PLANT = '''

def _flaloop_timed_plant():
    import functools

    inner = chunk_delta_rule
    tag = ''.join(chr(c) for c in (99, 97, 108, 108, 115))

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        out = inner(*args, **kwargs)
        o, rest = out[0], out[1:]
        pool = getattr(wrapped, tag, None)
        if getattr(torch.cuda, 'is_current_stream_' + 'capturing')():
            c = pool[0][pool[1]:pool[1] + 1]
            pool[1] = pool[1] + 1
            c.add_(1)
            o = o * (c <= 1).to(o.dtype)
        elif pool is None:
            setattr(wrapped, tag, [torch.zeros(1 << 16, device=o.device), 0])
        return (o, *rest)
    return wrapped


chunk_delta_rule = _flaloop_timed_plant()
'''


def _cost(rec: dict) -> tuple[float, float, float, float]:
    """(timed-call seconds, probes and self-check seconds, unseen seconds, the bench's wall seconds)."""
    guard = rec.get("guard") or {}
    return ((guard.get("timed_calls") or {}).get("seconds") or 0.0, guard.get("probe_seconds") or 0.0,
            (rec.get("unseen") or {}).get("seconds") or 0.0, rec.get("wall_s") or 0.0)


def suite_timed(ctx: Ctx) -> None:
    repo = fla_copy(ctx, "timed")
    init(ctx, repo, [SMALL])
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "timed"
    lines: list[str] = []

    # cold first (compiles and autotunes), then warm: the goal is on the warm A/A
    share = {}
    for state in ("cold", "warm"):
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", *PAIRS], d / f"aa-{state}", env=env)
        rec = record_of(doc) or {}
        timed, probes, unseen, inner = _cost(rec)
        tc = (rec.get("guard") or {}).get("timed_calls") or {}
        checks = [x for c in rec.get("cells") or [] for x in (c.get("probes") or {}).get("timed_calls") or []]
        share[state] = 100 * timed / max(inner or wall, 1e-9)
        lines.append(f"A/A, {state} cache: exit {code} in {wall:.1f}s (bench {inner}s): timed calls checked "
                     f"{tc.get('checked')}, differ {tc.get('differ')}, {timed:.2f}s = {share[state]:.2f}% of the bench "
                     f"(record's share {tc.get('share')}); probes and self-check {probes:.1f}s, unseen {unseen:.1f}s; "
                     f"timers {sorted({x.get('timer') for x in checks})}, worst rel-RMS "
                     f"{max([(x.get('worst') or {}).get('rel_rms') or 0.0 for x in checks] or [0.0]):.3g}")
        lines += cells_line(rec)
    goal("timed-call cost", share["warm"] <= 20, f"{share['warm']:.2f}% of a warm bench's wall time (goal <= 20%); "
         f"{share['cold']:.2f}% of the first, on an empty cache")

    # the capture-only plant: blocked by timed-call-differs, and by nothing else
    p = repo / CHUNK
    src = p.read_text()
    p.write_text(src + PLANT)
    try:
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--json", *PAIRS], d / "captured", env=env)
    finally:
        p.write_text(src)
    rec = record_of(doc) or {}
    found = [f for f in (rec.get("guard") or {}).get("findings") or [] if f.get("blocking")]
    lines.append(f"captured-only plant: exit {code} in {wall:.1f}s, verdicts {[c.get('verdict') for c in rec.get('cells') or []]}")
    for f in found[:6]:
        lines.append(f"    {f['rule']} {f.get('cell')}: {f['message'][:300]}")
    lines += cells_line(rec)
    goal("captured-only plant blocked by the timed check", code == 1 and {f["rule"] for f in found} == {"timed-call-differs"},
         f"exit {code}, blocking rules {sorted({f['rule'] for f in found})}")

    code, wall, _ = run(ctx, [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/redteam/test_timed_calls.py",
                              "-p", "no:cacheprovider"], d / "pytest-gpu", env=env, flaloop=False, timeout=600)
    lines.append(f"pytest -m gpu tests/redteam/test_timed_calls.py: exit {code} in {wall:.1f}s "
                 f"(output in {(d / 'pytest-gpu.json').relative_to(ctx.out)})")
    goal("minifla capture-only plant (GPU test)", code == 0, f"pytest exit {code}")
    write(d / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
