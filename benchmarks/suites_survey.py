"""benchmarks/run.py's survey suite (issue 24): every op of the target's registry through `init` and
`bench --aa --quick` on one shape, fwd and fwdbwd, one row each: measured (estimate, CI, wall time)
or refused with the reason and hint flaloop printed. A row whose command ended in a traceback, or
in no readable answer, is a flaloop defect to turn into a clear message (`crash`).

One shape an op: the smallest of its registry shapes with at least 1,024 tokens (B*T), else the
smallest; a cell the base refuses for non-finite values is benched again with the input transforms
that message names (DOMAIN_FIXES: `--input k=l2norm --input q=l2norm` where the op takes q and k,
then `--input a=l2norm --input b=neg:a` where it takes a and b).

FLALOOP_SURVEY_OPS (a comma list) picks the ops of a run, FLALOOP_SURVEY_LANES how many run at once
(FLA's 20 ops at `bc3b101d` took 823 s in 6 lanes on one H200, 2026-12-02), and the rows are written as
they come (OUT/survey/rows.jsonl), so a run cut short keeps what it measured."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import re
import threading
from pathlib import Path

from harness import Ctx, fla_copy, goal, run, say, served_backends, write

TOKENS_MIN = int(os.environ.get("FLALOOP_SURVEY_TOKENS_MIN", "1024"))  # a CPU try-out sets it lower
# Ops surveyed at once on the one GPU (FLALOOP_SURVEY_LANES): a cold op's time is mostly Triton
# compiling and autotuning on the CPU, which lanes spread over the machine's cores; each op is then
# benched again alone while the deadline allows, and that A/A is the one the table shows (its first,
# contended, is kept in the row); a row the deadline left contended says so.
LANES = max(1, int(os.environ.get("FLALOOP_SURVEY_LANES", "1")))
# The input transforms a cell the base refuses for non-finite values is benched with, in turn and
# cumulatively, where the op takes those inputs: normalized queries and keys (the delta rules), then
# DPLR's tied pair as FLA's tests draw it (a l2-normalized, b = -a)
DOMAIN_FIXES = ((("q", "k"), ["--input", "k=l2norm", "--input", "q=l2norm"]),
                (("a", "b"), ["--input", "a=l2norm", "--input", "b=neg:a"]))
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
    fixes = [args for names, args in DOMAIN_FIXES if set(names) <= params]
    for attempt in range(len(fixes) + 1):
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
        cells = _cells(doc)
        row["cells"], row["exit"], row["served"], row["contention"] = cells, code, served_backends(doc), _contention(doc)
        domain = [c for c in cells if "outside the op's domain" in c["reason"]]
        if domain and attempt < len(fixes):
            extra = extra + fixes[attempt]  # the kind of fix that message names, the next one
            row["inputs"] = " ".join(extra)
            continue
        break
    _judge(row, code, cells, why, crashed)
    row["bench"] = f"bench-{op}-{attempt}"
    return row


def _cells(doc: dict | None) -> list[dict]:
    return [{"id": c["cell"]["id"], "verdict": c.get("verdict"), "status": c.get("status"),
             "reason": (c.get("reason") or "")[:300],
             **({k: c["estimate"].get(k) for k in ("speedup", "ci_low", "ci_high")} if c.get("estimate") else {})}
            for c in (doc or {}).get("cells") or []]


def _contention(doc: dict | None) -> str | None:
    """The run's `env.contention` state: contended, exclusive, or unknown."""
    return (((doc or {}).get("env") or {}).get("contention") or {}).get("state")


def _judge(row: dict, code, cells: list[dict], why: str | None, crashed: bool) -> None:
    measured = [c for c in cells if c.get("speedup")]
    row["why"] = None
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


def alone(ctx: Ctx, repo: Path, row: dict, env: dict, d: Path) -> dict:
    """The row's bench once more, alone on the GPU: its kernels compiled and tuned by the first one
    (run beside the other lanes', so contended), it measures the A/A the table shows."""
    op = row["op"]
    code, wall, doc = _bench(ctx, repo, op, env, d, f"{op}-alone")
    why, crashed = _answer(d / f"bench-{op}-alone", doc, code)
    row["lanes_cells"], row["lanes_wall_s"] = row["cells"], row["wall_s"]
    row["lanes_contention"] = row.get("contention")
    row["cells"], row["exit"], row["alone_wall_s"] = _cells(doc), code, wall
    row["served"], row["contention"] = served_backends(doc), _contention(doc)
    row["wall_s"] += wall
    _judge(row, code, row["cells"], why, crashed)
    return row


def _md(rows: list[dict]) -> str:
    lines = ["| op | shape | status | cells (A/A estimate [95% CI]) | backend | wall s | reason / inputs |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = "<br>".join(f"{c['id'].split('/')[-1]} {c['speedup']:.4f}x [{c['ci_low']:.4f}, {c['ci_high']:.4f}]"
                            if c.get("speedup") else f"{c['id'].split('/')[-1]} {c.get('verdict') or c.get('status')}"
                            for c in r["cells"]) or "-"
        shared = r.get("contention") == "contended"
        note = " ".join(x for x in (r.get("inputs") and f"needs `{r['inputs']}`", shared and "(contended)",
                                    r.get("why")) if x) or ""
        served = r.get("served") or {}
        names = {side: ", ".join(v) or "default" for side, v in served.items()}
        backend = ("-" if not names else names["base"] if names["base"] == names["cand"]
                   else f"base {names['base']}, cand {names['cand']}")
        lines.append(f"| `{r['op']}` | {r['shape'] or '-'} | {r['status']} | {cells} | {backend} | {r['wall_s']:.0f} | "
                     f"{note.replace('|', '/')[:400]} |")
    return "\n".join(lines) + "\n"


def suite_survey(ctx: Ctx) -> None:
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "survey"
    repos = [fla_copy(ctx, f"survey-{i}" if LANES > 1 else "survey") for i in range(LANES)]
    code, _, doc = run(ctx, ["list", "--repo", str(repos[0]), "--json"], d / "list", env=env)
    ops = [o["name"] for o in (doc or {}).get("ops") or []]
    only = [o for o in os.environ.get("FLALOOP_SURVEY_OPS", "").split(",") if o]
    todo = [o for o in ops if not only or o in only]
    rows: dict[str, dict] = {}
    d.mkdir(parents=True, exist_ok=True)
    fh = open(d / "rows.jsonl", "a")  # noqa: SIM115 - written from the lanes as rows come
    lock = threading.Lock()

    def keep(row: dict) -> None:
        with lock:
            rows[row["op"]] = row
            fh.write(json.dumps(row) + "\n")
            fh.flush()

    def lane(i: int) -> None:
        for op in todo[i::LANES]:
            if ctx.left() < 120:  # every op a row first; the benches alone take what time is left
                keep({"op": op, "status": "not run (the deadline)", "shape": None, "wall_s": 0.0, "cells": [],
                      "why": None, "inputs": None})
                continue
            try:
                keep({**survey_op(ctx, repos[i], op, env, d), "lane": i})
            except Exception as exc:  # noqa: BLE001 - one op's trouble must not cost the lane its other rows
                keep({"op": op, "status": "crash", "shape": None, "wall_s": 0.0, "cells": [], "inputs": None,
                      "why": f"the survey itself: {type(exc).__name__}: {exc}", "lane": i})

    with cf.ThreadPoolExecutor(LANES) as pool:
        for f in [pool.submit(lane, i) for i in range(LANES)]:
            f.result()
    if LANES > 1:  # the first benches ran beside each other: measure each again alone
        for op in todo:
            row = rows[op]
            if row.get("cells") and row["status"] != "crash" and ctx.left() > 60:
                try:
                    keep(alone(ctx, repos[row["lane"]], row, env, d))
                except Exception as exc:  # noqa: BLE001 - the contended row stands
                    say(f"survey: {op} alone: {type(exc).__name__}: {exc}")
    fh.close()
    ordered = [rows[op] for op in todo]
    write(d / "survey.md", _md(ordered))
    print(_md(ordered))
    crashes = [r["op"] for r in ordered if r["status"] == "crash"]
    goal("survey: no traceback", not crashes, f"crashed: {crashes}" if crashes else f"{len(ordered)} op(s), none crashed")
    goal("survey: every op", len(todo) == len(ops) and all(not r["status"].startswith("not run") for r in ordered),
         f"{sum(r['status'] == 'measured' for r in ordered)} measured of {len(ops)} ops ({len(todo)} in this run)")
