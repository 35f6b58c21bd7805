"""benchmarks/run.py's suites that measure flaloop on FLA: machine, gate, A/A and slowdown, cycle, verify."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from harness import (  # benchmarks/ is the script's directory, first on sys.path
    OP,
    PAIRS,
    SHAPES,
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
from suites_tools import suite_selftest

# verify #3 runs only with this many seconds left: itself and the slowdown after it (on the H200 x2
# (docs/lab/2026-12-01-h200.md): verify #3 59.6 s, the slowdown phase 94 s)
VERIFY_THIRD_S = 170

# -- suites ---------------------------------------------------------------------------------------

def suite_machine(ctx: Ctx) -> None:
    d = ctx.out / "machine"
    run(ctx, ["nvidia-smi", "--query-gpu=index,name,uuid,driver_version,clocks.sm,clocks.max.sm,memory.total",
              "--format=csv"], d / "nvidia-smi", flaloop=False)
    run(ctx, [sys.executable, "-c", "import torch, triton, sys; print(sys.version); print('torch', torch.__version__, "
              "torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"], d / "versions",
        flaloop=False)
    run(ctx, ["git", "-C", str(ctx.fla), "log", "--oneline", "-1"], d / "fla", flaloop=False)


def suite_gate(ctx: Ctx) -> None:
    d = ctx.out / "gate"
    repo = fla_copy(ctx, "gate")
    cold_cache = ctx.work / "tc-gate-cold"
    shutil.rmtree(cold_cache, ignore_errors=True)
    init(ctx, repo, [SMALL])
    env = ctx.env(TRITON_CACHE_DIR=cold_cache, FLALOOP_TRITON_CACHE_DIR=cold_cache)
    code, cold, doc = run(ctx, ["gate", OP, "--repo", str(repo), "--json", "--regate"], d / "cold", env=env, timeout=900)
    counts = (doc or {}).get("counts") or {}
    n = len(ctx.gpus)
    goal("cold gate", code == 0 and cold <= 200 and n >= 2,
         f"{cold:.1f}s wall on {n} GPU(s), green={doc and doc.get('green')}, {counts.get('passed')}/{counts.get('selected')} "
         f"passed, {counts.get('time_s')}s inside pytest, workers {((doc or {}).get('run') or {}).get('workers')} (goal <= 200 s on 2 GPUs)")
    # warm: flaloop and plain pytest alternated twice, same file and xdist worker count; best of each
    warm, plain, inside, workers, code = [], [], [], 0, 0
    for i in range(2):
        c, w, doc = run(ctx, ["gate", OP, "--repo", str(repo), "--json", "--regate"], d / f"warm{i}", env=env, timeout=600)
        code = code or c
        warm.append(w)
        inside.append(((doc or {}).get("counts") or {}).get("time_s"))
        workers = len(((doc or {}).get("run") or {}).get("workers") or {})
        pyargs = [sys.executable, "-m", "pytest", "tests/ops/test_delta.py", "-q", "-p", "no:cacheprovider"]
        if workers:
            pyargs += ["-n", str(workers)]
        _, p, _ = run(ctx, pyargs, d / f"pytest{i}", cwd=repo, env={**env, "PYTHONPATH": str(repo)}, flaloop=False,
                      timeout=600)
        plain.append(p)
    goal("warm gate", code == 0 and min(warm) <= min(plain) + 5,
         f"flaloop gate {min(warm):.1f}s wall (runs {', '.join(f'{x:.1f}' for x in warm)}) vs plain pytest "
         f"{min(plain):.1f}s ({', '.join(f'{x:.1f}' for x in plain)}), alternated, same file, {workers or 'no'} xdist "
         f"workers; inside pytest {inside}s (goal: at most 5 s more than pytest)")
    code, reused, doc = run(ctx, ["gate", OP, "--repo", str(repo), "--json"], d / "reused", env=env)
    say(f"gate reused: {reused:.1f}s, reused_from={(doc or {}).get('reused_from')}")
    # keep the gate's kernels for the later suites (cache entries are content-addressed)
    subprocess.run(["cp", "-an", f"{cold_cache}/.", str(ctx.cache)], check=False)


def _bench_lane(ctx: Ctx, name: str, shapes: list[str], gpu: list[str], slowdown: bool, aa: bool = True) -> dict:
    """A/A and/or the planted slowdown on `shapes`, in its own FLA copy and Triton cache."""
    repo = fla_copy(ctx, f"bench-{name}")
    cache = ctx.work / f"tc-{name}"
    cache.mkdir(exist_ok=True)
    subprocess.run(["cp", "-an", f"{ctx.cache}/.", str(cache)], check=False)
    env = ctx.env(gpus=gpu, TRITON_CACHE_DIR=cache, FLALOOP_TRITON_CACHE_DIR=cache)
    init(ctx, repo, shapes)
    out = {}
    if aa:
        _, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", *PAIRS], ctx.out / "aa" / name, env=env)
        out["aa"] = record_of(doc)
    if slowdown:
        chunk = repo / "fla" / "ops" / "delta_rule" / "chunk.py"
        src = chunk.read_text()
        new, n = re.subn(r"(\n(\s+)return o, A, final_state\n)", r"\n\2o = o.mul(1.0)\1", src, count=1)
        if n != 1:
            raise RuntimeError("cannot plant the slowdown: `return o, A, final_state` not found")
        chunk.write_text(new)
        _, _, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--json", *PAIRS], ctx.out / "slowdown" / name, env=env)
        out["slow"] = record_of(doc)
        chunk.write_text(src)
    subprocess.run(["cp", "-an", f"{cache}/.", str(ctx.cache)], check=False)
    return out


def _lanes(ctx: Ctx, aa: bool) -> list[dict]:
    """The 12 cells' shapes split over the GPUs, one lane each."""
    import concurrent.futures as cf

    lanes = [[g] for g in ctx.gpus] or [[]]
    parts = [SHAPES[i::len(lanes)] for i in range(len(lanes))]
    with cf.ThreadPoolExecutor(len(lanes)) as pool:
        futs = [pool.submit(_bench_lane, ctx, f"lane{i}", parts[i], lanes[i], True, aa) for i in range(len(lanes))]
        return [f.result() for f in futs]


def suite_aa_slowdown(ctx: Ctx) -> None:
    """A/A and the planted slowdown on all 12 cells."""
    results = _lanes(ctx, aa=True)
    aa = [c for r in results for c in ((r.get("aa") or {}).get("cells") or [])]
    lines = ["A/A:"] + [ln for r in results for ln in cells_line(r.get("aa") or {})]
    write(ctx.out / "aa" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    aa_goal(aa, "bench --aa")
    slowdown_goal(ctx, results)


def suite_first_pair(ctx: Ctx) -> None:
    """The pairs next to a setup, on the two cells where the H200 showed them off (docs/lab/2026-12-01-h200.md):
    two A/As and the planted slowdown on one GPU. Per round: the settle pair and the first kept
    pair as cand-vs-base %, against the round's median pair."""
    shapes = [SMALL, "B4_T2048_H16_D128"]
    results = [_bench_lane(ctx, "first", shapes, ctx.gpus[:1], slowdown=True)]
    results.append(_bench_lane(ctx, "first2", shapes, ctx.gpus[:1], slowdown=False))  # warm: the first left its cache
    lines = []
    for i, rec in enumerate([results[0].get("aa"), results[0].get("slow"), results[1].get("aa")]):
        what = ("A/A #1", "slowdown", "A/A #2")[i]
        lines += [f"{what}:"] + cells_line(rec or {})
        for c in (rec or {}).get("cells") or []:
            settle = {s["round"]: s for s in (c.get("setup") or {}).get("settle") or []}
            for rnd in sorted({p["round"] for p in c.get("pairs") or []}):
                kept = [p for p in c["pairs"] if p["round"] == rnd and p.get("dropped") is None]
                pct = [100 * (p["cand_ms"] / p["base_ms"] - 1) for p in kept]
                st = settle.get(rnd + 1)
                lines.append(f"    {c['cell']['id']:26s} round {rnd + 1}: settle "
                             + (f"{st['order']} {100 * (st['cand_ms'] / st['base_ms'] - 1):+.2f}%" if st else "none")
                             + (f", first pair {kept[0]['order']} {pct[0]:+.2f}%, median {sorted(pct)[len(pct) // 2]:+.2f}%"
                                f" over {len(pct)}" if pct else ""))
    write(ctx.out / "first-pair" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))


def suite_slowdown(ctx: Ctx) -> None:
    """The planted slowdown alone (the A/A then comes from `verify --base HEAD` of the same code)."""
    slowdown_goal(ctx, _lanes(ctx, aa=False))


def slowdown_goal(ctx: Ctx, results: list[dict]) -> None:
    slow = [c for r in results for c in ((r.get("slow") or {}).get("cells") or [])]
    lines = ["planted slowdown:"] + [ln for r in results for ln in cells_line(r.get("slow") or {})]
    write(ctx.out / "slowdown" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    missed = [c["cell"]["id"] for c in slow if c.get("verdict") != "SLOWER"]
    goal("slowdown", len(slow) == 12 and not missed, f"SLOWER on {len(slow) - len(missed)}/12, not on {missed or 'none'}")


def aa_goal(aa: list[dict], source: str) -> None:
    measured = [c for c in aa if c.get("estimate")]
    worst = max((abs(1 / c["estimate"]["speedup"] - 1) * 100 for c in measured), default=float("nan"))
    loud = [c["cell"]["id"] for c in measured if c.get("verdict") in ("FASTER", "SLOWER")]
    flagged = [c["cell"]["id"] for c in aa if c.get("findings")]
    goal("A/A", len(measured) == 12 and worst <= 0.25 and not loud,
         f"({source}) worst |bias| {worst:.3f}% over {len(measured)}/12 cells, FASTER/SLOWER on {loud or 'none'}, "
         f"guard findings on {flagged or 'none'}")


def suite_cycle(ctx: Ctx) -> None:
    """One cell, 2 rounds, warm: the wall time of `flaloop bench` with each way of starting workers.
    Each mode runs until it is warm: the first run finds no fork server for its key and leaves one,
    the next may leave one that preloads more, the third forks from a settled one."""
    repo = fla_copy(ctx, "cycle")
    init(ctx, repo, [SMALL], modes="fwd")
    env = ctx.env(gpus=ctx.gpus[-1:])
    run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", "--no-forkserver"], ctx.out / "cycle" / "compile",
        env=env)
    lines, walls_by, default_label = [], {}, "default: fork server, full import"
    for label, flags, n in ((default_label, [], 3),
                            ("spawn, full import", ["--no-forkserver"], 1),
                            ("fork server, lean import", ["--import", "lean"], 3)):
        walls = []
        for i in range(n):
            _, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", *flags],
                               ctx.out / "cycle" / f"{label.split(':')[0].replace(' ', '').replace(',', '-')}{i}", env=env)
            rec = record_of(doc) or {}
            walls.append(wall)
            imports = [round(max(v or 0 for v in r.values()), 1) for r in rec.get("import_s") or []]
            lines.append(f"{label} #{i + 1}: {wall:.1f}s wall, slowest import per round {imports}, inner "
                         f"{rec.get('wall_s')}s, verdict {[c.get('verdict') for c in rec.get('cells') or []]}, "
                         f"fork server {_forkserver_line(rec)}, lean check {rec.get('lean_check')}")
            lines.append("    timeline: " + ", ".join(f"{w} {t}s" for w, t in rec.get("timeline") or []))
        walls_by[label] = walls
    write(ctx.out / "cycle" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    default = walls_by[default_label][-1]
    best = min(w[-1] for w in walls_by.values())
    goal("one-cell bench", default <= 15,
         f"default {default:.1f}s wall when warm (runs {walls_by[default_label]}), best mode "
         f"{best:.1f}s, spawned {walls_by['spawn, full import'][-1]:.1f}s (2 rounds, warm; goal <= 15 s)")


def suite_forked(ctx: Ctx) -> None:
    """The fork server on one GPU. A first bench learns the op's preload list (none remembered: its
    server preloads torch and triton); `clean` stops the servers, as 5 idle minutes would; the next
    bench finds none warm, starts one of the remembered list and forks its workers from it
    (`started`); the one after forks from the same. Then the gate of the unchanged tree on one
    test of the file (`-k`), twice: green, and how its pytest started (on a GPU the gate runs over
    xdist workers, which start fresh). The unseen-shapes check is off: its compiles are not the subject."""
    repo = fla_copy(ctx, "forked")
    init(ctx, repo, [SMALL], modes="fwd")
    fsdir = ctx.work / "fs-forked"
    shutil.rmtree(fsdir, ignore_errors=True)
    fsdir.mkdir(mode=0o700)
    env = ctx.env(gpus=ctx.gpus[-1:], FLALOOP_FORKSERVER_DIR=fsdir, TRITON_CACHE_DIR=ctx.cache,
                  FLALOOP_TRITON_CACHE_DIR=ctx.cache)
    lines = []
    for i, what in enumerate(("first (no preload list yet)", "cold (servers stopped)", "warm")):
        if i == 1:
            run(ctx, ["clean", OP, "--repo", str(repo), "--json"], ctx.out / "forked" / "clean", env=env)
        _, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", "--rounds", "2",
                                 "--max-rounds", "2", "--unseen-shapes", "0"], ctx.out / "forked" / f"bench{i}", env=env)
        rec = record_of(doc) or {}
        fs = (rec.get("env") or {}).get("forkserver") or {}
        imports = [round(max(v or 0 for v in r.values()), 1) for r in rec.get("import_s") or []]
        lines.append(f"bench {what}: {wall:.1f}s wall, used={fs.get('used')} started={fs.get('started')} "
                     f"preloaded={(fs.get('preload') or {}).get('n')} {fs.get('why') or ''}, slowest import per "
                     f"round {imports}, verdicts {[c.get('verdict') for c in rec.get('cells') or []]}")
        lines.append("    timeline: " + ", ".join(f"{w} {t}s" for w, t in rec.get("timeline") or []))
    k = "test_chunk and B4-T2048"
    greens = []
    for i in range(2):
        code, wall, doc = run(ctx, ["gate", OP, "--repo", str(repo), "--regate", "-k", k, "--json"],
                              ctx.out / "forked" / f"gate{i}", env=env, timeout=600)
        r = (doc or {}).get("run") or {}
        counts = (doc or {}).get("counts") or {}
        greens.append(code == 0 and bool((doc or {}).get("green")) and (counts.get("passed") or 0) >= 1)
        lines.append(f"gate -k '{k}' #{i + 1}: exit {code}, {wall:.1f}s wall, green={(doc or {}).get('green')}, "
                     f"findings {[f.get('message') for f in (doc or {}).get('findings') or []]}, forked={r.get('forked')} "
                     f"fresh_why={r.get('fresh_why')!r}, passed {counts.get('passed')}/{counts.get('selected')}")
    write(ctx.out / "forked" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    goal("unchanged tree's gate", len(greens) == 2 and all(greens), f"green on {sum(greens)}/2 runs of -k '{k}'")


def _forkserver_line(rec: dict) -> str:
    fs = (rec.get("env") or {}).get("forkserver") or {}
    return f"used={fs.get('used')} preloaded={len(fs.get('preload') or [])} {fs.get('why') or ''}".strip()


def _warm_caches(ctx: Ctx, repo: Path) -> None:
    """Compile what verify runs, all at once: the gate's kernels (a cold gate on every GPU) and
    the bench's (one short A/A round per cell, a shape a lane, lanes over the GPUs), into the
    shared Triton cache. What it takes is printed, not judged: the goals are about warm runs."""
    import concurrent.futures as cf

    def lane(i: int, shapes: list[str], gpu: str) -> float:
        r = fla_copy(ctx, f"warm{i}")
        init(ctx, r, shapes)
        _, wall, _ = run(ctx, ["bench", OP, "--repo", str(r), "--aa", "--json", "--rounds", "1", "--no-probes",
                               "--min-pairs", "6", "--max-pairs", "6"], ctx.out / "verify" / f"warm-bench{i}",
                         env=ctx.env(gpus=[gpu]))
        return wall

    gpus = ctx.gpus or [""]
    parts = [[shape] for shape in SHAPES]
    with cf.ThreadPoolExecutor(len(parts) + 2) as pool:
        gate = pool.submit(run, ctx, ["gate", OP, "--repo", str(repo), "--json", "--regate"],
                           ctx.out / "verify" / "warm-gate", env=ctx.env(), timeout=900)
        lanes = [pool.submit(lane, i, p, gpus[i % len(gpus)]) for i, p in enumerate(parts)]
        # the GPU tests judge no time, so they run here too rather than after (device time is scarce)
        tests = pool.submit(suite_selftest, ctx)
        code, gate_wall, _ = gate.result()
        walls = [f.result() for f in lanes]
        tests.result()
    say(f"caches warmed: cold gate on {len(gpus)} GPU(s) exit {code} in {gate_wall:.1f}s, bench lanes "
        f"{', '.join(f'{w:.1f}' for w in walls)}s")


def suite_verify(ctx: Ctx) -> None:
    """flaloop verify (defaults, as a user types it; an A/A too: the working tree is HEAD) against
    FLA's verify, all warm. The caches are warmed first (_warm_caches); the first verify spawns its
    workers and leaves a fork server, and the ones after it are the loop's steady state. Runs:
    ours twice, FLA's, ours once more; the goal takes our second against FLA's and prints all."""
    repo = fla_copy(ctx, "verify")
    init(ctx, repo, SHAPES)
    _warm_caches(ctx, repo)
    env = ctx.env()
    walls, codes, docs = [], [], []

    def ours(i: int) -> None:
        code, wall, doc = run(ctx, ["verify", OP, "--repo", str(repo), "--base", "HEAD", "--json", "--regate"],
                              ctx.out / "verify" / f"flaloop{i}", env=env)
        walls.append(wall)
        codes.append(code)
        docs.append(doc)

    ours(0)
    ours(1)
    code, theirs, _ = run(ctx, [sys.executable, "-m", "benchmarks.ops.verify", "--op", OP, "--base", "HEAD"],
                          ctx.out / "verify" / "fla", cwd=repo, env={**env, "PYTHONPATH": str(repo)}, flaloop=False)
    codes.append(code)
    if ctx.left() > VERIFY_THIRD_S:
        ours(2)
    else:
        say(f"verify #3 skipped: {ctx.left():.0f}s left, it needs {VERIFY_THIRD_S}s with what follows")
    lines = [f"FLA verify {theirs:.1f}s (exit {code})"]
    for i, (wall, doc) in enumerate(zip(walls, docs, strict=True)):
        rec = record_of(doc) or {}
        lines.append(f"flaloop verify #{i + 1}: {wall:.1f}s (exit {codes[i if i < 2 else 3]}), gate "
                     f"{((doc or {}).get('gate') or {}).get('wall_s')}s, bench {rec.get('wall_s')}s, fork server "
                     f"{_forkserver_line(rec)}, results crossed by {(rec.get('transfer') or {}).get('how')}")
        lines += cells_line(rec)
        lines.append("    timeline: " + ", ".join(f"{w} {t}s" for w, t in rec.get("timeline") or []))
        lines.append(f"    waited on: {rec.get('waited_s')}, probes {(rec.get('guard') or {}).get('probe_seconds')}s")
    write(ctx.out / "verify" / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    ours_warm = walls[1] if len(walls) > 1 else float("nan")
    cut = "" if all(c == 0 for c in codes) else f" (not measured: exits {codes})"
    goal("verify", not cut and ours_warm <= theirs,
         f"flaloop {ours_warm:.1f}s vs FLA {theirs:.1f}s, 12 cells, warm, {len(ctx.gpus)} GPU(s) (aim: half); "
         f"all of ours: {', '.join(f'{w:.1f}' for w in walls)}s{cut}")
    # every verify here is an A/A (the tree is HEAD) with the defaults; #1 only started its workers cold
    for i, doc in enumerate(docs, start=1):
        aa_goal((record_of(doc) or {}).get("cells") or [], f"verify #{i} --base HEAD, defaults")
