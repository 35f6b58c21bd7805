"""Print the figures of flaloop bench/verify JSON outputs: per cell the bias or speedup with its
CI, verdict, pairs and GPU seconds; per run the geomean; and whether a run met its goal.

Usage: summarize_runs.py [GOAL=]FILE[,FILE...]...   GOAL: aa (every |bias| <= 0.25%, no FASTER/SLOWER)
                                                          slower (every cell SLOWER)
Several files joined by commas (one run split over GPUs) are printed one by one and judged as one."""

from __future__ import annotations

import json
import sys


def _warmup(cell: dict) -> float:
    """Seconds both workers spent building inputs, compiling and autotuning this cell."""
    return sum((cell.get("setup", {}).get(side) or {}).get("setup_s") or 0.0 for side in ("base", "cand"))


def check_goal(goal: str, cells: list[dict]) -> str:
    measured = [c for c in cells if c.get("estimate")]
    if not measured:
        return f"goal {goal}: NOT MET (no cell measured)"
    if goal == "aa":
        worst = max(abs(1 / c["estimate"]["speedup"] - 1) for c in measured) * 100
        loud = [c["cell"]["id"] for c in measured if c["verdict"] in ("FASTER", "SLOWER")]
        ok = worst <= 0.25 and not loud and len(measured) == len(cells)
        return (f"goal aa: {'MET' if ok else 'NOT MET'}: worst |bias| {worst:.3f}% (<= 0.25%), "
                f"FASTER/SLOWER on {loud or 'no cell'}, {len(measured)}/{len(cells)} cells measured")
    if goal == "slower":
        missed = [c["cell"]["id"] for c in cells if c.get("verdict") != "SLOWER"]
        return f"goal slower: {'MET' if not missed else 'NOT MET'}: not SLOWER: {missed or 'none'}"
    return f"goal {goal}: unknown goal"


def summarize(path: str) -> list[dict] | None:
    """Print one run's cells; return them (None when the file holds no bench record)."""
    try:
        doc = json.load(open(path))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{path}: no result ({exc})")
        return None
    rec = doc.get("bench", doc) if "bench" in doc else doc
    if not rec or "cells" not in rec:
        print(f"{path}: no bench record: {doc.get('error') or (doc.get('gate') or {}).get('findings')}")
        return None
    env = rec.get("env") or {}
    print(f"== {path}: {'A/A' if rec.get('aa') else 'candidate vs base'} on {env.get('device_name')} "
          f"(torch {env.get('torch')}, triton {env.get('triton')}), wall {rec.get('wall_s')}s")
    for c in rec["cells"]:
        est = c.get("estimate")
        if est:
            bias = (1 / est["speedup"] - 1) * 100  # + means candidate slower
            ci = f"[{(1 / est['ci_high'] - 1) * 100:+.3f}%, {(1 / est['ci_low'] - 1) * 100:+.3f}%]"
            med = (c.get("summary") or {}).get("base", {}).get("median")
            print(f"  {c['cell']['id']:<34} {c['timer']:<10} base {med:.4f} ms  cand-vs-base {bias:+.3f}% {ci} "
                  f"{c['verdict']:<7} pairs {len(c['pairs']) - c['dropped_pairs']}/{len(c['pairs'])} "
                  f"measuring {c['seconds']:.1f}s warm-up {_warmup(c):.1f}s  launch-bound {c.get('launch_bound')}")
            for r in c.get("rounds") or []:
                print(f"      round {r['round']}: {(1 / r['speedup'] - 1) * 100:+.3f}% "
                      f"[{(1 / r['ci_high'] - 1) * 100:+.3f}%, {(1 / r['ci_low'] - 1) * 100:+.3f}%] "
                      f"over {r['n_pairs']} pairs")
            for d in c.get("tuning_differs") or []:
                print(f"      autotune differs: {d[:300]}")
        else:
            print(f"  {c['cell']['id']:<34} {c['status'].upper()}: {c.get('reason', '')[:160]}")
    if rec.get("primed"):
        print(f"  measured in fresh workers after the warm-up ({rec['primed']['new_cache_entries']} new cache entries)")
    if rec.get("contested"):
        print(f"  extra rounds ({len(rec.get('rounds') or [])} in all) for: {', '.join(rec['contested'])}")
    g = (rec.get("summary") or {}).get("geomean")
    if g:
        print(f"  geomean speedup {g['speedup']:.5f} [{g['ci_low']:.5f}, {g['ci_high']:.5f}] "
              f"regressions {g['n_regressions']}")
    return rec["cells"]


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        goal, sep, paths = arg.partition("=")
        if not sep:
            goal, paths = "", arg
        runs = [summarize(p) for p in paths.split(",")]
        if goal:
            verdict = (f"goal {goal}: NOT MET (a run has no record)" if None in runs
                       else check_goal(goal, [c for r in runs for c in r]))
            print(f"  {verdict}" + (f" [over {len(runs)} runs]" if len(runs) > 1 else ""))
