"""benchmarks/run.py's survey suite (issue 24): every op of the target's registry through `init` and
`bench --aa --quick` on one shape, fwd and fwdbwd, one row each: measured (estimate, CI, wall time)
or refused with the reason and hint flaloop printed. A row whose command ended in a traceback, or
in no readable answer, is a flaloop defect to turn into a clear message (`crash`).

One shape an op: the smallest of its registry shapes with at least 1,024 tokens (B*T), else the
smallest; a cell the base refuses for non-finite values is benched once more with the input
transforms that message names (`--input k=l2norm --input q=l2norm` where the op takes q and k).

A full survey of FLA's 24 ops does not fit one session's device time: FLALOOP_SURVEY_OPS (a comma
list) picks the ops of this run, and the rows are written as they come (OUT/survey/rows.jsonl), so
a run cut short keeps what it measured."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from harness import Ctx, fla_copy, goal, run, write

TOKENS_MIN = int(os.environ.get("FLALOOP_SURVEY_TOKENS_MIN", "1024"))  # a CPU try-out sets it lower
DOMAIN_FIX = ["--input", "k=l2norm", "--input", "q=l2norm"]
TRACEBACK = "Traceback (most recent call last)"


def dims(name: str) -> dict[str, int]:
    """B8_T1024_H8_D64 -> {B: 8, T: 1024, H: 8, D: 64}; L8_B1_T8K_D2K -> {..., T: 8192, D: 2048}."""
    out = {}
    for tok in name.split("_"):
        m = re.fullmatch(r"([A-Za-z]+)(\d+)([KkMm]?)", tok)
        if m:
            out[m[1]] = int(m[2]) * {"": 1, "k": 1024, "m": 1 << 20}[m[3].lower()]
    return out


def pick_shape(shapes: list[str]) -> str | None:
    """The smallest shape (by the product of its dimensions) with at least TOKENS_MIN tokens, else the smallest."""
    if not shapes:
        return None

    def size(s: str) -> float:
        return math.prod(dims(s).values()) or float("inf")

    def tokens(s: str) -> int:
        d = dims(s)
        return d.get("B", 1) * d.get("T", 0)
    big = [s for s in shapes if tokens(s) >= TOKENS_MIN]
    return min(big or shapes, key=size)


def _answer(out: Path, doc: dict | None, code) -> tuple[str | None, bool]:
    """(flaloop's error with its hint, whether it crashed: a traceback, or no JSON on a failure)."""
    err = out.with_suffix(".err").read_text(errors="replace") if out.with_suffix(".err").is_file() else ""
    crashed = TRACEBACK in err or (doc is None and code != 0)
    if doc and doc.get("error"):
        return f"{doc['error']}" + (f" (hint: {doc['hint']})" if doc.get("hint") else ""), crashed
    if crashed:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return f"exit {code}: {tail[0][:300]}", True
    return None, False


def _bench(ctx: Ctx, repo: Path, op: str, env: dict, d: Path, name: str) -> tuple:
    return run(ctx, ["bench", op, "--repo", str(repo), "--aa", "--quick", "--json"], d / f"bench-{name}", env=env)


def survey_op(ctx: Ctx, repo: Path, op: str, env: dict, d: Path) -> dict:
    row: dict = {"op": op, "status": None, "shape": None, "wall_s": 0.0, "cells": [], "why": None, "inputs": None}
    code, wall, doc = run(ctx, ["init", op, "--repo", str(repo), "--force", "--json"], d / f"init-{op}", env=env)
    row["wall_s"] += wall
    why, crashed = _answer(d / f"init-{op}", doc, code)
    if code != 0:
        row.update(status="crash" if crashed else "refused at init", why=why)
        return row
    shape = pick_shape(list((doc or {}).get("shapes") or []))
    params = {p["name"] if isinstance(p, dict) else str(p) for p in (doc or {}).get("parameters") or []}
    row["shape"] = shape
    extra: list[str] = []
    for attempt in range(2):
        args = ["init", op, "--repo", str(repo), "--force", "--json", "--modes", "fwd,fwdbwd", *extra]
        if shape:
            args += ["--shapes", shape]
        code, wall, doc = run(ctx, args, d / f"init-{op}-{attempt}", env=env)
        row["wall_s"] += wall
        if code != 0:
            why, crashed = _answer(d / f"init-{op}-{attempt}", doc, code)
            row.update(status="crash" if crashed else "refused at init", why=why)
            return row
        code, wall, doc = _bench(ctx, repo, op, env, d, f"{op}-{attempt}")
        row["wall_s"] += wall
        why, crashed = _answer(d / f"bench-{op}-{attempt}", doc, code)
        cells = [{"id": c["cell"]["id"], "verdict": c.get("verdict"), "status": c.get("status"),
                  "reason": (c.get("reason") or "")[:300],
                  **({k: c["estimate"].get(k) for k in ("speedup", "ci_low", "ci_high")} if c.get("estimate") else {})}
                 for c in (doc or {}).get("cells") or []]
        row["cells"], row["exit"] = cells, code
        domain = [c for c in cells if "outside the op's domain" in c["reason"]]
        if domain and not extra and {"q", "k"} <= params:
            extra = DOMAIN_FIX  # the fix that message names, once
            row["inputs"] = " ".join(DOMAIN_FIX)
            continue
        break
    measured = [c for c in cells if c.get("speedup")]
    if isinstance(code, str) and code.startswith("timeout"):
        row.update(status="cut by the deadline", why=f"{row['wall_s']:.0f} s spent")
    elif crashed:
        row.update(status="crash", why=why)
    elif measured and len(measured) == len(cells):
        row["status"] = "measured"
    elif measured:
        row.update(status="partly measured", why="; ".join(f"{c['id']}: {c['reason']}" for c in cells if not c.get("speedup")))
    else:
        row.update(status="refused", why=why or "; ".join(f"{c['id']}: {c['reason']}" for c in cells) or f"exit {code}")
    return row


def _md(rows: list[dict]) -> str:
    lines = ["| op | shape | status | cells (A/A estimate [95% CI]) | wall s | reason / inputs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = "<br>".join(f"{c['id'].split('/')[-1]} {c['speedup']:.4f}x [{c['ci_low']:.4f}, {c['ci_high']:.4f}]"
                            if c.get("speedup") else f"{c['id'].split('/')[-1]} {c.get('verdict') or c.get('status')}"
                            for c in r["cells"]) or "-"
        note = " ".join(x for x in (r.get("inputs") and f"needs `{r['inputs']}`", r.get("why")) if x) or ""
        lines.append(f"| `{r['op']}` | {r['shape'] or '-'} | {r['status']} | {cells} | {r['wall_s']:.0f} | "
                     f"{note.replace('|', '/')[:400]} |")
    return "\n".join(lines) + "\n"


def suite_survey(ctx: Ctx) -> None:
    repo = fla_copy(ctx, "survey")
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "survey"
    code, _, doc = run(ctx, ["list", "--repo", str(repo), "--json"], d / "list", env=env)
    ops = [o["name"] for o in (doc or {}).get("ops") or []]
    only = [o for o in os.environ.get("FLALOOP_SURVEY_OPS", "").split(",") if o]
    todo = [o for o in ops if not only or o in only]
    rows: list[dict] = []
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "rows.jsonl", "a") as fh:
        for op in todo:
            if ctx.left() < 120:
                rows.append({"op": op, "status": "not run (the deadline)", "shape": None, "wall_s": 0.0, "cells": [],
                             "why": None, "inputs": None})
                continue
            rows.append(survey_op(ctx, repo, op, env, d))
            fh.write(json.dumps(rows[-1]) + "\n")
            fh.flush()
    write(d / "survey.md", _md(rows))
    print(_md(rows))
    crashes = [r["op"] for r in rows if r["status"] == "crash"]
    goal("survey: no traceback", not crashes, f"crashed: {crashes}" if crashes else f"{len(rows)} op(s), none crashed")
    goal("survey: every op", len(todo) == len(ops) and all(not r["status"].startswith("not run") for r in rows),
         f"{sum(r['status'] == 'measured' for r in rows)} measured of {len(ops)} ops ({len(todo)} in this run)")
