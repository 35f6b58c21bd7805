#!/usr/bin/env python3
"""flaloop's benchmarks of itself: one entry point, named suites, goal lines.

Usage, on the GPU machine from the flaloop checkout with FLA carried as `.fla/`:

    python3 benchmarks/run.py SUITE [SUITE...] [--out DIR] [--fla .fla] [--gpus 0,1]
    python3 benchmarks/run.py h200 --background     # every suite, lanes over the GPUs, detached
    python3 benchmarks/run.py wait SECONDS          # follow a detached run, pack $OUT when done

On the device ($OUT set and the --out), a run in the foreground writes under --work and packs it into
$OUT/results.tgz as `wait` does: the device gives back 8 files of $OUT, 2 folders down.

Suites (each writes OUT/<suite>/ and prints `GOAL <name>: MET|NOT MET: ...` lines):
  machine   GPUs, driver, torch, triton
  gate      cold gate on every GPU (empty Triton cache, no baseline), warm gate, plain pytest
  aa        12-cell A/A of chunk_delta_rule (|bias| <= 0.25%, no FASTER/SLOWER)
  slowdown  a planted extra pass over the output: SLOWER on every cell
  cycle     one cell, 2 rounds, warm: wall time of `flaloop bench` (goal <= 15 s)
  forked    the fork server from cold on one GPU: a bench that starts one and the next bench; then the
            unchanged tree's gate on one test (-k), twice: green
  verify    `flaloop verify` (12 cells) against FLA's `benchmarks.ops.verify --base HEAD`, warm
  guard     planted cheats on FLA (patched elapsed_time, allow_tf32, naive delegation) and an
            honest autotune change: verdicts and findings; the probes' cost with and without
  faults    an out-of-bounds write, an OOM on the largest shape, a kernel that never returns:
            what flaloop printed, its exit codes, and the next command on that GPU
  loop      baseline, then three honest iterations, each logged and committed (OPT_LOG quoted)
  profile   `flaloop profile --ncu` on one cell (both Nsight Compute collections)
  report    `flaloop report` of the loop, copied to OUT/report (docs/examples/ material)
  selftest  the GPU-marked tests (pytest -m gpu)
  redteam   the red-team corpus's GPU entries (pytest -m gpu tests/redteam)
  sweep     `flaloop sweep` of three candidates (honest, neutral, guard-blocked), then `iter --from-sweep`
  integrity a bench beside another process's load (marked contended; --exclusive refuses), FLA's
            fix #988 undone (bench alone must block it on a shape it does not time), the guard's cost
  timed     the timed-call check's cost (share of a warm A/A) and a plant wrong only on the graph's
            replays after its proof (blocked by timed-call-differs alone), on FLA and (the GPU test) minifla
  replay    the test's own calls recorded by the gate at the base and replayed (a forged gate with a
            wrong kernel blocked at verify), the op's options nobody calls (an initial state halved
            blocked by bench), and what both cost an A/A, cold and warm
  l2        `bench --aa --l2 both`: hot and cold cells each within 0.25%, the flush's cost, cold / hot
  timer-load an A/A, a comment-only candidate and a patched-timer cheat alone, beside each other and
            beside a training loop: no honest bench blocked, the cheat blocked under every load; alone,
            the worker's bound event timer wrapped: blocked by timer-host-gap (the round trip)
  reach     compute-sanitizer on small kernels of known defects (benchmarks/sanitizer_reach.py);
            FLALOOP_REACH_TOOLS=racecheck (say) asks one tool's questions only
  plants    `flaloop sanitize` on defects planted in FLA (a read past the end, an uninitialized read,
            a shared-memory race in PTX and in Gluon), each with its tool, then the gate on each;
            FLALOOP_PLANTS=smem-race-ptx,... picks a subset
  survey    every op of the registry: init and bench --aa --quick on one shape, fwd and fwdbwd, one
            row each (measured, or refused with flaloop's reason); FLALOOP_SURVEY_OPS picks a subset,
            FLALOOP_SURVEY_LANES=N runs N ops at once, then each again alone while the deadline allows
  gluon     fused_attnres on FLA's Gluon backend: init, baseline, an honest change to the Gluon kernel,
            report; then the same tree Triton against Gluon (--cand-env FLA_ATTNRES_GLUON=1)
  tilelang  parallel_attn on FLA's TileLang backend the same way (tilelang staged as wheels first)
  backends  gluon and tilelang in one lease: both cold gates at once, then each loop alone on the GPU
  declared  chunk_log_linear_attn (not in FLA's registry) declared in flaloop.toml: init, bench --aa
            --quick (every cell measured), and a bad declaration refused at init (exit 2, the key named)
  model     `flaloop model` in FLA's DeltaNet LM: the A/A, the honest chunk_delta_rule change (step time
            measured beside the op share's prediction), the forward's state accumulator narrowed to bf16
  precision `precision-narrowed`'s bounds on FLA: chunked against recurrent forms at T=8192 in fp32 and
            fp16 under them, outputs rounded through bf16/fp16 above them, fp32 products TF32 or not
  evidence  a varlen loop (baseline, an honest iteration, explain, `flaloop sanitize` on the kept change,
            the profile-backed stop --go, report)

FLA's code is never committed here: the suites edit copies of `.fla` under the work dir.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from harness import (  # benchmarks/ is the script's directory, first on sys.path
    GOALS,
    ROOT,
    Ctx,
    say,
    write,
)
from suites_backends import suite_backends, suite_gluon, suite_tilelang
from suites_declared import suite_declared
from suites_explain import suite_evidence, suite_plants, suite_reach
from suites_integrity import suite_integrity, suite_l2, suite_timer_load
from suites_measure import (
    suite_aa_slowdown,
    suite_cycle,
    suite_first_pair,
    suite_forked,
    suite_gate,
    suite_machine,
    suite_slowdown,
    suite_verify,
)
from suites_model import suite_model
from suites_precision import suite_precision
from suites_replay import suite_replay
from suites_survey import suite_survey
from suites_sweep import suite_sweep
from suites_timed import suite_timed
from suites_tools import (
    suite_faults,
    suite_guard,
    suite_loop,
    suite_profile,
    suite_redteam,
    suite_report,
    suite_selftest,
    suite_smoke,
)

SUITES = {"smoke": suite_smoke, "machine": suite_machine, "gate": suite_gate, "aa": suite_aa_slowdown, "slowdown": suite_slowdown,
          "cycle": suite_cycle, "forked": suite_forked, "first-pair": suite_first_pair, "verify": suite_verify, "guard": suite_guard, "faults": suite_faults,
          "loop": suite_loop, "profile": suite_profile, "report": suite_report, "selftest": suite_selftest,
          "sweep": suite_sweep, "evidence": suite_evidence, "plants": suite_plants, "reach": suite_reach, "survey": suite_survey, "integrity": suite_integrity, "l2": suite_l2,
          "timer-load": suite_timer_load,
          "gluon": suite_gluon, "tilelang": suite_tilelang, "backends": suite_backends, "timed": suite_timed,
          "declared": suite_declared, "model": suite_model,
          "redteam": suite_redteam, "replay": suite_replay,
          "precision": suite_precision}
# The full H200 plan: the cold gate needs every GPU; then the A/A and the slowdown split over the
# GPUs; then the rest, in two lanes (the guard and faults lane, the loop lane); verify last.
# Each phase is a list of lanes (lists of suites); lane i runs on GPU i when there are several.
H200 = [[["machine", "gate"]], [["aa"]], [["cycle", "guard", "faults"], ["loop", "profile", "report"]],
        [["verify"]], [["selftest"]]]
# What fits in one session's device time after a smoke run: the cold and warm gate on both GPUs,
# then the guard and faults lane beside the loop lane, then the cycle times.
# One session's device time, most wanted first: the loop and the faults beside the cycle times,
# the gate on both GPUs, the slowdown (it also compiles every bench cell for verify), verify.
FINAL = [[["machine", "cycle", "faults"], ["loop", "profile", "report"]], [["gate"]], [["slowdown"]], [["verify"]]]
# What issue 10 still needs measured: the one-cell bench in each start mode (alone on the machine,
# so no other lane grows the shared Triton cache), the slowdown (which also compiles every cell's
# kernels), then verify against FLA's, whose flaloop side is also the 12-cell A/A.
CYCLE = [[["machine", "cycle"]], [["slowdown"]], [["verify"]]]
# verify against FLA's (its caches warmed first, at once: the cold gate on both GPUs beside the
# bench's lanes and the GPU tests), then the planted slowdown on the verify code's measuring path.
VERIFY = [[["machine", "verify"]], [["slowdown"]]]
VERIFY_ONLY = [[["machine", "verify"]]]
# Every goal line of issue 10 in one run: the cold gate on both GPUs and the warm gate, the one-cell
# bench, verify against FLA's with its A/As, the slowdown. On the H200 x2 at 4263982 (docs/lab/2026-12-01-h200.md)
# it ran 1,235 s: `--deadline 1480` and three `wait 560`.
GOALS_PLAN = [[["machine", "gate"]], [["cycle"]], [["verify"]], [["slowdown"]]]
PLANS = {"h200": H200, "h200-final": FINAL, "h200-cycle": CYCLE, "h200-verify": VERIFY, "h200-verify-only": VERIFY_ONLY,
         "h200-goals": GOALS_PLAN,
         # issue 36 on one GPU: the test's own calls recorded at the base and replayed, the options nobody calls
         "h200-replay": [[["machine", "replay"]]],
         # issue 21 on one GPU: the sweep of three candidates and `iter --from-sweep` (the new code),
         # then the 12-cell A/A and the planted slowdown on the redesigned bench
         "h200-sweep": [[["machine", "sweep"]], [["aa"]]],
         # issue 22 on one GPU: the varlen loop with its profile-backed go and report, and the sanitizer.
         # Its cold baseline alone ran past 1,030 s on one H200 (docs/lab/2026-12-01-h200.md, R12): give it a
         # device lease of its own, `--deadline 1700` and three `wait 560`.
         "h200-evidence": [[["machine", "evidence"]]],
         # issue 22's planted defects alone (no baseline): what compute-sanitizer can see on small
         # kernels (sanitizer_reach.py), then each FLA plant under its tool, then the gate on each
         "h200-plants": [[["machine", "reach", "plants"]]],
         # issue 24: every registry op through init and bench --aa --quick (FLALOOP_SURVEY_OPS: a subset)
         "h200-survey": [[["machine", "survey"]]],
         # issue 23 on one GPU: contention, --exclusive, #988 undone, the guard's cost (no gate: bench only),
         # then the A/A of hot and cold cells (`--l2 both`)
         "h200-integrity": [[["machine", "integrity", "l2"]]],
         "h200-l2": [[["machine", "l2"]]],
         # issue 37: the timed-call check's cost on a warm A/A, the capture-only plant on FLA, the GPU tests
         "h200-timed": [[["machine", "timed"]]],
         # issue 37 on one GPU: honest benches and a timer cheat alone, beside each other, beside training
         "h200-timer-load": [[["machine", "timer-load"]]],
         # issue 37 on one GPU: no honest block under load, then the red-team corpus's GPU entries
         "h200-load-redteam": [[["machine", "timer-load", "redteam"]]],
         # issue 24: FLA's Gluon backend of fused_attnres through the loop, then Triton against Gluon
         "h200-gluon": [[["machine", "gluon"]]],
         # issue 24: FLA's TileLang backend of parallel_attn the same way; its wheels staged first
         # (benchmarks/stage_wheels.sh says how: two transfers to the same warm machine)
         "h200-tilelang": [[["machine", "tilelang"]]],
         # issue 24: both in one session's device time, tilelang's wheels staged first (stage_wheels.sh); then,
         # while the deadline allows, the survey (FLALOOP_SURVEY_OPS: the gated ops, whose backward FLA serves
         # with TileLang once it imports, say)
         "h200-backends": [[["machine", "backends", "survey"]]],
         # issue 36: an op FLA's registry lacks, declared in flaloop.toml, through init and bench --aa --quick
         "h200-declared": [[["machine", "declared"]]],
         # issue 40 on one GPU: the model check's A/A, the honest change and the bf16-narrowed state in DeltaNet
         "h200-model": [[["machine", "model"]]],
         "h200-lite": [[["machine", "gate"]], [["guard", "faults"], ["loop", "profile", "report"]], [["cycle"]]]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="+")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/flaloop-out"))
    ap.add_argument("--work", default="/tmp/flaloop-bench")
    ap.add_argument("--fla", default=str(ROOT / ".fla"))
    ap.add_argument("--gpus", default=None, help="default: every GPU nvidia-smi lists")
    ap.add_argument("--deadline", type=float, default=1500, help="seconds for the whole run")
    ap.add_argument("--background", action="store_true", help="detach (setsid) and return; follow with `wait`")
    a = ap.parse_args(argv)
    out, work = Path(a.out), Path(a.work)
    if a.suites[0] == "wait":
        return wait(work, out, float(a.suites[1]) if len(a.suites) > 1 else 540)
    if a.background:
        work.mkdir(parents=True, exist_ok=True)
        # an earlier run's results on the same warm machine would read as this one's end to `wait`
        # (its goals.txt): set them aside, whole, under a name of their own
        if (work / "out").exists():
            (work / "out").rename(work / f"out-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        log = open(work / "run.log", "w")  # noqa: SIM115 - handed to the child
        args = [x for x in argv if x != "--background"] + ["--out", str(work / "out")]
        subprocess.Popen([sys.executable, __file__, *args], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        print(f"started in the background; log {work / 'run.log'}")
        return 0
    gpus = a.gpus.split(",") if a.gpus else [line.split(":")[0].split()[-1] for line in subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines() if line.startswith("GPU ")]
    packed = None
    if os.environ.get("OUT") and out.resolve() == Path(os.environ["OUT"]).resolve():
        # the device gives back 8 files of $OUT, 2 folders down: the run writes under the work dir and
        # packs it into $OUT at the end, also when stopped (`timeout -s INT`), as `wait` does
        packed, out = out, work / "out"
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run_plan(a, out, work, gpus)
    finally:
        if packed is not None:
            _pack(out, packed)


def _run_plan(a: argparse.Namespace, out: Path, work: Path, gpus: list[str]) -> int:
    cache = work / "tc-shared"
    cache.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out, work, Path(a.fla).resolve(), gpus, cache, time.time() + a.deadline)
    plan = PLANS[a.suites[0]] if a.suites[0] in PLANS else [[[name]] for name in a.suites]
    import concurrent.futures as cf

    for lanes in plan:
        say(f"phase {lanes} ({ctx.left():.0f}s left)")
        if len(lanes) > 1 and len(gpus) >= len(lanes):
            def lane(names, g):
                sub = Ctx(out, work, ctx.fla, g, cache, ctx.deadline)
                for n in names:
                    _safe(sub, n)
            with cf.ThreadPoolExecutor(len(lanes)) as pool:
                for f in [pool.submit(lane, names, [gpus[i]]) for i, names in enumerate(lanes)]:
                    f.result()
        else:
            for names in lanes:
                for n in names:
                    _safe(ctx, n)
    write(out / "goals.txt", "\n".join(GOALS) + "\n")
    print("\n".join(GOALS))
    return 0


def _pack(src: Path, out: Path) -> None:
    """`src` as OUT/results.tgz (unpacks to out/...), its goal lines beside it as goals.txt."""
    out.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        return
    with tarfile.open(out / "results.tgz", "w:gz") as tar:
        tar.add(src, arcname="out")
    if (src / "goals.txt").exists():
        shutil.copy(src / "goals.txt", out / "goals.txt")


def _safe(ctx: Ctx, name: str) -> None:
    if ctx.left() < 30:
        say(f"{name}: skipped, the deadline is near")
        return
    try:
        SUITES[name](ctx)
    except Exception as exc:  # noqa: BLE001 - one suite's failure must not lose the others' results
        say(f"{name}: FAILED: {type(exc).__name__}: {exc}")


def wait(work: Path, out: Path, limit: float) -> int:
    """Follow a detached run for at most `limit` s; copy what it has to OUT (at most 8 files)."""
    t0 = time.time()
    log = work / "run.log"
    while time.time() - t0 < limit and not (work / "out" / "goals.txt").exists():
        time.sleep(5)
    if log.exists():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, out / "run.log")
    src = work / "out"
    _pack(src, out)
    done = (src / "goals.txt").exists()
    print((log.read_text()[-6000:] if log.exists() else "no log") + ("\nALL DONE" if done else "\nSTILL RUNNING"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
