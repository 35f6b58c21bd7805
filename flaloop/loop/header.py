"""`flaloop header OP --iter N`: the kept kernel's header comment, filled from the records.

Five sections, so that whoever opens the kernel file next knows what it is and what was tried:
Identity (what, where, how fast, measured on what), Delta (the kept changes that led here, each
with its measured step), Lessons (re-assessments and traps added during the loop), Dead-ends
(directions that did not pay, with their numbers) and Open directions (what was planned or only
signalled, not yet judged).
"""

from __future__ import annotations

from flaloop.core.errors import UsageError
from flaloop.loop import rules
from flaloop.loop.store import Decision, Iteration
from flaloop.loop.traps import Trap
from flaloop.report import fmt
from flaloop.report.opt_log import comparison_text, env_line

SECTIONS = ("Identity", "Delta", "Lessons", "Dead-ends", "Open directions")


def header(contract, iters: list[Iteration], decisions: list[Decision], traps: list[Trap], n: int) -> dict:
    """The sections as lists of lines."""
    it = next((i for i in iters if i.iter == n), None)
    if it is None:
        raise UsageError(f"there is no iteration {n} of {contract.op}", "`flaloop status` lists the iterations")
    if it.status != "keep":
        keeps = [str(i.iter) for i in iters if i.status == "keep"]
        raise UsageError(f"iteration {n} is `{it.status}`, not a kept kernel",
                         f"kept iterations: {', '.join(keeps) or 'none yet'}")
    base = rules.baseline_of(iters)
    env = (base.baseline or {}).get("env") if base else None
    chain = [i for i in iters if i.status == "keep" and i.iter <= n]
    later = [i for i in rules.attempts(iters) if i.status != "keep"]
    identity = [
        f"{contract.op} ({contract.import_path}.{contract.func_name}), {contract.entry_file}",
        f"flaloop iteration {n}, commit {it.commit[:12]}; base {contract.base_commit[:12]}",
        f"vs base: {comparison_text(it.vs_base, link=False)} on {', '.join((it.vs_base or {}).get('shapes') or [])}",
        f"gate: {'green' if (it.gate or {}).get('green') else 'red'} "
        f"({(it.gate or {}).get('counts', {}).get('passed', 0)} passed), target {contract.target_speedup:g}x",
        f"measured on: {env_line(env, it.commit)}",
    ]
    delta = [f"#{i.iter} {i.direction}: {fmt.speedup(rules.geo_speedup(i.vs_best))} vs the best before it "
             f"({i.best_before[:12]})" for i in chain]
    lessons = [f"after #{d.after_iter}: {d.data.get('why')} -> {d.data.get('next')}"
               for d in decisions if d.kind == "reassess"]
    lessons += [f"trap: {t.title}: {t.how}" for t in traps if t.source != "flaloop catalogue"]
    dead = [f"#{i.iter} {i.direction}: {i.status} ({i.note})" for i in later if i.status != "signal"]
    judged = {rules.normalized(i.direction) for i in iters if i.status != "signal"}
    open_dirs = [f"#{i.iter} {i.direction} (signal only: {fmt.speedup(rules.geo_speedup(i.vs_best))} vs best)"
                 for i in later if i.status == "signal" and rules.normalized(i.direction) not in judged]
    reassess = [d for d in decisions if d.kind == "reassess"]
    if reassess and not any(i.iter > reassess[-1].after_iter for i in iters):
        open_dirs.append(f"next, per the last re-assessment: {reassess[-1].data.get('next')}")
    return dict(zip(SECTIONS, (identity, delta, lessons or ["-"], dead or ["-"], open_dirs or ["-"]),
                    strict=True))


def render(sections: dict, prefix: str = "# ") -> str:
    lines = []
    for name in SECTIONS:
        lines.append(f"{prefix}{name}:")
        lines += [f"{prefix}  {x}" for x in sections[name]]
    return "\n".join(lines) + "\n"
