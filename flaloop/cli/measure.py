"""`flaloop gate`, `flaloop bench` and `flaloop verify`: the frozen gate and the paired benchmark."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from flaloop.bench import evidence
from flaloop.bench import record as record_mod
from flaloop.bench import run as run_mod
from flaloop.bench.model import QUICK, BenchConfig
from flaloop.bench.record import RunRecord
from flaloop.bench.session import Cancelled
from flaloop.cli import fla_compat
from flaloop.cli.app import (
    LIST,
    FailOnOpt,
    JsonOpt,
    LockOptions,
    PyOpt,
    RepoOpt,
    app,
    command,
    command_line,
    config_options,
    emit_json,
    fail_on_exit,
    human,
    out,
    progress_bar,
    with_options,
)
from flaloop.cli.fla_compat import FlaVerifyFlags
from flaloop.core import git
from flaloop.core.errors import UsageError
from flaloop.diagnose.sanitizer import flow as sanitize_mod
from flaloop.report.compare import slower_in
from flaloop.report.terminal import print_bench, print_findings, print_gate
from flaloop.task import contract as contract_mod
from flaloop.task import gate as gate_mod
from flaloop.task import pytest_run
from flaloop.task.target import Target

# -- option groups (declared once, shared by the commands that take them) -----------------------

@dataclass
class GateOptions:
    workers: Annotated[int, typer.Option("--workers", help="Run the gate over N pytest-xdist workers (default: "
                                         "on a GPU up to 8 a GPU and one per two CPU cores; none without a GPU; "
                                         "1: one test at a time).")] = 0
    gpus: Annotated[str | None, typer.Option(
        "--gpus", metavar=LIST, help="GPUs to use, e.g. 0,1: the gate's xdist worker i runs on GPU i mod n; with several, "
                       "verify benches on the last one while the gate runs on the others.")] = None
    regate: Annotated[bool, typer.Option(
        "--regate", help="Run the gate even when a green gate of the same tree state, contract, frozen "
                         "hashes, environment and interpreter is recorded (default: reuse it).")] = False

    def gpu_list(self) -> list[str] | None:
        return parse_gpus(self.gpus)


def _shape_list(self) -> list[str] | None:
    return [s for item in (self.shapes or []) for s in item.split(",") if s] or None


def _config(self, c: contract_mod.Contract, aa: bool = False) -> BenchConfig:
    """The BenchConfig these options ask for: fields by their own names, percent back to fractions,
    the contract's modes, varlen and l2 where none were given, --quick's preset over it all."""
    values: dict = {}
    for f in dataclasses.fields(BenchConfig):
        if not f.metadata.get("cli"):
            continue
        value = getattr(self, f.name)
        kind = f.metadata.get("kind")
        if f.metadata.get("unit") == "percent":
            value = value / 100
        elif kind == "csv":
            value = [m for m in value.split(",") if m] if value is not None else list(getattr(c, f.name))
        elif kind == "assign":
            flag = (f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),))[0]
            value = (contract_mod.parse_overrides(value or []) if flag == "--input" else
                     contract_mod.parse_overrides(value or [], flag, "NAME=VALUE", "FLA_TILELANG=1"))
        elif f.metadata.get("from_contract") and isinstance(f.default, bool):
            value = bool(value) or bool(getattr(c, f.name))
        elif f.metadata.get("from_contract"):
            value = value if value is not None else getattr(c, f.name, f.default)
        values[f.name] = value
    return BenchConfig(**{**values, "aa": aa, **(QUICK if self.quick else {})}).check()


# The bench's options: one per BenchConfig field it declares for the command line, generated from
# it (bench/model.py holds each default and help text), plus what picks the cells and the base.
BenchOptions = config_options("BenchOptions", BenchConfig, extra=[
    ("base", Annotated[str | None, typer.Option("--base", help="Base git ref (default: the contract's base).")], None),
    ("shapes", Annotated[list[str] | None, typer.Option("--shapes", help="Shape names (default: the contract's).")],
     None),
    ("quick", Annotated[bool, typer.Option(
        "--quick", help="A quick signal: the contract's target shapes, one round, a wide stopping rule "
                        "(1% half-width, 6-40 pairs, 10 s a cell); labelled SIGNAL everywhere, never a promotion.")],
     False),
], namespace={"shape_list": _shape_list, "config": _config})


def parse_gpus(gpus: str | None) -> list[str] | None:
    items = [g.strip() for g in (gpus or "").split(",") if g.strip()]
    bad = [g for g in items if not g.isdigit()]
    if bad:
        raise UsageError(f"--gpus {gpus!r}: {', '.join(bad)} is not a GPU index", "e.g. --gpus 0,1")
    return items or None


# -- gate ---------------------------------------------------------------------------------------

def gate_plan(opts: GateOptions, for_verify: bool = False) -> tuple[int, list[str] | None, str | None]:
    """(xdist workers, the gate's GPUs, the bench's GPU) for this host.

    No GPU: the gate as asked (--workers, default none). One GPU: the gate's xdist workers share it,
    the bench runs after the gate. Several GPUs: the workers spread over them, and verify keeps the
    last one for the bench, which then runs beside the gate. Unless --workers says, up to 8 workers
    a GPU and one for every two CPU cores; the gate starts no more than the file has tests (a cold
    FLA gate is compile-bound: on one H200, FLA's 13 delta-rule tests one after another took 1,129 s
    in pytest; on the H200 x2, 16 workers took 165 s).
    """
    gpus = opts.gpu_list() or evidence.visible_gpus()
    if not gpus:
        return opts.workers, opts.gpu_list(), None
    if len(gpus) < 2:
        return opts.workers or gate_mod.xdist_workers(1), opts.gpu_list(), None
    gate_gpus, bench_gpu = (gpus[:-1], gpus[-1]) if for_verify else (gpus, None)
    return opts.workers or gate_mod.xdist_workers(len(gate_gpus)), gate_gpus, bench_gpu


@app.command("gate")
@command
@with_options(GateOptions, LockOptions)
def gate_cmd(
    op: str,
    k_expr: Annotated[str | None, typer.Option("-k", help="pytest -k subset: a signal only, never a gate.")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Kill pytest after this many seconds.")] = None,
    gate_options: GateOptions = None,  # type: ignore[assignment]
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Run the op's frozen test file as a black box; exit 0 green, 1 red."""
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    workers, gpus, _ = gate_plan(gate_options)
    console = human(as_json)
    with lock_options.hold(target, op, console, "gate"), progress_bar(console) as bar:
        result = run_gate_with_progress(target, c, k_expr, timeout, console, bar, workers, gpus,
                                        regate=gate_options.regate)
    if as_json:
        emit_json({"ok": True, **result.to_dict()})
    else:
        print_gate(result, out)
    raise typer.Exit(0 if result.green else 1)


def run_gate_with_progress(target: Target, c, k_expr: str | None, timeout: float | None, console: Console,
                           bar, workers: int = 0, gpus: list[str] | None = None,
                           regate: bool = False) -> gate_mod.GateResult:
    _, stripped, _ = pytest_run.clean_env(target.extra_strip_env())
    for name, value in stripped.items():
        console.print(f"[yellow]removed {escape(name)}={escape(value)} from the gate's environment[/] "
                      f"(it weakens or steers the tests)", markup=True)
    if k_expr:
        console.print(f"[yellow]-k {escape(repr(k_expr))}: SIGNAL ONLY, this run never counts as a promotion gate[/]",
                      markup=True)
    tasks: dict[str, int] = {}

    def updater(label: str):
        def update(done: int, total: int, last: str) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=None, last="")
            bar.update(tasks[label], completed=done, total=total or None, last=last.rsplit("::", 1)[-1][:60])
        return update

    return gate_mod.run_gate(target, c, k_expr=k_expr, progress=updater("gate"),
                             baseline_progress=updater(f"gate baseline at {c.base_commit[:8]}"), timeout=timeout,
                             workers=workers, gpus=gpus, regate=regate)


# -- bench and verify ---------------------------------------------------------------------------

def run_bench_with_progress(target: Target, c, opts, cfg: BenchConfig, bar, gate: dict | None,
                            gpu: str | None = None, cancel: threading.Event | None = None) -> RunRecord:
    task = bar.add_task("bench: starting workers", total=None, last="")
    return run_mod.bench(target, c, base_ref=opts.base, shapes=opts.shape_list(), cfg=cfg,
                         on_event=bench_events(bar, task, cfg), gate=gate, command=command_line(),
                         gpu=gpu, cancel=cancel)


def bench_events(bar, task, cfg: BenchConfig, prefix: str = "bench"):
    """A session's events as a progress bar line."""

    def on_event(kind: str, **info) -> None:
        if kind == "warm":
            bar.update(task, description=f"{prefix}: warm-up, correctness, probes", completed=info["index"],
                       total=info["total"], last=info["cell"])
        elif kind == "unseen":
            against = "the base against itself" if cfg.aa else "base against candidate"
            bar.update(task, description=f"{prefix}: unseen shapes, {against}", completed=info["index"],
                       total=info["total"], last=info["cell"])
        elif kind in ("unseen-options", "test-calls"):
            what = "options nobody calls" if kind == "unseen-options" else "the test's own calls"
            bar.update(task, description=f"{prefix}: {what}", completed=info["index"], total=info["total"],
                       last=info["cell"])
        elif kind == "round":
            bar.update(task, description=f"{prefix}: round {info['round']}/{info['rounds']}",
                       completed=0, total=None, last=f"{info['cells']} cell(s)")
        elif kind == "prime":
            bar.update(task, description=f"{prefix}: fresh workers to measure (the warm-up compiled or tuned)",
                       completed=0, total=None, last=f"{info['new_entries']} new cache entries")
        elif kind == "pair":
            bar.update(task, description=f"{prefix}: pairs {info['cell']}", completed=info["n"],
                       total=cfg.max_pairs, last=f"{info['kept']} kept")
        elif kind == "exclusive-wait":
            bar.update(task, description=f"{prefix}: --exclusive: waiting for the GPU ({info['who']})",
                       completed=0, total=None,
                       last=f"{info['waited']:.0f} of {info['limit']:.0f} s, before {info['stage']}")

    return on_event


def bench_exit(record: RunRecord) -> int:
    """1 when the guard or the differential check blocks, 3 when a cell or a worker failed (a crash,
    a hang, an OOM: the other cells keep their results), else 0."""
    s = record.summary
    if s.n_blocked or record.guard.blocked:
        return 1
    if record.errors or s.n_failed or not s.n_measured:
        return 3
    return 0


@app.command("bench")
@command
@with_options(BenchOptions, LockOptions)
def bench_cmd(
    op: str,
    aa: Annotated[bool, typer.Option("--aa", help="Base against itself: the self-check.")] = False,
    fail_on: FailOnOpt = None,
    bench_options: BenchOptions = None,  # type: ignore[assignment]
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Paired, interleaved benchmark of the working tree against a base ref (no gate: see verify)."""
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    cfg = bench_options.config(c, aa=aa)
    with lock_options.hold(target, op, human(as_json), "bench"), progress_bar(human(as_json)) as bar:
        record = run_bench_with_progress(target, c, bench_options, cfg, bar, gate=None)
    if as_json:
        emit_json({"ok": True, **record.to_dict()})
    else:
        print_bench(record, out)
    raise typer.Exit(fail_on_exit(bench_exit(record), fail_on, slower_in(record), human(as_json)))


def _verify_side_by_side(target, c, k_expr, gate_options, bench_options, cfg, console, workers, gate_gpus,
                         bench_gpu) -> tuple[gate_mod.GateResult, RunRecord | None]:
    """The gate on some GPUs and the bench on another at once; the bench is withdrawn if the gate is red."""
    cancel = threading.Event()
    box: dict = {}

    def bench_thread():
        try:
            box["record"] = run_bench_with_progress(target, c, bench_options, cfg, bar, gate=None, gpu=bench_gpu,
                                                    cancel=cancel)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            box["error"] = exc

    console.print(f"verify on {len(gate_gpus) + 1} GPUs: the gate on {','.join(gate_gpus)} ({workers} xdist "
                  f"workers), the bench on {bench_gpu} at the same time")
    with progress_bar(console) as bar:
        t = threading.Thread(target=bench_thread, name="flaloop-bench", daemon=True)
        t.start()
        try:
            result = run_gate_with_progress(target, c, k_expr, None, console, bar, workers, gate_gpus,
                                            regate=gate_options.regate)
        except BaseException:
            cancel.set()
            t.join(timeout=60)
            raise
        if not result.green:
            cancel.set()
        while t.is_alive():
            t.join(timeout=0.5)
    err_ = box.get("error")
    if err_ is not None and not (isinstance(err_, Cancelled) and not result.green):
        raise err_
    return result, box.get("record")


@app.command("verify", context_settings={"allow_extra_args": True})
@command
@with_options(GateOptions, BenchOptions, FlaVerifyFlags, LockOptions)
def verify_cmd(
    ctx: typer.Context,
    op: Annotated[str | None, typer.Argument(help="The op (or FLA's --op).")] = None,
    k_expr: Annotated[str | None, typer.Option("-k", help="Gate on a pytest -k subset (signal only).")] = None,
    no_gate: Annotated[bool, typer.Option("--no-gate", help="Skip the gate: the result is UNVERIFIED.")] = False,
    sanitize: Annotated[bool, typer.Option(
        "--sanitize", help="After the bench, run every contract cell under compute-sanitizer on the base and on "
                           "the measured candidate; an error only the candidate has blocks.")] = False,
    fail_on: FailOnOpt = None,
    gate_options: GateOptions = None,  # type: ignore[assignment]
    bench_options: BenchOptions = None,  # type: ignore[assignment]
    fla_verify_flags: FlaVerifyFlags = None,  # type: ignore[assignment]
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Gate first, then the paired benchmark; never a bench result on a red gate. With several GPUs the
    gate and the bench run at the same time on different GPUs."""
    call = fla_compat.resolve(op, ctx.args, fla_verify_flags, k_expr, bench_options.modes)
    if call.list_only:
        from flaloop.cli.setup import list_cmd

        return list_cmd(repo=repo, python=python, as_json=as_json)
    op, k_expr, bench_options.modes = call.op, call.k_expr, call.modes
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    fla_compat.check_test_file(call, c.test_file)
    console = human(as_json)
    for note in call.notes:
        console.print(f"({note})")
    cfg = bench_options.config(c)
    with lock_options.hold(target, op, console, "verify"):
        workers, gate_gpus, bench_gpu = gate_plan(gate_options, for_verify=True)
        gate_dict, record = None, None
        if no_gate:
            console.print("[bold red]--no-gate: NO correctness gate runs; this benchmark is UNVERIFIED and "
                          "must not be used as evidence of a win[/]", markup=True)
            with progress_bar(console) as bar:
                record = run_bench_with_progress(target, c, bench_options, cfg, bar, gate=None)
        elif bench_gpu is not None:
            result, record = _verify_side_by_side(target, c, k_expr, gate_options, bench_options, cfg, console,
                                                  workers, gate_gpus, bench_gpu)
            gate_dict = result.to_dict()
        else:
            with progress_bar(console) as bar:
                result = run_gate_with_progress(target, c, k_expr, None, console, bar, workers, gate_gpus,
                                                regate=gate_options.regate)
            gate_dict = result.to_dict()
        if gate_dict is not None:
            print_gate(result, console)
            if not result.green:
                if as_json:
                    emit_json({"ok": True, "gate": gate_dict, "bench": None})
                console.print("[red]gate is red: no benchmark result is shown on a red gate[/]", markup=True)
                raise typer.Exit(1)
            if record is None:
                with progress_bar(console) as bar:
                    record = run_bench_with_progress(target, c, bench_options, cfg, bar, gate=gate_dict)
            else:
                record.gate, record.unverified, record.last_gate = gate_dict, False, None
                if record.path:
                    record_mod.write(Path(record.path).parent, record)
        sanitize_doc = sanitize_record(target, c, record, console) if sanitize else None
        profile_doc = None
        if call.profile and bench_exit(record) == 0:
            from flaloop.diagnose import profile as profiling

            profile_doc = profiling.profile(target, c, mode=cfg.modes[0], command=command_line())
        if as_json:
            emit_json({"ok": True, "gate": gate_dict, "bench": record.to_dict(), "profile": profile_doc,
                       "sanitize": sanitize_doc})
        else:
            print_bench(record, out)
            if profile_doc:
                out.print(f"profile: {profile_doc.get('path') or ''}")
        raise typer.Exit(fail_on_exit(bench_exit(record), fail_on, slower_in(record), console))


# -- sanitize -----------------------------------------------------------------------------------

def sanitize_events(console: Console):
    """The sanitizer's progress: which tool on which side, and the cell it is at."""

    def on_event(kind: str, **info) -> None:
        if kind == "warm":
            console.print(f"  warm-up, no tool: the {info['side']} side, {info['cells']} cell(s) ...")
        elif kind == "run":
            console.print(f"  {info['tool']}: the {info['side']} side, {info['cells']} cell(s) ...")
        elif kind == "cell" and not info["cell"].startswith("("):
            console.print(f"    {info['tool']} {info['side']}: {info['cell']}")

    return on_event


def _side_line(side: str, run: dict) -> str:
    errors = f"{run['errors']} error(s)" if run["errors"] is not None else run["status"]
    return f"{side} {errors} in {run['wall_s']:.1f}s"


def print_sanitize(doc: dict, console: Console) -> None:
    """The plain warm-up; per tool: available or why not, each side's errors and time, what is new,
    what pre-exists."""
    warm = doc.get("warm") or {}
    if warm:
        console.print("warm-up, no tool: " + ", ".join(
            f"{side} {w['status']} in {w['wall_s']:.1f}s" + (f" ({escape(w['reason'])})" if w["reason"] else "")
            for side, w in warm.items()))
    for tool, entry in doc["tools"].items():
        if not entry["available"]:
            console.print(f"{tool}: unavailable: {entry['reason']}")
            continue
        sides = ", ".join(_side_line(s, r) for s, r in entry["sides"].items())
        console.print(f"{tool}: {sides}; {len(entry['new'])} only on the candidate, "
                      f"{len(entry['pre_existing'])} pre-existing")
        for r in entry["pre_existing"]:
            console.print(f"  pre-existing (the base has them too): {r['cell']}: {r['kind']} in "
                          f"{r['kernel'] or 'a CUDA API call'}, {r['count']}x")
        if entry.get("reason") and entry["reason"] != "ran on both sides":
            console.print(f"  ({entry['reason']})")
    print_findings(doc["findings"], console, title="sanitizer findings")
    for line in doc["failed"]:
        console.print(f"[yellow]not fully checked: {escape(line)}[/]", markup=True)
    console.print(f"sanitize: {doc['path']}")


def sanitize_exit(doc: dict) -> int:
    """1 when an error only the candidate has blocks, 3 when a side could not be checked, else 0."""
    return 1 if doc["blocked"] else 3 if doc["failed"] else 0


def sanitize_record(target: Target, c, record: RunRecord, console: Console, done: dict | None = None) -> dict:
    """verify/iter --sanitize: the sanitizer on the candidate the bench measured (its snapshot commit),
    its findings put into the run record, which is written again. `done` (candidate commit -> document)
    spares a second run on the same candidate."""
    commit = record.candidate.commit or None
    doc = (done or {}).get(commit)
    if doc is None:
        console.print(f"[bold]sanitize[/]: every contract cell under compute-sanitizer, the base and "
                      f"{escape((commit or 'the working tree')[:12])}", markup=True)
        device = record.config.device if record.config.device in ("cuda", "cpu") else None
        doc = sanitize_mod.sanitize(target, c, candidate_commit=commit, device=device,
                                    on_event=sanitize_events(console), command=command_line())
        if done is not None:
            done[commit] = doc
        print_sanitize(doc, console)
    sanitize_mod.attach(record, doc)
    if doc["findings"] and record.path:
        record_mod.write(Path(record.path).parent, record)
    return doc


def _tool_list(tools: list[str] | None) -> list[str]:
    return sanitize_mod.check_tools([t for item in tools or [] for t in item.split(",") if t])


@app.command("sanitize")
@command
@with_options(LockOptions)
def sanitize_cmd(
    op: str,
    tool: Annotated[list[str] | None, typer.Option(
        "--tool", help="memcheck, racecheck, initcheck or synccheck; repeat (or comma-separate) for several "
                       "(default: all four).")] = None,
    commit: Annotated[str | None, typer.Option(
        "--commit", help="Check this ref as the candidate (default: the working tree).")] = None,
    cell: Annotated[list[str] | None, typer.Option(
        "--cell", help="Only this cell, e.g. B1_T64_H2_D32/fwd; repeat for several (default: every contract cell).")]
    = None,
    device: Annotated[str | None, typer.Option("--device", help="cuda or cpu (default: cuda when available).")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Kill one compute-sanitizer process (or the plain warm-up run before them) after this "
                          "many seconds.")] = sanitize_mod.DEFAULT_TIMEOUT,
    jobs: Annotated[int, typer.Option(
        "--jobs", min=1, help="Tools run at once on the device (each its base side, then its candidate side).")]
    = len(sanitize_mod.TOOLS),
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """One step of every contract cell under compute-sanitizer (memcheck, racecheck, initcheck, synccheck)
    on the base and on the candidate; exit 1 when the candidate has an error the base does not."""
    tools = _tool_list(tool)
    if device not in (None, "cuda", "cpu"):
        raise UsageError(f"--device {device!r} is not cuda or cpu")
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    candidate = git.resolve_ref(target.root, commit) if commit else None
    console = human(as_json)
    with lock_options.hold(target, op, console, "sanitize"):
        doc = sanitize_mod.sanitize(target, c, candidate_commit=candidate, cells=cell, tools=tools, device=device,
                                    on_event=sanitize_events(console), timeout=timeout, command=command_line(),
                                    jobs=jobs)
    code = sanitize_exit(doc)
    if as_json:
        emit_json({"ok": True, "exit_code": code, **doc})
    else:
        print_sanitize(doc, out)
    raise typer.Exit(code)
