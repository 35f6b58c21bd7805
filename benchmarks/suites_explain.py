"""benchmarks/run.py's evidence suite (issue 22): a varlen loop on FLA's chunk_delta_rule with the
profile-backed go and its report, then `flaloop sanitize` on the kept change and on planted defects
the gate does not see. FLA's code is never committed here: the edits are made in a copy of `.fla`."""

from __future__ import annotations

import json
import subprocess
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
from suites_sweep import CHUNK, keep_intermediates

WY = "fla/ops/delta_rule/wy_fast.py"
OOB = ("    b_beta = tl.load(p_beta, mask=m_t, other=0.0)\n    b_A = tl.load(p_A, mask=m_A, other=0.0)\n\n    for i_v",
       "    b_beta = tl.load(p_beta)\n    b_A = tl.load(p_A, mask=m_A, other=0.0)\n\n    for i_v")
UNINIT = ("        b_u = tl.dot(b_A.to(b_vb.dtype), b_vb, allow_tf32=False)\n",
          "        b_u = tl.dot(b_A.to(b_vb.dtype), b_vb, allow_tf32=False)\n"
          "        b_u += 0 * tl.load(p_u, mask=m_v, other=0.0).to(b_u.dtype)\n")
RACE_KERNEL = '''

from triton.experimental import gluon as _gluon
from triton.experimental.gluon import language as _gl


@_gluon.jit
def _stage_through_smem(x, y, N: _gl.constexpr):
    # each thread writes 4 neighbours and reads back 4 strided ones: no barrier in between
    wr: _gl.constexpr = _gl.BlockedLayout([4], [32], [4], [0])
    rd: _gl.constexpr = _gl.BlockedLayout([1], [32], [4], [0])
    smem = _gl.allocate_shared_memory(_gl.float32, [N], _gl.SwizzledSharedLayout(1, 1, 1, [0]))
    smem.store(_gl.load(x + _gl.arange(0, N, layout=wr)))
    _gl.store(y + _gl.arange(0, N, layout=rd), smem.load(rd))
'''
RACE_CALL = ("    return o, A, final_state, (w, u, h, v_new)\n",  # the forward as the kept change left it
             "    _buf = torch.ones(512, device=q.device, dtype=torch.float32)\n"
             "    _stage_through_smem[(1,)](_buf, torch.empty_like(_buf), N=512, num_warps=4)\n"
             "    return o, A, final_state, (w, u, h, v_new)\n")


def _edit(repo: Path, rel: str, old: str, new: str) -> str:
    p = repo / rel
    src = p.read_text()
    if src.count(old) != 1:
        raise RuntimeError(f"cannot plant in {rel}: {old.strip()[:60]!r} found {src.count(old)} times")
    p.write_text(src.replace(old, new))
    return src


VARLEN_FWD = f"{SMALL}_varlen16/fwd"  # the packed cell: its last sequence ends inside a chunk


def _sanitize(ctx: Ctx, repo: Path, name: str, tools: list[str], env: dict, lines: list[str],
              cells: list[str], extra: tuple[str, ...] = ()) -> dict:
    args = ["sanitize", OP, "--repo", str(repo), "--json", *extra]
    for t in tools:
        args += ["--tool", t]
    for c in cells:
        args += ["--cell", c]
    code, wall, doc = run(ctx, args, ctx.out / "evidence" / f"sanitize-{name}", env=env)
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

    # compute-sanitizer on each planted defect, with its tool, on one cell
    for name, rel, (old, new), tool, rule in (
            ("oob-read", WY, OOB, "memcheck", "sanitizer-memcheck"),
            ("uninit-read", WY, UNINIT, "initcheck", "sanitizer-initcheck")):
        if ctx.left() < 120:
            lines.append(f"sanitize {name}: skipped, the deadline is near")
            continue
        before = _edit(repo, rel, old, new)
        try:
            r = _sanitize(ctx, repo, name, [tool], env, lines, [VARLEN_FWD])
            goal(f"sanitize {name}", rule in r["rules"], f"exit {r['code']} in {r['wall']:.0f}s, findings {r['rules']}")
        finally:
            (repo / rel).write_text(before)
    if ctx.left() > 150:
        before = _edit(repo, CHUNK, *RACE_CALL)
        _edit(repo, CHUNK, "\ndef chunk_delta_rule_fwd(", RACE_KERNEL + "\n\ndef chunk_delta_rule_fwd(")
        try:
            r = _sanitize(ctx, repo, "smem-race", ["racecheck"], env, lines, [f"{SMALL}/fwd"])
            goal("sanitize smem-race", "sanitizer-racecheck" in r["rules"],
                 f"exit {r['code']} in {r['wall']:.0f}s, findings {r['rules']}")
        finally:
            (repo / CHUNK).write_text(before)
    if ctx.left() > 200:  # the planted read past the end: does FLA's own test see it?
        before = _edit(repo, WY, *OOB)
        try:
            code, wall, gdoc = run(ctx, ["gate", OP, "--repo", str(repo), "--json"], d / "gate-oob", env=env)
            lines.append(f"gate with the planted read past the end: exit {code} in {wall:.1f}s, green "
                         f"{((gdoc or {}).get('gate') or gdoc or {}).get('green')}")
        finally:
            (repo / WY).write_text(before)
    write(d / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
