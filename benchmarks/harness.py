"""The plumbing of benchmarks/run.py's suites: a run context, subprocesses with their output
saved, goal lines, FLA copies and contracts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OP = "chunk_delta_rule"
SHAPES = ["B1_T8192_H96_D128", "B2_T16384_H16_D128", "B4_T2048_H16_D128", "B4_T4096_H64_D128",
          "B8_T2048_H32_D256", "B8_T1024_H8_D64"]
SMALL = "B8_T1024_H8_D64"
PAIRS = ["--min-pairs", "16", "--max-pairs", "200", "--cell-seconds", "20"]
INPUTS = ["--input", "k=l2norm", "--input", "q=l2norm"]
IDENTITY = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost",
            "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@localhost"}
GOALS: list[str] = []


# -- plumbing -------------------------------------------------------------------------------------

class Ctx:
    def __init__(self, out: Path, work: Path, fla: Path, gpus: list[str], cache: Path, deadline: float):
        self.out, self.work, self.fla, self.gpus, self.cache, self.deadline = out, work, fla, gpus, cache, deadline

    def left(self) -> float:
        return max(1.0, self.deadline - time.time())

    def env(self, gpus: list[str] | None = None, **extra) -> dict:
        env = {**os.environ, **IDENTITY, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "PYTHONUNBUFFERED": "1", "FLALOOP_TRITON_CACHE_DIR": str(self.cache),
               "TRITON_CACHE_DIR": str(self.cache)}
        g = self.gpus if gpus is None else gpus
        if g:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g)
        env.update({k: str(v) for k, v in extra.items()})
        return env


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def goal(name: str, ok: bool, text: str) -> None:
    line = f"GOAL {name}: {'MET' if ok else 'NOT MET'}: {text}"
    GOALS.append(line)
    print(line, flush=True)


def run(ctx: Ctx, args: list[str], out: Path, *, cwd: Path | None = None, timeout: float | None = None,
        env: dict | None = None, flaloop: bool = True) -> tuple[int, float, dict | None]:
    """Run a command, stdout to OUT.json (parsed when JSON), stderr to OUT.err; (exit, wall s, doc)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flaloop", *args] if flaloop else args
    limit = min(timeout or 1e9, ctx.left())
    t0 = time.monotonic()
    with open(out.with_suffix(".json"), "w") as so, open(out.with_suffix(".err"), "w") as se:
        se.write("$ " + " ".join(cmd) + "\n")
        se.flush()
        p = subprocess.Popen(cmd, cwd=cwd or ROOT, env=env or ctx.env(), stdout=so, stderr=se, start_new_session=True)
        try:
            code = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGINT)  # flaloop writes its run record on the way out
            try:
                code = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                code = p.wait()
            code = f"timeout({code})"
    wall = time.monotonic() - t0
    try:
        doc = json.loads(out.with_suffix(".json").read_text())
    except (OSError, ValueError):
        doc = None
    say(f"{' '.join(args[:3])} ... exit {code} in {wall:.1f}s")
    return code, wall, doc


def fla_copy(ctx: Ctx, name: str) -> Path:
    dest = ctx.work / name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ctx.fla, dest, symlinks=True, ignore=shutil.ignore_patterns("profile", "__pycache__"))
    return dest


def init(ctx: Ctx, repo: Path, shapes: list[str], modes: str = "fwd,fwdbwd", extra: list[str] = ()) -> None:
    args = ["init", OP, "--repo", str(repo), "--force", "--target", "1.02x", "--modes", modes, *INPUTS, *extra]
    for s in shapes:
        args += ["--shapes", s]
    code, _, _ = run(ctx, args, ctx.out / "init" / f"init-{repo.name}")
    if code != 0:
        raise RuntimeError(f"init failed in {repo}")


def record_of(doc: dict | None) -> dict | None:
    """The bench record in a --json document (bench, verify, or a cut-short run's record file)."""
    if not doc:
        return None
    if "cells" in doc:
        return doc
    if isinstance(doc.get("bench"), dict):
        return doc["bench"]
    if doc.get("record") and Path(doc["record"]).is_file():
        return json.loads(Path(doc["record"]).read_text())
    return None


def served_backends(doc: dict | None) -> dict[str, list[str]]:
    """Which registered backends (FLA's `fla.ops.backends`) served calls on each side of a bench
    record, from its cells' setup records; empty lists: the op's default path served them."""
    out: dict[str, set] = {"base": set(), "cand": set()}
    for c in (doc or {}).get("cells") or []:
        for side in out:
            for family in (((c.get("setup") or {}).get(side) or {}).get("backends") or {}).values():
                out[side].update(str(x) for x in family.get("served") or [])
    return {side: sorted(v) for side, v in out.items()}


def cells_line(rec: dict) -> list[str]:
    lines = []
    for c in rec.get("cells") or []:
        est = c.get("estimate") or {}
        med = ((c.get("summary") or {}).get("base") or {}).get("median")
        rounds = " / ".join(f"{(1 / r['speedup'] - 1) * 100:+.2f}%" for r in c.get("rounds") or [])
        if est:
            lines.append(f"  {c['cell']['id']:<30} base {med:.4f} ms  cand-vs-base {(1 / est['speedup'] - 1) * 100:+.3f}% "
                         f"[{(1 / est['ci_high'] - 1) * 100:+.2f}, {(1 / est['ci_low'] - 1) * 100:+.2f}] "
                         f"{c['verdict']:<8} rounds {rounds}  k {c.get('k')}  pairs {len(c.get('pairs') or [])}  "
                         f"measuring {c.get('seconds', 0):.1f}s  floor {((c.get('roofline') or {}).get('pct_of_floor_cand') or 0):.0f}%")
        else:
            lines.append(f"  {c['cell']['id']:<30} {c.get('verdict')}: {(c.get('reason') or '')[:200]}")
    return lines


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
