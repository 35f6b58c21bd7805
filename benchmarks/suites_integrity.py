"""benchmarks/run.py's integrity suite (issue 23) on FLA's chunk_delta_rule: a bench beside another
process on the same GPU (marked contended; refused with --exclusive; beside a light load, measured
and marked), FLA's fix #988 undone (a
kernel Triton miscompiles with 4 warps on Hopper, wrong only on shapes the bench does not time),
and what the guard's work costs a bench (probes, the self-check, the unseen shapes); `l2`, the A/A of
hot and cold cells (`--l2 both`); `timer-load`, honest candidates and a timer cheat alone, beside each
other and beside a training loop (issue 37: no honest change blocked under contention)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from harness import (  # benchmarks/ is first on sys.path
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
    write,
)
from suites_tools import GUARD_PLANTS, _plant

PAIRS = ["--min-pairs", "8", "--max-pairs", "40", "--cell-seconds", "10"]
WY = "fla/ops/delta_rule/wy_fast.py"
# FLA's fix restricted the kernel to 2 warps on Hopper; undone, its autotuner may pick 4
FIX_988 = ("NUM_WARPS = [2] if IS_NVIDIA_HOPPER else [2, 4, 8]\n", "NUM_WARPS = [4]\n")
# another user's job: matmuls on the same GPU for as long as the suite needs (argv: seconds, matrix
# size, pause between matmuls in s). The heavy one held the H200 at its power cap (2026-12-02), so
# every pair was dropped as throttled; the light one (small matmuls, mostly idle) is meant to leave
# the clock alone, so that the pairs are kept and marked (not yet run on the H200).
LOAD = ("import sys, time, torch\n"
        "n, pause = int(sys.argv[2]), float(sys.argv[3])\n"
        "a = torch.randn(n, n, device='cuda', dtype=torch.bfloat16)\n"
        "end = time.time() + float(sys.argv[1])\n"
        "while time.time() < end:\n"
        "    b = a @ a\n"
        "    torch.cuda.synchronize()\n"
        "    time.sleep(pause)\n")
HEAVY, LIGHT = (8192, 0.0), (1024, 0.005)


def _load(ctx: Ctx, seconds: float, kind: tuple[int, float] = HEAVY) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", LOAD, str(seconds), *map(str, kind)], env=ctx.env(gpus=ctx.gpus[:1]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(8)  # torch imported and the loop running
    return proc


def suite_integrity(ctx: Ctx) -> None:
    repo = fla_copy(ctx, "integrity")
    init(ctx, repo, [SMALL])
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "integrity"
    lines: list[str] = []

    # the guard's cost on an A/A of the contract's cells: first on an empty Triton cache (what a
    # baseline pays once: the unseen shapes' kernels compile and autotune), then warm (what each
    # later bench pays); the goal is on the warm one
    share = {}
    for state in ("cold", "warm"):
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", *PAIRS], d / f"aa-{state}", env=env)
        rec = record_of(doc) or {}
        inner = rec.get("wall_s") or wall
        probe = (rec.get("guard") or {}).get("probe_seconds") or 0.0
        unseen = (rec.get("unseen") or {}).get("seconds") or 0.0
        checks = [side.get("seconds") or 0.0 for c in rec.get("cells") or []
                  for r in (c.get("probes") or {}).get("self_check") or [] for side in (r.get("base") or {}, r.get("cand") or {})]
        share[state] = 100 * (probe + unseen) / max(inner, 1e-9)
        lines.append(f"A/A, {state} cache: exit {code} in {wall:.1f}s (bench {inner}s): probes and self-check {probe:.1f}s "
                     f"(self-check {sum(checks):.2f}s over {len(checks)} readings), unseen shapes {unseen:.1f}s: "
                     f"{share[state]:.1f}% of the bench; contention {(rec.get('env') or {}).get('contention')}")
        lines += cells_line(rec)
    goal("guard cost", share["warm"] <= 20, f"{share['warm']:.1f}% of a warm bench's wall time (goal <= 20%); "
         f"{share['cold']:.1f}% of the first, on an empty cache")

    # beside another process's matmuls: marked contended, and refused with --exclusive
    load = _load(ctx, 240)
    try:
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", *PAIRS], d / "shared", env=env)
        rec = record_of(doc) or {}
        cont = (rec.get("env") or {}).get("contention") or {}
        idle = (rec.get("env") or {}).get("idle") or {}
        lines.append(f"beside a load (pid {load.pid}): exit {code} in {wall:.1f}s; idle {idle.get('idle')} "
                     f"(visible {idle.get('processes_visible')}); contention {cont}")
        lines += cells_line(rec)
        # named by pid where NVML lists processes; on a blind list, seen as the device busy while ours idled
        seen = any(p["pid"] == load.pid for p in cont.get("processes") or []) or bool(cont.get("activity"))
        goal("contended", cont.get("state") == "contended" and seen,
             f"state {cont.get('state')}, {cont.get('contended')} of {cont.get('pairs')} pairs, "
             f"processes {cont.get('processes')}, activity {cont.get('activity')}")
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", "--exclusive",
                                    "--exclusive-wait", "20", *PAIRS], d / "exclusive", env=env)
        lines.append(f"--exclusive beside the load: exit {code} in {wall:.1f}s: {((doc or {}).get('error') or '')[:300]}")
        goal("exclusive refuses", code == 3, f"exit {code} in {wall:.0f}s")
    finally:
        load.kill()
        load.wait()

    # beside a light load: the clock stays up, so the pairs are measured, each marked contended
    load = _load(ctx, 120, LIGHT)
    try:
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", *PAIRS], d / "light", env=env)
    finally:
        load.kill()
        load.wait()
    rec = record_of(doc) or {}
    cont = (rec.get("env") or {}).get("contention") or {}
    measured = [c for c in rec.get("cells") or [] if c.get("estimate")]
    lines.append(f"beside a light load (pid {load.pid}): exit {code} in {wall:.1f}s; contention {cont}")
    lines += cells_line(rec)
    goal("contended, measured", cont.get("state") == "contended" and bool(measured)
         and len(measured) == len(rec.get("cells") or []),
         f"state {cont.get('state')}, {cont.get('contended')} of {cont.get('pairs')} pairs, "
         f"{len(measured)} of {len(rec.get('cells') or [])} cells measured")

    # FLA #988 undone: bench alone must block it, naming a shape it does not time
    p = repo / WY
    src = p.read_text()
    if src.count(FIX_988[0]) != 1:
        lines.append(f"#988: cannot undo it here ({WY} changed)")
    else:
        p.write_text(src.replace(*FIX_988))
        try:
            code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--json", *PAIRS], d / "fix988", env=env)
        finally:
            p.write_text(src)
        rec = record_of(doc) or {}
        found = [f for f in (rec.get("guard") or {}).get("findings") or [] if f.get("blocking")]
        lines.append(f"#988 undone: exit {code} in {wall:.1f}s, verdicts {[c.get('verdict') for c in rec.get('cells') or []]}")
        for f in found[:4]:
            lines.append(f"    {f['rule']} {f.get('cell')}: {f['message'][:300]}")
        lines += cells_line(rec)
        goal("#988 blocked by bench", code == 1 and any(f["rule"] == "unseen-shape-differs" for f in found),
             f"exit {code}, blocking rules {sorted({f['rule'] for f in found})}")
    write(d / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))


def suite_l2(ctx: Ctx) -> None:
    """`bench --aa --l2 both` on the contract's cells: a hot and a cold cell per shape and mode,
    each an A/A (|bias| <= 0.25%, SAME); the cold cells' flush cost and the cold/hot ratio of the
    base's medians (a flushed L2 cannot make a call faster)."""
    repo = fla_copy(ctx, "l2")
    init(ctx, repo, [SMALL])
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "l2"
    code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--l2", "both", "--json", *PAIRS],
                          d / "aa-both", env=env)
    rec = record_of(doc) or {}
    lines = [f"A/A --l2 both: exit {code} in {wall:.1f}s (bench {rec.get('wall_s')}s)"]
    lines += cells_line(rec)
    medians: dict[str, float] = {}
    worst = 0.0
    for c in rec.get("cells") or []:
        cid, est = c["cell"]["id"], c.get("estimate") or {}
        med = ((c.get("summary") or {}).get("base") or {}).get("median")
        if med:
            medians[cid] = med
        if est:
            worst = max(worst, abs(1 / est["speedup"] - 1))
        flush = ((c.get("setup") or {}).get("base") or {}).get("flush_ms")
        if flush:
            lines.append(f"    {cid}: flush {flush * 1e3:.1f} us per call, subtracted")
    for cid, hot in medians.items():
        if cid.endswith("/l2-hot") and (cold := medians.get(cid[:-len("hot")] + "cold")):
            lines.append(f"    {cid[:-len('/l2-hot')]}: cold {cold:.4f} ms / hot {hot:.4f} ms = {cold / hot:.3f}")
    same = [c.get("verdict") for c in rec.get("cells") or []]
    goal("l2 both A/A", code == 0 and bool(same) and all(v == "SAME" for v in same) and worst <= 0.0025,
         f"verdicts {same}, worst |bias| {worst * 100:.3f}% (goal <= 0.25%)")
    write(d / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))


# another user's training loop on the same GPU: an MLP's forward, backward and AdamW step, with a
# short pause so that the clock stays off its power cap and the pairs are kept (and marked)
TRAIN = ("import sys, time, torch\n"
         "m = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048))\n"
         "m = m.cuda().to(torch.bfloat16)\n"
         "opt = torch.optim.AdamW(m.parameters(), lr=1e-4)\n"
         "x = torch.randn(1024, 2048, device='cuda', dtype=torch.bfloat16)\n"
         "end = time.time() + float(sys.argv[1])\n"
         "while time.time() < end:\n"
         "    loss = m(x).float().pow(2).mean()\n"
         "    opt.zero_grad()\n"
         "    loss.backward()\n"
         "    opt.step()\n"
         "    torch.cuda.synchronize()\n"
         "    time.sleep(0.002)\n")
# the unseen shapes are not what this suite is about, and on an empty Triton cache they are most of a
# bench's time (219.5 s of the first A/A's 357.5 s on the H200, docs/BENCHMARKS.md): off
LOAD_PAIRS = ["--min-pairs", "8", "--max-pairs", "16", "--cell-seconds", "5", "--unseen-shapes", "0"]
COMMENT = ("fla/ops/delta_rule/chunk.py", None, "\n# a comment: the kernels are the base's\n")
HONEST_RULES = {"timer-wall-gap", "eager-disagrees", "below-floor"}


def _gap_lines(rec: dict) -> list[str]:
    """The timer-wall-gap statistics of each cell (guard/timing.py), also where nothing fired."""
    sys.path.insert(0, str(ROOT))
    from flaloop.bench.model import Pair
    from flaloop.guard import timing

    out = []
    for c in rec.get("cells") or []:
        pairs = [Pair.from_dict(p) for p in c.get("pairs") or []]
        got = timing.wall_gap_shift(pairs, c.get("k")) if c.get("timer") == "cuda_graph" else None
        if got is None:
            continue
        gap, rows = got[0], got[1]
        out.append(f"    {c['cell']['id']}: {gap.describe(1e3, 'gap excess')}; decisive {gap.decisive}, material "
                   f"{gap.material}; {sum(bool(p.foreign) for p in rows)} of {len(rows)} pairs contended")
    return out


def suite_timer_load(ctx: Ctx) -> None:
    """A/A, a comment-only candidate and a patched-timer cheat on chunk_delta_rule B8_T1024_H8_D64 fwd and
    fwdbwd: alone, the three benches beside each other on one GPU, and beside a training loop. Goals: no
    honest bench blocked anywhere (a `contended-unsure` warning is allowed and listed), the cheat
    blocked under every load. One GPU, a fresh Triton cache: estimated 5-7 min on an H200 (not yet run)."""
    t_start = time.monotonic()
    d = ctx.out / "timer-load"
    env = ctx.env(gpus=ctx.gpus[:1])
    repos = {}
    for name in ("aa", "comment", "cheat"):
        repos[name] = fla_copy(ctx, f"timer-load-{name}")
        init(ctx, repos[name], [SMALL])
    _plant(repos["comment"], *COMMENT)
    _plant(repos["cheat"], *GUARD_PLANTS["patched-timer"])
    lines: list[str] = []
    results: dict[tuple[str, str], tuple] = {}

    def bench(load: str, name: str) -> None:
        args = ["bench", OP, "--repo", str(repos[name]), "--json", *LOAD_PAIRS] + (["--aa"] if name == "aa" else [])
        code, wall, doc = run(ctx, args, d / load / name, env=env)
        results[(load, name)] = (code, wall, record_of(doc) or {})

    # alone, one after the other (the first compiles: the Triton cache starts empty)
    for name in ("comment", "aa", "cheat"):
        bench("alone", name)
    # beside each other: each bench's pairs list the other two as foreign processes
    threads = [threading.Thread(target=bench, args=("benches", n)) for n in ("comment", "aa", "cheat")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # beside a training loop
    train = subprocess.Popen([sys.executable, "-c", TRAIN, "400"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(8)  # torch imported and the loop running
    try:
        for name in ("comment", "aa", "cheat"):
            bench("training", name)
    finally:
        train.kill()
        train.wait()

    honest_ok, cheat_ok = [], []
    for (load, name), (code, wall, rec) in results.items():
        found = (rec.get("guard") or {}).get("findings") or []
        blocking = sorted({f["rule"] for f in found if f.get("blocking")})
        unsure = [f for f in found if f["rule"] == "contended-unsure" or
                  (f["rule"] in HONEST_RULES and not f.get("blocking"))]
        verdicts = [c.get("verdict") for c in rec.get("cells") or []]
        cont = (rec.get("env") or {}).get("contention") or {}
        lines.append(f"{load:<9} {name:<8} exit {code} in {wall:.1f}s, verdicts {verdicts}, blocking {blocking}, "
                     f"contention {cont.get('state')} ({cont.get('contended')} of {cont.get('pairs')} pairs)")
        lines += [f"    warning {f['rule']} {f.get('cell')}: {f['message'][:400]}" for f in unsure]
        lines += cells_line(rec) + _gap_lines(rec)
        if name == "cheat":
            cheat_ok.append(code == 1 and "timer-patched" in blocking and "BLOCKED" in verdicts)
        else:
            honest_ok.append(code != 1 and "BLOCKED" not in verdicts and bool(verdicts))
    total = time.monotonic() - t_start
    goal("honest never blocked under load", all(honest_ok) and len(honest_ok) == 6,
         f"{sum(honest_ok)} of 6 honest benches (A/A, comment-only; alone, beside benches, beside training) unblocked")
    goal("timer cheat blocked under load", all(cheat_ok) and len(cheat_ok) == 3,
         f"{sum(cheat_ok)} of 3 patched-timer benches blocked")
    goal("timer-load wall", total <= 480, f"{total:.0f}s (goal <= 480 s)")
    write(d / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
