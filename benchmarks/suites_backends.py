"""benchmarks/run.py's backend suites (issue 24): FLA kernels in other languages through the loop.

- `gluon`: fused_attnres with FLA's Gluon backend (`FLA_ATTNRES_GLUON=1` for every command, so the
  gate, the baseline and both sides of every bench run it): init, baseline, one iteration with an
  honest change to the Gluon kernel (a wider forward autotuning space), the report; then the same
  tree Triton against Gluon (`bench --cand-env FLA_ATTNRES_GLUON=1`, the base with
  `FLA_ATTNRES_GLUON=0`). The summary says which backend served each side's calls (the setup
  records' `backends`).
- `tilelang`: parallel_attn with FLA's TileLang backend (`FLA_TILELANG=1`): the same steps, the
  honest change a deeper software pipeline in the TileLang forward kernel. tilelang is not on the
  GPU machine's image and its wheels (tilelang, apache-tvm-ffi, torch-c-dlpack-ext: 55 MB; z3-solver:
  29 MB) do not fit one transfer beside `.fla` (64 MB a call), so they travel over two calls to the
  same warm machine (benchmarks/stage_wheels.sh says how); the suite refuses, saying so, where
  `import tilelang` fails. Once tilelang imports, FLA turns TileLang on by default on Hopper with
  Triton >= 3.4, so the default path's side says `FLA_TILELANG=0`. tilelang 0.1.13 lowers one of
  FLA's test kernels (sliding window, varlen, head dim 64) in 5 of 8 fresh processes on the CPU
  (benchmarks/tilelang_lowering.py): a red gate at the base is run once more, and says so, since
  tilelang's kernel cache keeps a lowering that succeeded.
- FLALOOP_LOOP_ARGS: the bench arguments of every loop step in place of PAIRS and the spec's (a short lease).
- `backends`: both in one lease, their cold gates at once (`_prepare`), then each loop's measuring
  with the GPU to itself, Gluon first; TileLang where it imports (FLALOOP_TILELANG_WAIT seconds
  allowed for its wheels to arrive by a later transfer: the run starts with `.fla` and z3-solver).

FLA's code is never committed here: the suites edit copies of `.fla` under the work dir."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import Ctx, fla_copy, goal, run, say, served_backends, write

# fused_attnres: its registry shapes are layer shapes (L sources of [B, T, D]); the smallest of 1,024
# tokens or more, as the survey picked
GLUON = {"op": "fused_attnres", "env": {"FLA_ATTNRES_GLUON": "1"}, "shape": "L8_B1_T8K_D2K",
         "file": "fla/ops/attnres/backends/gluon.py", "backend": "gluon",
         # honest: the forward's autotuner may also pick 8 tokens a program (its smem prune still applies)
         "step": ("    for BT in [1, 2, 4]\n    for num_warps in [4, 8]\n]",
                  "    for BT in [1, 2, 4, 8]\n    for num_warps in [4, 8]\n]"),
         "why": "let the Gluon forward's autotuner pick 8 tokens a program", "inputs": [], "bench": []}
TILELANG = {"op": "parallel_attn", "env": {"FLA_TILELANG": "1"}, "shape": "B8_T1024_H8_D64",
            "file": "fla/ops/common/backends/tilelang/parallel_attn_fwd.py", "backend": "tilelang",
            # honest: three stages of the K/V pipeline instead of two where no sliding window is used
            "step": ("        num_stages=1 if USE_WINDOW else 2,\n", "        num_stages=1 if USE_WINDOW else 3,\n"),
            "why": "pipeline the TileLang forward's K/V loads three deep", "inputs": [],
            "nondeterministic_compile": "tilelang 0.1.13 lowers the sliding-window varlen forward in 5 of 8 "
                                        "fresh processes (benchmarks/tilelang_lowering.py)",
            # B, the heads and the head dims are compile-time constants of FLA's TileLang kernels: each
            # unseen shape is a fresh TileLang compile per kernel, so two of them, not the default four
            "bench": ["--unseen-shapes", "2"]}
PAIRS = ["--min-pairs", "8", "--max-pairs", "40", "--cell-seconds", "12"]


def _bench_args(spec: dict) -> list[str]:
    """The loop's bench arguments: PAIRS and the spec's, or FLALOOP_LOOP_ARGS in their place (a lease
    too short for the default pairs: the run's summary and records say which were used)."""
    return os.environ.get("FLALOOP_LOOP_ARGS", "").split() or [*PAIRS, *spec["bench"]]


def _by(backend: str, served: list[str]) -> bool:
    """Whether every call FLA's dispatch recorded (`"op -> backend"` entries) went to `backend`."""
    return bool(served) and all(s.rsplit(" -> ", 1)[-1] == backend for s in served)


def _loop_record(repo: Path, op: str, doc: dict | None) -> dict | None:
    """The bench record a `baseline --json` or `iter --json` answer points at (under profile/OP-opt/)."""
    it = (doc or {}).get("iteration") or {}
    rel = ((it.get("baseline") or {}).get("record") or (it.get("vs_base") or {}).get("record"))
    path = repo / "profile" / f"{op}-opt" / rel if rel else None
    return json.loads(path.read_text()) if path and path.is_file() else None


def _prepare(ctx: Ctx, spec: dict, name: str, lines: list[str]) -> Path | None:
    """A copy of FLA with the op's contract and a green gate recorded, or None (the reason in `lines`).

    The gate here is the one `baseline` would run: recorded green for this tree state, contract and
    environment, `baseline` reuses it. Run first, and for both backends at once (`suite_backends`), it
    keeps a cold gate's compiling (mostly CPU) off the time the benches have the GPU to themselves."""
    repo = fla_copy(ctx, name)
    subprocess.run(["git", "checkout", "-q", "-b", "flaloop-scratch"], cwd=repo, check=False)
    op, d = spec["op"], ctx.out / name
    env = ctx.env(gpus=ctx.gpus[:1], **spec["env"])
    code, wall, _ = run(ctx, ["init", op, "--repo", str(repo), "--force", "--target", "1.02x", "--modes", "fwd,fwdbwd",
                              "--shapes", spec["shape"], *spec["inputs"]], d / "init", env=env)
    lines.append(f"init: exit {code} in {wall:.1f}s")
    if code != 0:
        return None
    label = "gate (empty caches)"
    code, wall, doc = run(ctx, ["gate", op, "--repo", str(repo), "--json"], d / "gate", env=env)
    if code != 0 and spec.get("nondeterministic_compile"):
        lines.append(f"{label}: exit {code} in {wall:.1f}s at the base; run once more: "
                     f"{spec['nondeterministic_compile']}")
        label = "gate again (tilelang's kernel cache kept)"
        code, wall, doc = run(ctx, ["gate", op, "--repo", str(repo), "--json"], d / "gate-again", env=env)
    n = (doc or {}).get("counts") or {}
    red = "; ".join(f"{f.get('kind')}: {str(f.get('message'))[:300]}" for f in (doc or {}).get("findings") or [])
    lines.append(f"{label}: exit {code} in {wall:.1f}s; green {(doc or {}).get('green')}; passed "
                 f"{n.get('passed')}, failed {n.get('failed')}, skipped {n.get('skipped')} of {n.get('selected')}, "
                 f"pytest {n.get('time_s')}s" + (f"; {red}" if red else ""))
    if (doc or {}).get("oom_retry"):
        o = doc["oom_retry"]
        lines.append(f"  out of GPU memory beside other workers: {len(o['ids'])}, passed alone {len(o['passed_alone'])}")
    return repo if code == 0 else None


def _loop(ctx: Ctx, spec: dict, name: str, repo: Path, lines: list[str]) -> None:
    """baseline, one honest iteration, the report; then the backend against FLA's default path."""
    op, d = spec["op"], ctx.out / name
    env = ctx.env(gpus=ctx.gpus[:1], **spec["env"])
    # the base side with the backend switched off by its own variable, not by its absence: FLA turns some
    # backends on by default where they are installed (TileLang on Hopper with Triton >= 3.4)
    off = ctx.env(gpus=ctx.gpus[:1], **{k: "0" for k in spec["env"]})
    pairs = _bench_args(spec)
    lines.append(f"bench arguments: {' '.join(pairs)}")
    code, wall, doc = run(ctx, ["baseline", op, "--repo", str(repo), "--json", *pairs], d / "baseline", env=env)
    lines.append(f"baseline: exit {code} in {wall:.1f}s; served {served_backends(_loop_record(repo, op, doc))}")
    p = repo / spec["file"]
    src = p.read_text()
    if src.count(spec["step"][0]) != 1:
        lines.append(f"iter: cannot make the change ({spec['file']} changed)")
    else:
        p.write_text(src.replace(*spec["step"]))
        code, wall, doc = run(ctx, ["iter", op, spec["why"], "--repo", str(repo), "--json", *pairs], d / "iter", env=env)
        it = (doc or {}).get("iteration") or {}
        served = served_backends(_loop_record(repo, op, doc))
        lines.append(f"iter: exit {code} in {wall:.1f}s: {it.get('status')}; served {served}")
        goal(f"{name} loop", code in (0, 1) and bool(it.get("status")) and all(_by(spec["backend"], v) for v in served.values()),
             f"iteration {it.get('status')}, served {served}")
    dest = d / "report"
    code, wall, _ = run(ctx, ["report", op, "--repo", str(repo), "--json", "--out", str(dest)], dest / "report", env=env)
    lines.append(f"report: exit {code} in {wall:.1f}s")
    log = repo / "profile" / f"{op}-opt" / "OPT_LOG.md"
    if log.exists():
        shutil.copy(log, d / "OPT_LOG.md")
    # backend against backend: the same tree, FLA's default path against the backend (item 4)
    code, wall, doc = run(ctx, ["bench", op, "--repo", str(repo), "--base", "HEAD", "--json",
                                "--cand-env", *[f"{k}={v}" for k, v in spec["env"].items()], *pairs],
                          d / "cand-env", env=off)
    served = served_backends(doc)
    lines.append(f"--cand-env {spec['env']} (base {', '.join(f'{k}=0' for k in spec['env'])}): exit {code} in "
                 f"{wall:.1f}s; served {served}; verdicts "
                 f"{[(c['cell']['id'], c.get('verdict'), (c.get('estimate') or {}).get('speedup')) for c in (doc or {}).get('cells') or []]}")
    goal(f"{name} against the default path", _by(spec["backend"], served["cand"]) and not any(
        s.rsplit(" -> ", 1)[-1] == spec["backend"] for s in served["base"]),
         f"served {served}")


def _finish(ctx: Ctx, name: str, lines: list[str]) -> None:
    write(ctx.out / name / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))


def _backend_loop(ctx: Ctx, spec: dict, name: str) -> None:
    lines: list[str] = []
    repo = _prepare(ctx, spec, name, lines)
    if repo is not None:
        _loop(ctx, spec, name, repo, lines)
    _finish(ctx, name, lines)


def _tilelang_missing(ctx: Ctx, wait: float = 0.0) -> str | None:
    """Why tilelang cannot be imported here (its wheels not staged), or None; with `wait`, polls that
    long first (FLALOOP_TILELANG_WAIT: the wheels arrive by a later transfer while the run goes on)."""
    until = time.monotonic() + wait
    while True:
        probe = subprocess.run([sys.executable, "-c", "import tilelang; print(tilelang.__version__)"],
                               capture_output=True, text=True, env=ctx.env())
        if probe.returncode == 0:
            say(f"tilelang {probe.stdout.strip()}")
            return None
        if time.monotonic() >= until:
            break
        time.sleep(10)
    tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    say(f"tilelang: not importable here ({tail}); stage its wheels first (docs/BENCHMARKS.md)")
    goal("tilelang loop", False, f"tilelang is not importable: {tail}")
    return tail


def suite_gluon(ctx: Ctx) -> None:
    _backend_loop(ctx, GLUON, "gluon")


def suite_tilelang(ctx: Ctx) -> None:
    if _tilelang_missing(ctx) is None:
        _backend_loop(ctx, TILELANG, "tilelang")


def suite_backends(ctx: Ctx) -> None:
    """Both loops in one lease: the two cold gates at once (compiling, mostly on the CPU), then each
    loop's measuring alone on the GPU, Gluon first; TileLang only where it can be imported (waiting
    FLALOOP_TILELANG_WAIT seconds for it while the Gluon gate runs)."""
    specs = {"gluon": GLUON, "tilelang": TILELANG}
    lines: dict[str, list[str]] = {name: [] for name in specs}
    wait = float(os.environ.get("FLALOOP_TILELANG_WAIT", "0"))

    def prepare(name: str) -> Path | None:
        if name == "tilelang" and _tilelang_missing(ctx, wait):
            lines[name].append("not run: tilelang is not importable")
            return None
        return _prepare(ctx, specs[name], name, lines[name])

    with cf.ThreadPoolExecutor(len(specs)) as pool:
        prepared = {name: pool.submit(prepare, name) for name in specs}
        repos = {name: f.result() for name, f in prepared.items()}
    for name, spec in specs.items():
        if repos[name] is not None:
            _loop(ctx, spec, name, repos[name], lines[name])
        _finish(ctx, name, lines[name])
