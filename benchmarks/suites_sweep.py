"""benchmarks/run.py's sweep suite: `flaloop sweep` of three candidates of FLA's chunk_delta_rule
(an honest change, a neutral one, one the guard blocks) with the local executor, then `iter
--from-sweep` on the best one, which must be kept. FLA's code is never committed here: the
candidates are edits of a copy of `.fla`, made as commits on branches of that copy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from harness import (  # benchmarks/ is the script's directory, first on sys.path
    IDENTITY,
    OP,
    PAIRS,
    SMALL,
    Ctx,
    fla_copy,
    goal,
    init,
    run,
    write,
)

CHUNK = "fla/ops/delta_rule/chunk.py"
SWEEP_SHAPES = [SMALL, "B4_T2048_H16_D128"]


def keep_intermediates(src: str) -> str:
    """The honest change: the forward keeps w, u, h and v_new for the backward, which then no longer
    recomputes them (recompute_w_u_fwd and chunk_gated_delta_rule_fwd_h run once per step, not twice)."""
    edits = [
        ("    return o, A, final_state\n", "    return o, A, final_state, (w, u, h, v_new)\n"),
        ("        o, A, final_state = chunk_delta_rule_fwd(", "        o, A, final_state, kept = chunk_delta_rule_fwd("),
        ("        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, beta, A, initial_state, cu_seqlens, chunk_indices)\n",
         "        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, beta, A, initial_state, cu_seqlens, chunk_indices, *kept)\n"),
        ("        q, q_rstd, k, k_rstd, v, beta, A, initial_state, cu_seqlens, chunk_indices = ctx.saved_tensors\n",
         "        q, q_rstd, k, k_rstd, v, beta, A, initial_state, cu_seqlens, chunk_indices, *kept = ctx.saved_tensors\n"),
        ("            chunk_size=ctx.chunk_size,\n        )\n        if ctx.use_qk_l2norm_in_kernel:",
         "            chunk_size=ctx.chunk_size,\n            kept=kept,\n        )\n        if ctx.use_qk_l2norm_in_kernel:"),
    ]
    for old, new in edits:
        if src.count(old) != 1:
            raise RuntimeError(f"cannot make the honest change: {old.strip()[:60]!r} found {src.count(old)} times")
        src = src.replace(old, new)
    # the backward: take the kept tensors, recompute only when there are none
    start = src.index("    w, u = recompute_w_u_fwd(")
    end = src.index("    dv = chunk_bwd_dv_local(")
    block = "".join("    " + line if line.strip() else line for line in src[start:end].splitlines(keepends=True))
    sig = "    chunk_size: int = 64,\n):\n    w, u = recompute_w_u_fwd("
    if src.count(sig) != 1:
        raise RuntimeError("cannot make the honest change: the backward's signature moved")
    src = src[:start] + "    if kept:\n        w, u, h, v_new = kept\n    else:\n" + block + src[end:]
    return src.replace("    chunk_size: int = 64,\n):\n    if kept:", "    chunk_size: int = 64,\n    kept=None,\n):\n    if kept:", 1)


def neutral(src: str) -> str:
    old = "def chunk_delta_rule_bwd("
    if src.count(old) != 1:
        raise RuntimeError("cannot make the neutral change")
    return src.replace(old, "# The backward recomputes the forward's WY representation and states from A.\n" + old)


def blocked(src: str) -> str:
    old = "import torch\n"
    return src.replace(old, old + "\ntorch.backends.cuda.matmul.allow_tf32 = True\n", 1)


CANDIDATES = {"opt/keep-intermediates": keep_intermediates, "opt/comment": neutral, "opt/tf32": blocked}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**__import__("os").environ, **IDENTITY}).stdout


def make_candidates(repo: Path) -> None:
    _git(repo, "checkout", "-q", "-B", "flaloop-scratch")
    for name, change in CANDIDATES.items():
        _git(repo, "checkout", "-q", "-B", name, "flaloop-scratch")
        p = repo / CHUNK
        p.write_text(change(p.read_text()))
        _git(repo, "commit", "-qam", name)
    _git(repo, "checkout", "-q", "flaloop-scratch")


def suite_sweep(ctx: Ctx) -> None:
    repo = fla_copy(ctx, "sweep")
    make_candidates(repo)
    init(ctx, repo, SWEEP_SHAPES)
    env = ctx.env(gpus=ctx.gpus)
    d = ctx.out / "sweep"
    lines = []
    code, wall, doc = run(ctx, ["sweep", OP, "--repo", str(repo), "--candidates", *CANDIDATES, "--json", *PAIRS],
                          d / "sweep", env=env)
    rows = {c["ref"]: c for c in (doc or {}).get("candidates") or []}
    for ref, c in rows.items():
        g = c.get("geomean") or {}
        lines.append(f"{ref}: rank {c.get('rank')} {c.get('status')} {c.get('verdict')} "
                     + (f"{g['speedup']:.4f}x [{g['ci_low']:.4f}, {g['ci_high']:.4f}]" if g else "")
                     + f" gate {(c.get('gate') or {}).get('wall_s')}s, job {c.get('wall_s')}s; {c.get('reason') or ''}")
        for cell in c.get("cells") or []:
            if cell.get("speedup"):
                lines.append(f"    {cell['id']:<28} {cell['speedup']:.4f}x [{cell['ci_low']:.4f}, {cell['ci_high']:.4f}] "
                             f"{cell['verdict']}")
    lines.append(f"sweep: exit {code} in {wall:.1f}s")
    honest, neut, tf32 = (rows.get(k) or {} for k in CANDIDATES)
    goal("sweep", code == 0 and honest.get("rank") == 1 and honest.get("verdict") == "FASTER"
         and neut.get("status") == "ok" and tf32.get("status") == "blocked",
         f"{wall:.0f}s wall; honest rank {honest.get('rank')} {honest.get('verdict')}, neutral {neut.get('status')} "
         f"{neut.get('verdict')}, tf32 {tf32.get('status')} ({(tf32.get('reason') or '')[:60]})")
    sweep_dir = str(Path(doc["path"]).parent) if doc and doc.get("path") else None
    if sweep_dir:
        for name in ("sweep.md", "sweep.png"):
            subprocess.run(["cp", str(Path(sweep_dir) / name), str(d / name)], check=False)
    code, wall, _ = run(ctx, ["baseline", OP, "--repo", str(repo), "--json", *PAIRS], d / "baseline", env=env)
    lines.append(f"baseline: exit {code} in {wall:.1f}s")
    if sweep_dir:
        code, wall, doc = run(ctx, ["iter", OP, "--from-sweep", sweep_dir, "opt/keep-intermediates", "--repo", str(repo),
                                    "--json", *PAIRS], d / "iter", env=env)
        it = (doc or {}).get("iteration") or {}
        g = ((it.get("vs_base") or {}).get("geomean")) or {}
        lines.append(f"iter --from-sweep: exit {code} in {wall:.1f}s: {it.get('status')} "
                     + (f"{g['speedup']:.4f}x [{g['ci_low']:.4f}, {g['ci_high']:.4f}]" if g else ""))
        for cell in (it.get("vs_base") or {}).get("cells") or []:
            if cell.get("speedup"):
                lines.append(f"    {cell['id']:<28} {cell['speedup']:.4f}x [{cell['ci_low']:.4f}, {cell['ci_high']:.4f}] "
                             f"{cell['verdict']}")
        goal("iter --from-sweep", it.get("status") == "keep", f"{it.get('status')} in {wall:.0f}s: {it.get('note', '')[:160]}")
    write(d / "summary.txt", "\n".join(lines) + "\n")
    write(d / "rows.json", json.dumps(rows, indent=1))
    print("\n".join(lines))
