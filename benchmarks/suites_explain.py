"""benchmarks/run.py's evidence suites (issue 22): `evidence`, a varlen loop on FLA's chunk_delta_rule
with the profile-backed go and its report and `flaloop sanitize` on the kept change; `plants`,
`flaloop sanitize` and the gate on defects planted in FLA; `reach`, benchmarks/sanitizer_reach.py.
FLA's code is never committed here: the edits are made in a copy of `.fla`."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from harness import (  # benchmarks/ is first on sys.path
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
from sanitizer_reach import GLUON_RACE, RACE_PTX, ptx_race
from suites_sweep import CHUNK, keep_intermediates

WY = "fla/ops/delta_rule/wy_fast.py"
# the row mask dropped from beta's load: the last sequence's partial chunk reads up to 63 rows past
# the end of beta (720 bytes on the varlen16 cell), into whatever tensor the driver put after it
OOB = ("    b_beta = tl.load(p_beta, mask=m_t, other=0.0)\n    b_A = tl.load(p_A, mask=m_A, other=0.0)\n\n    for i_v",
       "    b_beta = tl.load(p_beta)\n    b_A = tl.load(p_A, mask=m_A, other=0.0)\n\n    for i_v")
# each program reads the first element of its own block of u (torch.empty) before storing it: a
# few thousand bad reads, clamped and zeroed so garbage (a NaN too) never reaches the output
UNINIT = ("        b_u = tl.dot(b_A.to(b_vb.dtype), b_vb, allow_tf32=False)\n",
          "        b_u = tl.dot(b_A.to(b_vb.dtype), b_vb, allow_tf32=False)\n"
          "        b_u += 0 * tl.minimum(tl.maximum(tl.load(u + (bos*H + i_h) * V + i_t * BT * H * V)"
          ".to(tl.float32), -1.), 1.)\n")
# the race Gluon lets through (benchmarks/sanitizer_reach.py): shared memory read before its
# asynchronous copy is waited for; a plain store and load would get the compiler's barrier
GLUON_RACE_PLANT = ("\n\n" + GLUON_RACE + "\n\ndef _race(q):\n    _buf = torch.ones(512, device=q.device, dtype=torch.float32)\n"
                    "    _stage_async[(1,)](_buf, torch.empty_like(_buf), N=512, WAIT=False, num_warps=4)\n")
# the same race with no compiler in between: PTX that stores a slot and reads another warp's
PTX_RACE = (f"\n\nimport ctypes as _ctypes\n\nRACE_PTX = {RACE_PTX!r}\n\n\n{inspect.getsource(ptx_race)}\n\n"
            "def _race(q):\n    ptx_race(torch.zeros(128, device=q.device, dtype=torch.int32).data_ptr())\n"
            "    torch.cuda.synchronize()\n").replace("ctypes.", "_ctypes.")
RACE_CALL = ("\n    return o, A, final_state", "\n    _race(q)\n    return o, A, final_state")


def _edit(repo: Path, rel: str, old: str, new: str) -> str:
    p = repo / rel
    src = p.read_text()
    if src.count(old) != 1:
        raise RuntimeError(f"cannot plant in {rel}: {old.strip()[:60]!r} found {src.count(old)} times")
    p.write_text(src.replace(old, new))
    return src


VARLEN_FWD = f"{SMALL}_varlen16/fwd"  # the packed cell: its last sequence ends inside a chunk


def _sanitize(ctx: Ctx, repo: Path, name: str, tools: list[str], env: dict, lines: list[str],
              cells: list[str], extra: tuple[str, ...] = (), d: Path | None = None) -> dict:
    args = ["sanitize", OP, "--repo", str(repo), "--json", *extra]
    for t in tools:
        args += ["--tool", t]
    for c in cells:
        args += ["--cell", c]
    code, wall, doc = run(ctx, args, (d or ctx.out / "evidence") / f"sanitize-{name}", env=env)
    doc = doc or {}
    rules = sorted({f["rule"] for f in doc.get("findings") or []})
    lines.append(f"sanitize {name} ({', '.join(tools)}): exit {code} in {wall:.1f}s, blocked {doc.get('blocked')}, "
                 f"findings {rules}; cost {json.dumps(doc.get('cost'))[:400]}")
    for f in (doc.get("findings") or [])[:4]:
        lines.append(f"    {f['rule']} {f.get('cell')}: {f['message'][:300]}")
    for tool, t in (doc.get("tools") or {}).items():
        lines.append(f"    {tool}: {json.dumps({k: v for k, v in t.items() if k != 'errors'})[:400]}")
    return {"code": code, "wall": wall, "doc": doc, "rules": rules}


def suite_evidence(ctx: Ctx) -> None:
    repo = fla_copy(ctx, "evidence")
    init(ctx, repo, [SMALL], extra=["--varlen"])
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "evidence"
    lines: list[str] = []
    pairs = [*PAIRS[:-1], "12"]  # 12 s a cell, not 20: this suite has a session of device time to fit
    code, wall, doc = run(ctx, ["baseline", OP, "--repo", str(repo), "--json", *pairs], d / "baseline", env=env)
    lines.append(f"baseline: exit {code} in {wall:.1f}s")
    p = repo / CHUNK
    p.write_text(keep_intermediates(p.read_text()))
    code, wall, doc = run(ctx, ["iter", OP, "keep the forward's intermediates for the backward", "--repo", str(repo),
                                "--json", *pairs], d / "iter", env=env)
    it = (doc or {}).get("iteration") or {}
    vb = it.get("vs_base") or {}
    g = vb.get("geomean") or {}
    lines.append(f"iter: exit {code} in {wall:.1f}s: {it.get('status')} "
                 + (f"{g['speedup']:.4f}x [{g['ci_low']:.4f}, {g['ci_high']:.4f}] {vb.get('verdict')}" if g else ""))
    for c in vb.get("cells") or []:
        if c.get("speedup"):
            lines.append(f"    {c['id']:<34} {c['speedup']:.4f}x [{c['ci_low']:.4f}, {c['ci_high']:.4f}] {c['verdict']}")
    goal("varlen keep", it.get("status") == "keep" and bool(vb.get("varlen")),
         f"{it.get('status')}, varlen cells measured {vb.get('varlen')}")
    code, wall, ex = run(ctx, ["explain", OP, "--repo", str(repo), "--json"], d / "explain", env=env)
    ex = ex or {}
    t = ex.get("total") or {}
    lines.append(f"explain: exit {code} in {wall:.1f}s: blocked {ex.get('blocked')}, share "
                 + (f"{t['share']:.3f} [{t['share_low']:.3f}, {t['share_high']:.3f}] of {t['saved_ms']:.4f} ms" if t else "-"))
    for c in ex.get("cells") or []:
        top = ", ".join(f"{k['name'][:40]} {k['delta_ms']:+.4f} ms ({k['base_launches']:g}->{k['cand_launches']:g})"
                        for k in c["kernels"][:3])
        share = c.get("share")
        lines.append(f"    {c['id']:<34} saved {c.get('saved_ms') or 0:.4f} ms, kernels {c['kernel_base_ms']:.4f}->"
                     f"{c['kernel_cand_ms']:.4f} ms, share {'-' if share is None else f'{share:.3f}'}; {top}")
    # the kept commit under all four tools on every contract cell: the go reuses this run
    honest = _sanitize(ctx, repo, "honest", ["memcheck", "racecheck", "initcheck", "synccheck"], env, lines, [],
                       ("--commit", "HEAD", "--timeout", "200"))
    goal("sanitize honest", honest["code"] == 0 and not honest["doc"].get("blocked"),
         f"exit {honest['code']} in {honest['wall']:.0f}s, findings {honest['rules']}")
    code, wall, st = run(ctx, ["stop", OP, "--go", "--repo", str(repo), "--json"], d / "stop", env=env)
    data = ((st or {}).get("decision") or {}).get("data") or {}
    lines.append(f"stop --go: exit {code} in {wall:.1f}s; explanation {data.get('explanation')} "
                 f"share {data.get('explained_share')}; sanitize {data.get('sanitize')} {data.get('sanitizer_notes')}")
    if code != 0:
        lines.append(f"    {((st or {}).get('error') or '')[:600]}")
    goal("profile-backed go", code == 0 and data.get("explanation") is not None, f"exit {code}, share {data.get('explained_share')}")
    code, wall, rep = run(ctx, ["report", OP, "--repo", str(repo), "--json"], d / "report", env=env)
    lines.append(f"report: exit {code} in {wall:.1f}s; coverage {json.dumps((rep or {}).get('coverage'))[:300]}")
    ws = repo / "profile" / f"{OP}-opt"
    rd = d / "report-files"
    rd.mkdir(parents=True, exist_ok=True)
    for f in [*ws.glob("REPORT.md"), *ws.glob("*.png"), *ws.glob("report/*")]:
        subprocess.run(["cp", "-r", str(f), str(rd)], check=False)
    subprocess.run(["cp", str(ws / "OPT_LOG.md"), str(rd)], check=False)
    for e in ws.glob("explain/*/explain.json"):
        subprocess.run(["cp", str(e), str(rd / "explain.json")], check=False)

    write(d / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))


def _plant(repo: Path, edits: list[tuple[str, str, str]]) -> dict[str, str]:
    """Apply (file, old, new) edits; return the files' texts before, to put back."""
    before: dict[str, str] = {}
    for rel, old, new in edits:
        text = _edit(repo, rel, old, new)
        before.setdefault(rel, text)
    return before


PLANTS = [  # name, edits, the tool that should see it, its rule, the cell it runs on
    ("oob-read", [(WY, *OOB)], "memcheck", "sanitizer-memcheck", VARLEN_FWD),
    ("uninit-read", [(WY, *UNINIT)], "initcheck", "sanitizer-initcheck", VARLEN_FWD),
    ("smem-race-ptx", [(CHUNK, "\ndef chunk_delta_rule_fwd(", PTX_RACE + "\n\ndef chunk_delta_rule_fwd("),
                       (CHUNK, *RACE_CALL)], "racecheck", "sanitizer-racecheck", f"{SMALL}/fwd"),
    ("smem-race-gluon", [(CHUNK, "\ndef chunk_delta_rule_fwd(", GLUON_RACE_PLANT + "\n\ndef chunk_delta_rule_fwd("),
                         (CHUNK, *RACE_CALL)], "racecheck", "sanitizer-racecheck", f"{SMALL}/fwd"),
]


def suite_plants(ctx: Ctx) -> None:
    """`flaloop sanitize` on defects the gate does not see, each with its tool on one cell; then the
    gate on each plant while time is left (the first gate compiles FLA's test cold). No baseline:
    sanitize compares the working tree with the contract's base commit."""
    repo = fla_copy(ctx, "plants")
    init(ctx, repo, [SMALL], extra=["--varlen"])
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "plants"
    lines: list[str] = []
    only = [n for n in os.environ.get("FLALOOP_PLANTS", "").split(",") if n]  # a subset, by name
    for name, edits, tool, rule, cell in PLANTS:
        if only and name not in only:
            continue
        if ctx.left() < 120:
            lines.append(f"sanitize {name}: skipped, the deadline is near")
            continue
        before = _plant(repo, edits)
        try:
            r = _sanitize(ctx, repo, name, [tool], env, lines, [cell], ("--timeout", "240"), d)
            goal(f"sanitize {name}", rule in r["rules"], f"exit {r['code']} in {r['wall']:.0f}s, findings {r['rules']}")
        finally:
            for rel, text in before.items():
                (repo / rel).write_text(text)
    for name, edits, *_ in PLANTS[:3]:  # does FLA's own test see the plant?
        if only and name not in only:
            continue
        if ctx.left() < 420:
            lines.append(f"gate with {name}: skipped, the deadline is near")
            continue
        before = _plant(repo, edits)
        try:
            code, wall, gdoc = run(ctx, ["gate", OP, "--repo", str(repo), "--json"], d / f"gate-{name}", env=env)
            g = gdoc or {}
            lines.append(f"gate with {name}: exit {code} in {wall:.1f}s, green {g.get('green')}, "
                         f"counts {json.dumps(g.get('counts'))}")
            goal(f"gate blind to {name}", code == 0 and bool(g.get("green")), f"exit {code} in {wall:.0f}s")
        finally:
            for rel, text in before.items():
                (repo / rel).write_text(text)
    write(d / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))


def suite_reach(ctx: Ctx) -> None:
    """benchmarks/sanitizer_reach.py: what the installed compute-sanitizer sees on small kernels."""
    tools = os.environ.get("FLALOOP_REACH_TOOLS") or "memcheck,initcheck,racecheck"  # a subset, by tool
    code, wall, _ = run(ctx, [sys.executable, str(Path(__file__).with_name("sanitizer_reach.py")), "--out", str(ctx.out),
                              "--tools", tools],
                        ctx.out / "reach" / "reach", env=ctx.env(gpus=ctx.gpus[:1]), flaloop=False, timeout=900)
    rows = ctx.out / "sanitizer_reach" / "sanitizer_reach.json"
    lines = [f"reach: exit {code} in {wall:.1f}s"]
    if rows.is_file():
        for r in json.loads(rows.read_text()):
            lines.append(f"    {r['tool']} {r['case']} {r['arg']} {' '.join(r['flags']) or '(default)'}: exit {r['exit']} "
                         f"in {r['wall_s']}s, errors {r['errors']}" + (f", {r['gap']}" if r.get("gap") else ""))
    write(ctx.out / "reach" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
