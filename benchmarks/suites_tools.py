"""benchmarks/run.py's suites that try flaloop on FLA: planted cheats, faults, the loop, profile,
report, the GPU tests, a first look at a new machine."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from harness import (  # benchmarks/ is the script's directory, first on sys.path
    OP,
    ROOT,
    SMALL,
    Ctx,
    cells_line,
    fla_copy,
    goal,
    init,
    record_of,
    run,
    say,
    write,
)

GUARD_PLANTS = {
    "patched-timer": ("fla/__init__.py", None,
                      "\nimport torch as _t\n_orig = _t.cuda.Event.elapsed_time\n"
                      "_t.cuda.Event.elapsed_time = lambda self, end: 0.8 * _orig(self, end)\n"),
    "allow-tf32": ("fla/ops/delta_rule/chunk.py", None, "\ntorch.backends.cuda.matmul.allow_tf32 = True\n"),
    "naive-short": ("fla/ops/delta_rule/chunk.py",
                    ("    scale = k.shape[-1] ** -0.5 if scale is None else scale\n",
                     "    scale = k.shape[-1] ** -0.5 if scale is None else scale\n"
                     "    if q.shape[1] <= 64:\n"
                     "        from fla.ops.delta_rule.naive import delta_rule_recurrence\n"
                     "        return delta_rule_recurrence(q, k, v, beta, scale, initial_state, output_final_state)\n"),
                    None),
    "honest-autotune": ("fla/ops/delta_rule/wy_fast.py",
                        ("        for num_warps in [2, 4, 8]\n        for num_stages in [2, 3, 4]\n",
                         "        for num_warps in [4, 8]\n        for num_stages in [2, 3]\n"), None),
}


def _plant(repo: Path, rel: str, replace, append) -> None:
    p = repo / rel
    src = p.read_text()
    if replace:
        if replace[0] not in src:
            raise RuntimeError(f"cannot plant in {rel}: {replace[0]!r} not found")
        src = src.replace(replace[0], replace[1], 1)
    if append:
        src += append
    p.write_text(src)


GUARD_PAIRS = ["--min-pairs", "8", "--max-pairs", "40", "--cell-seconds", "10"]


def suite_guard(ctx: Ctx) -> None:
    repo = fla_copy(ctx, "guard")
    init(ctx, repo, [SMALL])
    env = ctx.env(gpus=ctx.gpus[:1])
    subprocess.run(["git", "checkout", "-q", "-b", "flaloop-scratch"], cwd=repo, check=False)
    lines = []
    for name, (rel, replace, append) in GUARD_PLANTS.items():
        original = (repo / rel).read_text()
        _plant(repo, rel, replace, append)
        _, wall, audit = run(ctx, ["audit", OP, "--repo", str(repo), "--json"], ctx.out / "guard" / f"{name}-audit", env=env)
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--json", *GUARD_PAIRS], ctx.out / "guard" / name,
                              env=env)
        (repo / rel).write_text(original)
        rec = record_of(doc) or {}
        rules = sorted({f["rule"] for f in (rec.get("guard") or {}).get("findings") or [] if f.get("blocking")})
        verdicts = [c.get("verdict") for c in rec.get("cells") or []]
        lines.append(f"{name}: exit {code}, verdicts {verdicts}, blocking rules {rules}, "
                     f"audit blocked={((audit or {}).get('blocked'))} in {((audit or {}).get('seconds'))}s")
        lines += cells_line(rec)
    # the probes' cost: the same A/A with and without them
    costs = []
    for flag in ([], ["--no-probes"]):
        _, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", *GUARD_PAIRS, *flag],
                           ctx.out / "guard" / f"aa{'-noprobes' if flag else ''}", env=env)
        rec = record_of(doc) or {}
        costs.append((wall, (rec.get("guard") or {}).get("probe_seconds"), rec.get("wall_s")))
    (w_on, probe_s, inner), (w_off, _, _) = costs
    share = 100 * (probe_s or 0) / max(inner or w_on, 1e-9)
    lines.append(f"probes: {probe_s}s of a {inner}s bench ({share:.1f}%); wall {w_on:.1f}s with, {w_off:.1f}s without "
                 f"({2} cells)")
    write(ctx.out / "guard" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    goal("probe cost", share <= 20, f"{share:.1f}% of the bench's wall time (goal <= 20%)")


FAULTS = {
    # an out-of-bounds store in a kernel the op runs: the forward output's kernel writes far past its end
    "oob-write": ("fla/ops/common/chunk_o.py", "    p_o = o + o_t[:, None] * (HV*V) + o_v[None, :]\n",
                  "    p_o = o + (1 << 36) + o_t[:, None] * (HV*V) + o_v[None, :]\n"),
    # allocate past the GPU's memory on the largest shape only (any shape with T >= 8192)
    "oom": ("fla/ops/delta_rule/chunk.py", "    scale = k.shape[-1] ** -0.5 if scale is None else scale\n",
            "    scale = k.shape[-1] ** -0.5 if scale is None else scale\n"
            "    if q.shape[1] * q.shape[2] >= 2048 * 16:  # the contract's largest shape\n"
            "        _hog = torch.empty(1 << 40, dtype=torch.uint8, device=q.device)\n"),
    # a kernel that never returns
    "spin": ("fla/ops/delta_rule/wy_fast.py", None, None),
}


def suite_faults(ctx: Ctx) -> None:
    repo = fla_copy(ctx, "faults")
    init(ctx, repo, ["B4_T2048_H16_D128", SMALL], modes="fwd")
    env = ctx.env(gpus=ctx.gpus[:1])
    subprocess.run(["git", "checkout", "-q", "-b", "flaloop-scratch"], cwd=repo, check=False)
    lines = []
    for name, (rel, old, new) in FAULTS.items():
        p = repo / rel
        src = p.read_text()
        try:
            p.write_text(_spin_plant(src) if old is None else _replace_once(src, old, new))
        except RuntimeError as exc:
            lines.append(f"{name}: cannot plant: {exc}")
            continue
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--json", "--worker-timeout", "45",
                                    "--min-pairs", "6", "--max-pairs", "12", "--rounds", "1"],
                              ctx.out / "faults" / name, env=env, timeout=400)
        p.write_text(src)
        rec = record_of(doc) or {}
        lines.append(f"{name}: exit {code} in {wall:.1f}s; restarts {rec.get('restarts')}; errors "
                     f"{[e.splitlines()[0][:160] for e in rec.get('errors') or []]}")
        lines += cells_line(rec)
        nxt, wall2, doc2 = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", "--shapes", SMALL,
                                     "--modes", "fwd", "--min-pairs", "6", "--max-pairs", "12", "--rounds", "1"],
                               ctx.out / "faults" / f"{name}-next", env=env, timeout=300)
        lines.append(f"  next command on that GPU: exit {nxt} in {wall2:.1f}s, verdicts "
                     f"{[c.get('verdict') for c in (record_of(doc2) or {}).get('cells') or []]}")
    write(ctx.out / "faults" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))


def _replace_once(src: str, old: str, new: str) -> str:
    if old not in src:
        raise RuntimeError(f"{old!r} not found")
    return src.replace(old, new, 1)


def _spin_plant(src: str) -> str:
    """Make recompute_w_u_fwd_kernel (forward and backward) loop forever. The loop must have a side
    effect (a volatile load): LLVM may delete a side-effect-free infinite loop, and did so on the
    H200 on 2026-11-30, when the planted kernel simply ran."""
    marker = "    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)\n"
    if marker not in src:
        raise RuntimeError("spin: kernel prologue not found")
    spin = (marker + "    _spin = tl.load(beta, volatile=True)\n    while _spin == _spin:\n"
            "        _spin = tl.load(beta, volatile=True)\n")
    return src.replace(marker, spin, 1)


LOOP_STEPS = [
    ("recompute_w_u autotune: num_stages 2-4 -> 2-3", "fla/ops/delta_rule/wy_fast.py",
     "        for num_warps in [2, 4, 8]\n        for num_stages in [2, 3, 4]\n",
     "        for num_warps in [2, 4, 8]\n        for num_stages in [2, 3]\n"),
    ("recompute_w_u autotune: num_warps 2-8 -> 4-8", "fla/ops/delta_rule/wy_fast.py",
     "        for num_warps in [2, 4, 8]\n        for num_stages in [2, 3",
     "        for num_warps in [4, 8]\n        for num_stages in [2, 3"),
    ("backward: fold dk2 into dk with += instead of add_", "fla/ops/delta_rule/chunk.py",
     "    dk.add_(dk2)\n", "    dk += dk2\n"),
]


def suite_loop(ctx: Ctx) -> None:
    repo = ctx.work / "loop"
    if repo.exists():
        shutil.rmtree(repo)
    shutil.copytree(ctx.fla, repo, symlinks=True, ignore=shutil.ignore_patterns("profile", "__pycache__"))
    subprocess.run(["git", "checkout", "-q", "-b", "flaloop-scratch"], cwd=repo, check=False)
    init(ctx, repo, [SMALL])
    env = ctx.env(gpus=ctx.gpus[-1:])
    lines = []
    code, wall, _ = run(ctx, ["baseline", OP, "--repo", str(repo), "--json", "--workers", "4", *GUARD_PAIRS],
                        ctx.out / "loop" / "baseline", env=env)
    lines.append(f"baseline: exit {code} in {wall:.1f}s")
    for i, (direction, rel, old, new) in enumerate(LOOP_STEPS, 1):
        p = repo / rel
        src = p.read_text()
        if old not in src:
            lines.append(f"iter {i}: cannot plant ({old!r} not in {rel})")
            continue
        p.write_text(src.replace(old, new, 1))
        code, wall, doc = run(ctx, ["iter", OP, direction, "--repo", str(repo), "--json", "--workers", "4",
                                    *GUARD_PAIRS],
                              ctx.out / "loop" / f"iter{i}", env=env)
        it = (doc or {}).get("iteration") or {}
        lines.append(f"iter {i}: exit {code} in {wall:.1f}s: {it.get('status')} — {direction}")
    run(ctx, ["status", OP, "--repo", str(repo), "--json"], ctx.out / "loop" / "status", env=env)
    log = repo / "profile" / f"{OP}-opt" / "OPT_LOG.md"
    if log.exists():
        shutil.copy(log, ctx.out / "loop" / "OPT_LOG.md")
    subprocess.run(f"git -C {repo} log --oneline -12 > {ctx.out / 'loop' / 'git-log.txt'}", shell=True)
    write(ctx.out / "loop" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))


def suite_profile(ctx: Ctx) -> None:
    repo = ctx.work / "loop"
    if not repo.exists():
        repo = fla_copy(ctx, "profile")
        init(ctx, repo, [SMALL])
    run(ctx, ["profile", OP, "--repo", str(repo), "--json", "--shape", SMALL, "--mode", "fwd", "--ncu"],
        ctx.out / "profile" / "profile", env=ctx.env(gpus=ctx.gpus[-1:]), timeout=600)


def suite_report(ctx: Ctx) -> None:
    repo = ctx.work / "loop"
    if not repo.exists():
        say("report: no loop ran; nothing to report")
        return
    dest = ctx.out / "report"
    run(ctx, ["report", OP, "--repo", str(repo), "--json", "--out", str(dest)], dest / "report",
        env=ctx.env(gpus=ctx.gpus[-1:]))


def suite_selftest(ctx: Ctx) -> None:
    """The GPU-marked tests, collected from the files that have any (collecting all takes ~1 min)."""
    found = [*(ROOT / "tests" / "unit").glob("test_*.py"), *(ROOT / "tests" / "e2e").glob("test_*.py")]
    files = sorted(str(p.relative_to(ROOT)) for p in found if "mark.gpu" in p.read_text())
    run(ctx, [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *files, "-p", "no:cacheprovider"],
        ctx.out / "selftest" / "pytest", env=ctx.env(gpus=ctx.gpus[:1]), flaloop=False, timeout=600)


def suite_redteam(ctx: Ctx) -> None:
    """The red-team corpus's GPU entries (tests/redteam, `-m gpu`): each plants its cheat in minifla or in a
    copy of `.fla` and runs the layer that must stop it. TRITON_INTERPRET is left unset: real kernels."""
    env = {k: v for k, v in ctx.env(gpus=ctx.gpus[:1]).items() if k != "TRITON_INTERPRET"}
    code, wall, _ = run(ctx, [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/redteam", "-p", "no:cacheprovider"],
                        ctx.out / "redteam" / "pytest", env=env, flaloop=False, timeout=600)
    goal("red-team corpus on the GPU", code == 0, f"pytest -m gpu tests/redteam: exit {code} in {wall:.1f}s "
         "(output in redteam/pytest.*)")


def suite_smoke(ctx: Ctx) -> None:
    """A first look at a new machine: the GPU tests, one FLA cell A/A (fork server, probes, roofline) and
    the patched-timer cheat on that cell; ncu's version."""
    run(ctx, ["ncu", "--version"], ctx.out / "smoke" / "ncu", flaloop=False)
    suite_selftest(ctx)
    repo = fla_copy(ctx, "smoke")
    init(ctx, repo, [SMALL], modes="fwd")
    env = ctx.env(gpus=ctx.gpus[:1])
    lines = []
    for i in range(2):
        _, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", "--min-pairs", "8",
                                 "--max-pairs", "16"], ctx.out / "smoke" / f"aa{i}", env=env)
        rec = record_of(doc) or {}
        lines.append(f"A/A {i}: {wall:.1f}s, imports {rec.get('import_s')}, forkserver {(rec.get('env') or {}).get('forkserver')}, "
                     f"findings {[f['rule'] for f in (rec.get('guard') or {}).get('findings') or []]}, "
                     f"probe_s {(rec.get('guard') or {}).get('probe_seconds')}")
        lines += cells_line(rec)
    rel, replace, append = GUARD_PLANTS["patched-timer"]
    original = (repo / rel).read_text()
    _plant(repo, rel, replace, append)
    code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--json", "--min-pairs", "8", "--max-pairs", "16"],
                          ctx.out / "smoke" / "timer", env=env)
    (repo / rel).write_text(original)
    rec = record_of(doc) or {}
    lines.append(f"patched timer: exit {code}, verdicts {[c.get('verdict') for c in rec.get('cells') or []]}, "
                 f"rules {[f['rule'] for f in (rec.get('guard') or {}).get('findings') or []]}")
    write(ctx.out / "smoke" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
