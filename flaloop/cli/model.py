"""`flaloop model OP`: the op's change inside one of the target's models: the training step's time,
paired and interleaved as a bench cell, and the training trajectory against the base's band."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from flaloop.cli.app import (
    JsonOpt,
    LockOptions,
    PyOpt,
    RepoOpt,
    app,
    command,
    command_line,
    emit_json,
    human,
    out,
    progress_bar,
    with_options,
)
from flaloop.cli.measure import bench_events
from flaloop.core.errors import UsageError
from flaloop.modelcheck import run as run_mod
from flaloop.modelcheck import spec as spec_mod
from flaloop.modelcheck.run import model_config
from flaloop.report import fmt
from flaloop.task import contract as contract_mod
from flaloop.task.target import Target


@app.command("model")
@command
@with_options(LockOptions)
def model_cmd(
    op: str,
    aa: Annotated[bool, typer.Option("--aa", help="Base against itself: the check's own A/A.")] = False,
    base: Annotated[str | None, typer.Option("--base", help="Base ref (default: the contract's).")] = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a field of the op's model for this run: steps=20, batch=4, seq_len=1024, "
                      "config.hidden_size=512 (repeatable; the contract's \"model\" object is the lasting place).")] = None,
    op_speedup: Annotated[float | None, typer.Option(
        "--op-speedup", help="The op's measured speedup (a bench's geomean) for the step's prediction "
                             "(default: the op's calls in a step, replayed alone on each side).")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Training steps of each trajectory.")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", help="Fresh worker pairs for the step time (default 2, "
                                                           "up to 4 when they disagree).")] = None,
    max_rounds: Annotated[int | None, typer.Option("--max-rounds", help="Rounds in all when the first ones disagree "
                                                                   "(default 4; at most --rounds: none).")] = None,
    min_pairs: Annotated[int | None, typer.Option("--min-pairs", help="Pairs before the stopping rule may stop (default 8).")] = None,
    max_pairs: Annotated[int | None, typer.Option("--max-pairs", help="Most pairs (default 40).")] = None,
    margin: Annotated[float | None, typer.Option("--margin", help="SAME margin, percent (default 1).")] = None,
    cell_seconds: Annotated[float | None, typer.Option("--cell-seconds", help="Time cap of the step's sampling "
                                                                      "(default 120).")] = None,
    sample_ms: Annotated[float | None, typer.Option("--sample-ms", help="Steps per sample calibrated to last this long "
                                                               "(default 200).")] = None,
    diff_tol: Annotated[float | None, typer.Option("--diff-tol", help="The op's tolerance (relative RMS) the band's "
                                                             "perturbations take (default: the bench's 0.005).")] = None,
    device: Annotated[str, typer.Option("--device", help="Where the workers run: auto, cuda, cpu.")] = "auto",
    forkserver: Annotated[bool, typer.Option("--forkserver/--no-forkserver", help="Fork workers from a warm server.")] = True,
    save: Annotated[bool, typer.Option(
        "--save", help="Name this model check in the contract (with the --set overrides): `stop --go` then runs it "
                       "on the kept iteration and the report shows it.")] = False,
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """The op inside a model: step time paired as a bench cell, and the training trajectory against the base's band."""
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    over = spec_mod.parse_sets(sets or [])
    if steps is not None:
        over["steps"] = steps
    spec = spec_mod.resolve(op, c.import_path, getattr(c, "model", None), over)
    if spec.steps < 2:
        raise UsageError(f"--steps {spec.steps}: a trajectory needs at least 2 steps")
    if save:  # before measuring: a refused model is refused again by the go, with the same words
        had = dict(c.model or {})
        c.model = {**had, **over, **({"config": {**had.get("config", {}), **over["config"]}} if "config" in over else {})}
        c.save(target)
    cfg = model_config(device=device, rounds=rounds, max_rounds=max_rounds, min_pairs=min_pairs, max_pairs=max_pairs, margin=margin,
                       cell_seconds=cell_seconds, sample_ms=sample_ms, diff_tol=diff_tol, forkserver=forkserver, aa=aa)
    console = human(as_json)
    with lock_options.hold(target, op, console, "model"), progress_bar(console) as bar:
        task = bar.add_task("model: starting workers", total=None, last="")
        rec = run_mod.check(target, c, spec, cfg, base=base, aa=aa, op_speedup=op_speedup,
                            on_event=bench_events(bar, task, cfg, prefix="model"), command=command_line())
    if as_json:
        emit_json({"ok": True, **rec})
    else:
        print_model(rec, out)
    raise typer.Exit(run_mod.exit_code(rec))


def print_model(rec: dict, console: Console) -> None:
    m, st, tr = rec["model"], rec["step"], rec["trajectory"]
    console.print(f"{rec['op']} in {m['model_class']} (B{m['batch']} T{m['seq_len']} {m['dtype']}"
                  + (", A/A" if rec["aa"] else "") + f"): {rec.get('path') or '(not kept)'}")
    ci = f" {fmt.interval(st['ci_low'], st['ci_high'])}" if st.get("ci_low") is not None else ""
    console.print(f"  step time: {st['verdict']} {fmt.speedup(st['speedup'])}{ci} over {st['pairs']} pairs"
                  + (f"; base {st['base_ms']:.2f} ms, candidate {st['cand_ms']:.2f} ms" if st.get("base_ms") else "")
                  + (f" ({st['reason']})" if st.get("reason") else ""))
    if st.get("op_share") is not None:
        console.print(f"  the op's share of a step: {st['op_share']:.1%}; op speedup {fmt.speedup(st['op_speedup'])} "
                      f"({st['op_speedup_from']}) predicts {fmt.speedup(st['predicted'])} for the step, measured {fmt.speedup(st['speedup'])}")
    j = tr.get("judgement")
    if j:
        inside = "inside" if j["inside"] else "LEFT"
        console.print(f"  trajectory ({tr['steps']} steps, band: {tr['band_scale']:g}x {tr['band_seeds']} base run(s) "
                      f"at {tr['perturb']:g} rel-RMS on the op's outputs): {inside} the band; worst "
                      + ", ".join(f"{k} {v:.2f}x the band" for k, v in j["worst"].items()))
    for f in rec["findings"]:
        console.print(f"  [{'BLOCK' if f['blocking'] else 'warn'}] {f['rule']}: {f['message']}", markup=False)
    for e in rec["errors"]:
        console.print(f"  error: {e.splitlines()[0]}", markup=False)


__all__ = ["model_cmd", "print_model"]
