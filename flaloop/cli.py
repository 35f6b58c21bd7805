"""Command line: one thin function per command; parsing and printing only.

Exit codes: 0 verdict delivered / gate green, 1 gate red or guard blocked, 2 usage or setup
error, 3 measurement failed, 130 interrupted. Every command takes --json for agents: then
stdout carries exactly one JSON document and human output goes to stderr.
"""

from __future__ import annotations

import functools
import json
import signal
import sys
from collections.abc import Callable
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flaloop import contract as contract_mod
from flaloop import gate as gate_mod
from flaloop.bench import session as session_mod
from flaloop.errors import FlaloopError, UsageError
from flaloop.target import Target

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Make GPU kernels faster without breaking or gaming correctness.")
# Not a terminal (CI, agents, pipes): rich would assume 80 columns and truncate paths.
# markup is off by default: test ids, diffs and messages are full of [brackets]. Literal styled
# strings opt in with markup=True and escape() whatever they interpolate.
out = Console(highlight=False, soft_wrap=True, markup=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False,
              width=None if sys.stderr.isatty() else 200)

RepoOpt = Annotated[str | None, typer.Option("--repo", help="Target checkout (default: the git root of the cwd).")]
PyOpt = Annotated[str | None, typer.Option("--python", help="Target's interpreter (default: this one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout, for agents.")]
WorkersOpt = Annotated[int, typer.Option("--workers", help="Run the gate over N pytest-xdist workers.")]
GpusOpt = Annotated[str | None, typer.Option("--gpus", help="With --workers: pin worker i to GPU i mod n, e.g. 0,1.")]


def command(fn: Callable) -> Callable:
    """Map FlaloopError to its exit code and message; survive Ctrl-C with exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except FlaloopError as exc:
            if as_json:
                print(json.dumps({"ok": False, "error": exc.message, "hint": exc.hint,
                                  "exit_code": exc.exit_code}))
            err.print(f"[bold red]error:[/] {escape(exc.message)}", markup=True)
            if exc.hint:
                err.print(f"  hint: {exc.hint}")
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:
            record = getattr(exc, "record_path", None)
            if as_json:
                print(json.dumps({"ok": False, "error": "interrupted", "exit_code": 130, "record": record}))
            err.print("interrupted: temporary worktrees and processes were cleaned up"
                      + (f"; the run record so far: {record}" if record else ""))
            raise typer.Exit(130) from None

    return wrapper


def _human(as_json: bool) -> Console:
    return err if as_json else out


# -- list ---------------------------------------------------------------------------------------

@app.command("list")
@command
def list_cmd(repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False) -> None:
    """List the target's ops with their import path and gate test file."""
    target = Target.discover(repo, python)
    ops = target.ops()
    if as_json:
        print(json.dumps({"ok": True, "root": str(target.root), "ops": [
            {**s.to_dict(), "test_file_exists": (target.root / s.test_file).is_file()} for s in ops]}))
        return
    table = Table(title=f"ops in {target.root}")
    for col in ("op", "import path", "gate test file", "from"):
        table.add_column(col)
    for s in ops:
        exists = (target.root / s.test_file).is_file()
        test = s.test_file if exists else f"{s.test_file} (missing)"
        table.add_row(s.name, f"{s.import_path}.{s.func_name}", test, s.source)
    out.print(table)


# -- init ---------------------------------------------------------------------------------------

@app.command("init")
@command
def init_cmd(
    op: str,
    target_speedup: Annotated[str, typer.Option("--target", help="Speedup goal, e.g. 1.2x.")] = "1.0x",
    shapes: Annotated[list[str] | None, typer.Option("--shapes", help="Registry shape names (repeatable).")] = None,
    base: Annotated[str, typer.Option("--base", help="Base git ref.")] = "HEAD",
    langs: Annotated[str, typer.Option("--langs", help="Allowed languages, comma separated.")] = "triton",
    modes: Annotated[str, typer.Option("--modes", help="Bench modes, comma separated.")] = "fwd,fwdbwd",
    inputs: Annotated[list[str] | None, typer.Option("--input", help="Override an input transform: k=l2norm.")] = None,
    varlen: Annotated[bool, typer.Option("--varlen", help="Bench a packed cu_seqlens variant of each shape too.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing contract.")] = False,
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Write the task contract: docs/draft.md and contract.json under profile/<op>-opt/."""
    target = Target.discover(repo, python)
    spec = target.op(op)
    target.test_path(spec)
    shape_list = [s for item in (shapes or []) for s in item.split(",") if s]
    c = contract_mod.create(
        target, spec, base_ref=base, speedup=contract_mod.parse_speedup(target_speedup),
        shapes=shape_list or None, langs=[x for x in langs.split(",") if x],
        modes=[x for x in modes.split(",") if x], overrides=contract_mod.parse_overrides(inputs or []),
        varlen=varlen)
    cpath, dpath = contract_mod.write(target, c, force)
    if as_json:
        print(json.dumps({"ok": True, "contract": str(cpath), "draft": str(dpath), **c.to_dict()}))
        return
    out.print(f"contract for [bold]{escape(c.op)}[/]: {escape(c.import_path)}.{escape(c.func_name)} "
              f"in {escape(c.entry_file)}", markup=True)
    out.print(f"  signature: {c.signature}")
    out.print(f"  base: {c.base_ref} = {c.base_commit[:12]}   target: {c.target_speedup:g}x   "
              f"shapes: {', '.join(c.shapes) or '(none)'}")
    table = Table(title="frozen set (hashed at the base commit)")
    table.add_column("file")
    table.add_column("why")
    table.add_column("sha256")
    for f in c.frozen:
        table.add_row(f.path, f.reason, f.sha256[:12])
    out.print(table)
    out.print(f"wrote {cpath.relative_to(target.root)} and {dpath.relative_to(target.root)} "
              f"(git ignores {cpath.parent.relative_to(target.root)}/)")


# -- gate ---------------------------------------------------------------------------------------

def _progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[last]}"), console=console, transient=True)


@app.command("gate")
@command
def gate_cmd(
    op: str,
    k_expr: Annotated[str | None, typer.Option("-k", help="pytest -k subset: a signal only, never a gate.")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Kill pytest after this many seconds.")] = None,
    workers: WorkersOpt = 0, gpus: GpusOpt = None,
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Run the op's frozen test file as a black box; exit 0 green, 1 red."""
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    result = run_gate_with_progress(target, c, k_expr, timeout, _human(as_json), workers, _gpu_list(gpus))
    if as_json:
        print(json.dumps({"ok": True, **result.to_dict()}, default=str))
    else:
        print_gate(result, out)
    raise typer.Exit(0 if result.green else 1)


def _gpu_list(gpus: str | None) -> list[str] | None:
    items = [g.strip() for g in (gpus or "").split(",") if g.strip()]
    bad = [g for g in items if not g.isdigit()]
    if bad:
        raise UsageError(f"--gpus {gpus!r}: {', '.join(bad)} is not a GPU index", "e.g. --gpus 0,1")
    return items or None


def run_gate_with_progress(target: Target, c, k_expr: str | None, timeout: float | None,
                           console: Console, workers: int = 0, gpus: list[str] | None = None) -> gate_mod.GateResult:
    _, stripped, _ = gate_mod.clean_env(target.extra_strip_env())
    for name, value in stripped.items():
        console.print(f"[yellow]removed {escape(name)}={escape(value)} from the gate's environment[/] "
                      f"(it weakens or steers the tests)", markup=True)
    if k_expr:
        console.print(f"[yellow]-k {escape(repr(k_expr))}: SIGNAL ONLY, this run never counts as a promotion gate[/]",
                      markup=True)
    with _progress_bar(console) as bar:
        tasks: dict[str, int] = {}

        def updater(label: str):
            def update(done: int, total: int, last: str) -> None:
                if label not in tasks:
                    tasks[label] = bar.add_task(label, total=None, last="")
                bar.update(tasks[label], completed=done, total=total or None, last=last.rsplit("::", 1)[-1][:60])
            return update

        return gate_mod.run_gate(target, c, k_expr=k_expr, progress=updater("candidate"),
                                 baseline_progress=updater(f"baseline at {c.base_commit[:8]}"), timeout=timeout,
                                 workers=workers, gpus=gpus)


def print_gate(r: gate_mod.GateResult, console: Console) -> None:
    label = "[bold green]GREEN[/]" if r.green else "[bold red]RED[/]"
    scope = f"  [yellow](signal only: -k {escape(repr(r.k_expr))})[/]" if r.signal_only else ""
    console.print(f"{label} gate {escape(r.op)}: {escape(r.test_file)}{scope}", markup=True)
    if r.run:
        n = r.run
        console.print(f"  {n.passed} passed, {n.failed} failed, {n.skipped} skipped, {n.errors} errors; "
                      f"{len(n.selected)} selected, {n.ran} ran; pytest exit {n.exit_code}; "
                      f"{n.junit_time:.1f}s in pytest, {r.wall_s:.1f}s wall")
    if r.baseline:
        how = {"collect": "collected, skip markers evaluated", "full": "full run"}.get(r.baseline.get("kind"), "")
        cached = ", cached" if r.baseline.get("cached") else ""
        console.print(f"  base {r.base_commit[:12]}: {len(r.baseline['selected'])} selected, "
                      f"{r.baseline['skipped']} skipped ({how}{cached})")
    tree = r.tree
    console.print(f"  tree: {tree['head'][:12]}{' + uncommitted ' + str(tree['diff_hash']) if tree['dirty'] else ''}")
    for f in r.findings:
        console.print(f"  [red]x[/] {escape(f.message)}", markup=True)
        if f.detail:
            for line in f.detail.splitlines()[:40]:
                console.print(f"      {line}")
    if r.log_path:
        console.print(f"  log: {r.log_path}")


# -- bench and verify ---------------------------------------------------------------------------

def _bench_config(modes: str | None, c, aa: bool, varlen: bool, min_pairs: int, max_pairs: int,
                  cell_seconds: float, half_width: float, margin: float, device: str, dtype: str,
                  inputs: list[str] | None, diff_tol: float, worker_timeout: float,
                  sample_ms: float, independent_tuning: bool = False, rounds: int = 2,
                  max_rounds: int = 4) -> session_mod.BenchConfig:
    if device not in ("auto", "cuda", "cpu"):
        raise UsageError(f"--device {device!r} is not one of auto, cuda, cpu")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype {dtype!r} is not one of bfloat16, float16, float32")
    if rounds < 1:
        raise UsageError(f"--rounds {rounds}: need at least 1 (2 or more let a per-process effect show)")
    if max_rounds < 0:
        raise UsageError(f"--max-rounds {max_rounds}: need 0 or more (at most --rounds: no extra rounds)")
    if min_pairs < 2 or max_pairs < min_pairs:
        raise UsageError(f"--min-pairs {min_pairs} / --max-pairs {max_pairs}: need 2 <= min-pairs <= max-pairs")
    return session_mod.BenchConfig(
        min_sample_ms=sample_ms,
        setup_timeout=worker_timeout, sample_timeout=min(worker_timeout, 300.0),
        modes=[m for m in (modes.split(",") if modes else c.modes) if m], aa=aa, varlen=varlen or c.varlen,
        min_pairs=min_pairs, max_pairs=max_pairs, cell_seconds=cell_seconds, half_width=half_width / 100,
        margin=margin / 100, device=device, dtype=dtype, diff_tol=diff_tol, shared_tuning=not independent_tuning,
        rounds=rounds, max_rounds=max(rounds, max_rounds),
        overrides=contract_mod.parse_overrides(inputs or []))


def _run_bench(target: Target, c, base: str | None, shapes: list[str] | None, cfg, console: Console,
               gate: dict | None) -> dict:
    shape_list = [s for item in (shapes or []) for s in item.split(",") if s] or None
    with _progress_bar(console) as bar:
        task = bar.add_task("warming up", total=None, last="")

        def on_event(kind: str, **info) -> None:
            if kind == "warm":
                bar.update(task, description="warm-up + correctness", completed=info["index"],
                           total=info["total"], last=info["cell"])
            elif kind == "round":
                bar.update(task, description=f"round {info['round']}/{info['rounds']}: fresh workers",
                           completed=0, total=None, last=f"{info['cells']} cell(s)")
            elif kind == "prime":
                bar.update(task, description="fresh workers to measure (the warm-up compiled or tuned)",
                           completed=0, total=None, last=f"{info['new_entries']} new cache entries")
            elif kind == "pair":
                bar.update(task, description=f"pairs {info['cell']}", completed=info["n"],
                           total=cfg.max_pairs, last=f"{info['kept']} kept")

        return session_mod.bench(target, c, base_ref=base, shapes=shape_list, cfg=cfg, on_event=on_event,
                                 gate=gate, command=" ".join(["flaloop", *sys.argv[1:]]))


def _last_gate_for(target: Target, op: str, tree: dict) -> dict | None:
    """The recorded gate result, when it was taken of exactly this tree state (HEAD + diff)."""
    last = gate_mod.last_result(target, op)
    if not last or {k: last["tree"].get(k) for k in ("head", "dirty", "diff_hash")} != \
            {k: tree.get(k) for k in ("head", "dirty", "diff_hash")}:
        return None
    return {k: last.get(k) for k in ("green", "signal_only", "started", "counts", "k_expr")}


def _fmt_ms(summary: dict | None) -> str:
    return "-" if not summary else f"{summary['median']:.4f}"


def print_bench(record: dict, console: Console) -> None:
    env = record.get("env") or {}
    cand = record["candidate"]
    dirty = f"+dirty:{cand['diff_hash']}" if cand.get("dirty") else ""
    parts = [env.get("device_name") or env.get("device") or "?"]
    parts += [f"{k} {env[key]}" for k, key in (("driver", "driver"), ("CUDA", "cuda"), ("torch", "torch"),
                                               ("triton", "triton")) if env.get(key)]
    parts += [f"base {record['base']['commit'][:12]}", f"candidate {'A/A' if record['aa'] else cand['head'][:12] + dirty}"]
    console.print(" | ".join(parts))
    if env.get("nvml") not in (None, "ok", "no GPU"):
        console.print(f"[yellow]no clock evidence: {escape(str(env['nvml']))}[/]", markup=True)
    last = record.get("last_gate")
    if record.get("unverified") and last:
        state = "GREEN" if last["green"] else "RED"
        scope = " (signal only, -k)" if last["signal_only"] else ""
        console.print(f"gate: not run by this command; the last gate of this exact tree state was {state}{scope} "
                      f"({last['started']})")
    elif record.get("unverified"):
        console.print("[bold red]UNVERIFIED: no correctness gate ran before this benchmark "
                      "(`flaloop verify` runs the gate first)[/]", markup=True)
    table = Table(title=f"{record['op']}: candidate vs base (device time per call, ms)")
    for col in ("shape", "mode", "timer", "base", "cand", "speedup", "95% CI", "verdict", "pairs", "eager base",
                "eager cand", "note"):
        table.add_column(col)
    for cell in record["cells"]:
        c, est, summ = cell["cell"], cell.get("estimate"), cell.get("summary") or {}
        note = cell.get("reason", "")
        if cell.get("launch_bound"):
            note = (note + " launch-bound (host > device)").strip()
        if cell.get("timer") == "cuda_eager":
            note = (note + " eager timing (no CUDA graph)").strip()
        if cell.get("rounds_disagree"):
            note = (note + " rounds differ beyond their CIs (" + ", ".join(
                f"{r['speedup']:.4f}x" for r in cell.get("rounds") or []) + ")").strip()
        if cell.get("tuning_differs"):
            note = (note + f" autotune picked differently for {len(cell['tuning_differs'])} kernel key(s)").strip()
        eager = summ.get("eager", {})
        table.add_row(
            c["shape_name"], c["mode"], cell.get("timer") or "-", _fmt_ms(summ.get("base")), _fmt_ms(summ.get("cand")),
            f"{est['speedup']:.4f}x" if est else "-",
            f"[{est['ci_low']:.4f}, {est['ci_high']:.4f}]" if est else "-",
            cell.get("verdict") or "-", f"{len(cell['pairs']) - cell['dropped_pairs']}/{len(cell['pairs'])}",
            _fmt_ms(eager.get("base")), _fmt_ms(eager.get("cand")), note)
    console.print(table)
    s = record.get("summary") or {}
    g = s.get("geomean")
    if g:
        console.print(f"geomean speedup {g['speedup']:.4f}x  95% CI [{g['ci_low']:.4f}, {g['ci_high']:.4f}]  "
                      f"worst {g.get('worst_cell_id')} {g['worst_speedup']:.4f}x  regressions {g['n_regressions']}  "
                      f"({s['n_measured']}/{s['n_cells']} cells measured)")
    if record.get("primed"):
        console.print(f"measured in fresh workers: the warm-up compiled or tuned "
                      f"({record['primed']['new_cache_entries']} new Triton cache entries)")
    if record.get("contested"):
        console.print(f"{len(record['contested'])} cell(s) whose rounds disagreed got extra rounds "
                      f"({len(record.get('rounds') or [])} rounds in all): {', '.join(record['contested'])}")
    differs = [(cell["cell"]["id"], d) for cell in record["cells"] for d in cell.get("tuning_differs") or []]
    if differs:
        how = ("tuning was shared, so these kernels differ in source between the sides, or their configs "
               "carry pre-hooks, which Triton does not cache"
               if (record.get("config") or {}).get("shared_tuning") else
               "each side tuned on its own (--independent-tuning): part of a difference may be tuning noise")
        console.print(f"[yellow]autotune chose differently on the two sides ({how}):[/]", markup=True)
        for cid, d in differs[:20]:
            console.print(f"  {cid}: {escape(d)}", markup=True)
    for e in record.get("errors", []):
        console.print(f"[red]worker failure:[/] {escape(e)}", markup=True)
    if record.get("path"):
        console.print(f"run record: {record['path']}")


def _bench_exit(record: dict) -> int:
    s = record.get("summary") or {}
    if s.get("n_blocked"):
        return 1
    if record.get("errors") or not s.get("n_measured"):
        return 3
    return 0


BaseOpt = Annotated[str | None, typer.Option("--base", help="Base git ref (default: the contract's base).")]
ShapesOpt = Annotated[list[str] | None, typer.Option("--shapes", help="Shape names (default: the contract's).")]
ModesOpt = Annotated[str | None, typer.Option("--modes", help="fwd,fwdbwd (default: the contract's).")]
VarlenOpt = Annotated[bool, typer.Option("--varlen", help="Add packed cu_seqlens cells.")]
RoundsOpt = Annotated[int, typer.Option(
    "--rounds",
    help="Fresh worker processes this many times, start order swapped each round; a FASTER/SLOWER "
         "verdict needs every round's estimate on its side of the margin.")]
MaxRoundsOpt = Annotated[int, typer.Option(
    "--max-rounds",
    help="Cells whose rounds still disagree get two more rounds at a time, up to this many in all "
         "(at most --rounds: none); each extra round may take a round's share of --cell-seconds.")]
TuningOpt = Annotated[bool, typer.Option(
    "--independent-tuning",
    help="Let each side autotune on its own, even kernels whose source is unchanged (default: tuned once, shared).")]
MinPairsOpt = Annotated[int, typer.Option(help="Pairs before the stopping rule may stop.")]
MaxPairsOpt = Annotated[int, typer.Option(help="Most pairs per cell.")]
CellSecondsOpt = Annotated[float, typer.Option(help="Time cap per cell.")]
HalfWidthOpt = Annotated[float, typer.Option(help="Stop at this CI half-width, percent.")]
MarginOpt = Annotated[float, typer.Option(help="SAME margin, percent.")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cuda or cpu.")]
DtypeOpt = Annotated[str, typer.Option(help="Input dtype.")]
InputsOpt = Annotated[list[str] | None, typer.Option("--input", help="Override a transform: k=l2norm.")]
DiffTolOpt = Annotated[float, typer.Option(help="Relative RMS error allowed between base and candidate.")]
WorkerTimeoutOpt = Annotated[float, typer.Option(help="Seconds a worker may take to answer (compile included).")]
SampleMsOpt = Annotated[float, typer.Option(help="Calibrate k so one timed sample lasts this long.")]


@app.command("bench")
@command
def bench_cmd(
    op: str, base: BaseOpt = None, shapes: ShapesOpt = None, modes: ModesOpt = None,
    aa: Annotated[bool, typer.Option("--aa", help="Base against itself: the self-check.")] = False,
    varlen: VarlenOpt = False, min_pairs: MinPairsOpt = 16, max_pairs: MaxPairsOpt = 400,
    cell_seconds: CellSecondsOpt = 60.0, half_width: HalfWidthOpt = 0.25, margin: MarginOpt = 0.5,
    device: DeviceOpt = "auto", dtype: DtypeOpt = "bfloat16", inputs: InputsOpt = None,
    diff_tol: DiffTolOpt = 0.005, worker_timeout: WorkerTimeoutOpt = 1800.0, sample_ms: SampleMsOpt = 10.0,
    independent_tuning: TuningOpt = False, rounds: RoundsOpt = 2, max_rounds: MaxRoundsOpt = 4,
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Paired, interleaved benchmark of the working tree against a base ref (no gate: see verify)."""
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    cfg = _bench_config(modes, c, aa, varlen, min_pairs, max_pairs, cell_seconds, half_width, margin, device,
                        dtype, inputs, diff_tol, worker_timeout, sample_ms, independent_tuning, rounds,
                        max_rounds)
    record = _run_bench(target, c, base, shapes, cfg, _human(as_json), gate=None)
    record["last_gate"] = _last_gate_for(target, op, record["candidate"])
    if as_json:
        print(json.dumps({"ok": True, **record}, default=str))
    else:
        print_bench(record, out)
    raise typer.Exit(_bench_exit(record))


@app.command("verify")
@command
def verify_cmd(
    op: str, base: BaseOpt = None, shapes: ShapesOpt = None, modes: ModesOpt = None,
    k_expr: Annotated[str | None, typer.Option("-k", help="Gate on a pytest -k subset (signal only).")] = None,
    no_gate: Annotated[bool, typer.Option("--no-gate", help="Skip the gate: the result is UNVERIFIED.")] = False,
    workers: WorkersOpt = 0, gpus: GpusOpt = None,
    varlen: VarlenOpt = False, min_pairs: MinPairsOpt = 16, max_pairs: MaxPairsOpt = 400,
    cell_seconds: CellSecondsOpt = 60.0, half_width: HalfWidthOpt = 0.25, margin: MarginOpt = 0.5,
    device: DeviceOpt = "auto", dtype: DtypeOpt = "bfloat16", inputs: InputsOpt = None,
    diff_tol: DiffTolOpt = 0.005, worker_timeout: WorkerTimeoutOpt = 1800.0, sample_ms: SampleMsOpt = 10.0,
    independent_tuning: TuningOpt = False, rounds: RoundsOpt = 2, max_rounds: MaxRoundsOpt = 4,
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Gate first, then the paired benchmark; never a benchmark on a red gate."""
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    console = _human(as_json)
    cfg = _bench_config(modes, c, False, varlen, min_pairs, max_pairs, cell_seconds, half_width, margin, device,
                        dtype, inputs, diff_tol, worker_timeout, sample_ms, independent_tuning, rounds,
                        max_rounds)
    gate_dict = None
    if no_gate:
        console.print("[bold red]--no-gate: NO correctness gate runs; this benchmark is UNVERIFIED and "
                      "must not be used as evidence of a win[/]", markup=True)
    else:
        result = run_gate_with_progress(target, c, k_expr, None, console, workers, _gpu_list(gpus))
        print_gate(result, console)
        gate_dict = result.to_dict()
        if not result.green:
            if as_json:
                print(json.dumps({"ok": True, "gate": gate_dict, "bench": None}, default=str))
            console.print("[red]gate is red: no benchmark is run on a red gate[/]", markup=True)
            raise typer.Exit(1)
    record = _run_bench(target, c, base, shapes, cfg, console, gate=gate_dict)
    if as_json:
        print(json.dumps({"ok": True, "gate": gate_dict, "bench": record}, default=str))
    else:
        print_bench(record, out)
    raise typer.Exit(_bench_exit(record))


@app.command("demo")
@command
def demo_cmd(
    keep: Annotated[str | None, typer.Option("--keep", help="Keep the scratch repo under this directory.")] = None,
) -> None:
    """Run the whole loop on the bundled example (examples/minifla) in a scratch git repo."""
    from pathlib import Path

    from flaloop.demo import run_demo

    run_demo(out, Path(keep).resolve() if keep else None)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # Ctrl-C and SIGTERM unwind the same way, so worktrees and workers are always cleaned up.
    # SIGINT is re-armed explicitly: a parent that ignores it (a background job of a script, an
    # xdist worker) would otherwise leave us deaf to the interrupt it forwards.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    app(prog_name="flaloop")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
