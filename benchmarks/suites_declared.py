"""benchmarks/run.py's declared suite (issue 36, item 4): an op FLA exports but its registry lacks,
declared in flaloop.toml, through `init` and `bench --aa --quick` on real FLA (a repo that has a
registry): every cell measured, where before the base worker died on "Op ... not registered" (exit 3).
Then a declaration with a shape that does not parse: `init` says exit 2, naming the key.

chunk_log_linear_attn is declared as FLA's tests/ops/test_log_linear_attn.py draws its inputs: q and
k with one head, v and the gate with H, level_scales with L = log2(T) + 1 levels (a dimension of
each named shape), g = a * softplus(x - 4) with a in (-e, -1) (here -2), v scaled by that size of dt;
float32, as those tests run it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness import IDENTITY, Ctx, fla_copy, goal, run, say, write

OP = "chunk_log_linear_attn"
DECLARATION = f'''
[ops.{OP}]
import_path = "fla.ops.log_linear_attn"
test_file = "tests/ops/test_log_linear_attn.py"

[ops.{OP}.shapes]
B2_T4096_H8_D128 = {{ B = 2, T = 4096, H = 8, D = 128, L = 13 }}
B4_T2048_H16_D64 = {{ B = 4, T = 2048, H = 16, D = 64, L = 12 }}
T8192_H8_D64_packed = {{ H = 8, D = 64, L = 14, seqlens = [3000, 5192] }}

[ops.{OP}.inputs]
q = {{ shape = "B, T, 1, D" }}
k = {{ shape = "B, T, 1, D" }}
v = {{ shape = "B, T, H, D", transform = "scale:0.02" }}
g = {{ shape = "B, T, H", dtype = "float32", transform = ["add:-4", "softplus", "scale:-2"] }}
level_scales = {{ shape = "B, T, H, L" }}
'''


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                   env={**__import__("os").environ, **IDENTITY})


def suite_declared(ctx: Ctx) -> None:
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "declared"
    repo = fla_copy(ctx, "declared")
    (repo / "flaloop.toml").write_text(DECLARATION)
    _git(repo, "add", "flaloop.toml")
    _git(repo, "commit", "-qm", f"flaloop.toml: {OP}")
    say(f"declared: init {OP}")
    code, wall, doc = run(ctx, ["init", OP, "--repo", str(repo), "--force", "--json"], d / "init", env=env)
    goal("declared-init", code == 0, f"init {OP} (declared in flaloop.toml, not in FLA's registry): exit {code}, "
         f"shapes {(doc or {}).get('shapes')}, {wall:.0f} s" + (f": {(doc or {}).get('error')}" if code else ""))
    if code != 0:
        return
    say(f"declared: bench {OP} --aa --quick")
    code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--quick", "--dtype", "fp32", "--json"],
                          d / "bench", env=env)
    cells = (doc or {}).get("cells") or []
    rows = [f"{c['cell']['id']}: {c.get('status')} " + (f"{c['estimate']['speedup']:.4f}x [{c['estimate']['ci_low']:.4f}, "
                                                          f"{c['estimate']['ci_high']:.4f}]" if c.get("estimate") else
                                                          (c.get("reason") or "")[:200]) for c in cells]
    measured = [c for c in cells if c.get("estimate")]
    goal("declared-bench", code == 0 and cells and len(measured) == len(cells),
         f"bench --aa --quick of {OP}: exit {code}, {len(measured)}/{len(cells)} cells measured, {wall:.0f} s; "
         + "; ".join(rows))
    write(d / "cells.txt", "\n".join(rows) + "\n")
    (repo / "flaloop.toml").write_text(DECLARATION.replace('q = { shape = "B, T, 1, D" }', 'q = { shape = "B, T,, D" }'))
    code, _, doc = run(ctx, ["init", OP, "--repo", str(repo), "--force", "--json"], d / "init-bad", env=env)
    named = f"[ops.{OP}.inputs] q.shape does not parse" in str((doc or {}).get("error"))
    goal("declared-refusal", code == 2 and named, f"init of a shape that does not parse: exit {code}, "
         f"{(doc or {}).get('error')!r}, hint {(doc or {}).get('hint')!r}")
