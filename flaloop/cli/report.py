"""`flaloop profile`, `flaloop explain` and `flaloop report`: the profiler reading, what explains a kept
win, and the final claim from stored records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from flaloop.cli.app import JsonOpt, PyOpt, RepoOpt, app, command, command_line, emit_json, err, human, out
from flaloop.core import fsutil
from flaloop.core.errors import FlaloopError
from flaloop.core.workspace import REPORT_FILE
from flaloop.task import contract as contract_mod
from flaloop.task.target import Target


@app.command("profile")
@command
def profile_cmd(
    op: str,
    shape: Annotated[str | None, typer.Option("--shape", help="Registry shape name (default: the contract's first).")] = None,
    mode: Annotated[str | None, typer.Option("--mode", help="fwd or fwdbwd (default: the contract's first).")] = None,
    ncu: Annotated[bool, typer.Option("--ncu", help="Also run Nsight Compute (--set full + PmSampling, --set source "
                                                    "+ SourceCounters, --clock-control none).")] = False,
    device: Annotated[str | None, typer.Option("--device", help="cuda or cpu (default: cuda when available).")] = None,
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """One step of one bench cell under torch.profiler, base and candidate side by side (and ncu with --ncu)."""
    from flaloop.core.errors import UsageError
    from flaloop.diagnose import profile as profiling

    if mode not in (None, "fwd", "fwdbwd"):
        raise UsageError(f"--mode {mode!r} is not fwd or fwdbwd")
    if device not in (None, "cuda", "cpu"):
        raise UsageError(f"--device {device!r} is not cuda or cpu")
    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    console = human(as_json)

    def on_event(kind: str, **info) -> None:
        what = {"side": f"profiling the {info.get('side')} side", "ncu": "Nsight Compute",
                "ceilings": "device ceilings (measured once per device, then cached)"}.get(kind, kind)
        console.print(f"  {what} ...")

    doc = profiling.profile(target, c, shape=shape, mode=mode, ncu=ncu, device=device,
                            command=command_line(), on_event=on_event)
    if as_json:
        emit_json({"ok": True, **doc})
        return
    print_profile(doc)


def print_profile(doc: dict) -> None:
    from rich.table import Table

    out.print(f"{doc['op']} {doc['cell']['id']}: one step, {doc['kernels_are']}")
    t = Table(title="top kernels, base vs candidate (ms in one step)")
    for col in ("kernel", "base ms", "base launches", "cand ms", "cand launches"):
        t.add_column(col)
    by = {s: {k["name"]: k for k in doc[s]["kernels"]} for s in ("base", "cand")}
    names = list(dict.fromkeys([k["name"] for s in ("cand", "base") for k in doc[s]["kernels"][:10]]))
    for n in names:
        b, c = by["base"].get(n) or {}, by["cand"].get(n) or {}
        t.add_row(n[:80], f"{b['total_ms']:.4f}" if b else "-", str(b.get("launches", "-")),
                  f"{c['total_ms']:.4f}" if c else "-", str(c.get("launches", "-")))
    out.print(t)
    for s in ("base", "cand"):
        d = doc[s]
        share = d["device_total_ms"] / d["step_wall_ms"] if d["step_wall_ms"] else 0
        out.print(f"  {s}: {d['device_total_ms']:.4f} ms in {d['n_launches']} launches, host wall "
                  f"{d['step_wall_ms']:.4f} ms per step ({share:.0%} busy); trace {d['trace']}")
    roof = doc.get("roofline")
    if roof and roof.get("floor_ms"):
        out.print(f"  roofline ({roof['family']}): floor {roof['floor_ms']:.4f} ms, {roof['bound']}-bound; "
                  f"base at {roof['pct_of_floor_base'] or 0:.1f}%, cand at {roof['pct_of_floor_cand'] or 0:.1f}% of it")
    ncu = doc.get("ncu") or {}
    out.print(f"  ncu: {'reports ' + json.dumps(ncu.get('reports')) if ncu.get('available') else ncu.get('reason')}")
    out.print(f"profile: {doc['path']}")


@app.command("explain")
@command
def explain_cmd(
    op: str,
    iter_n: Annotated[int | None, typer.Option("--iter", help="The kept iteration to explain (default: the best).")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Profiled steps per cell and side.")] = 10,
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Profile every measured cell of a kept iteration against the base: which kernels explain the win."""
    from flaloop.core.errors import UsageError
    from flaloop.diagnose import explain
    from flaloop.loop import rules, store

    target = Target.discover(repo, python)
    c = contract_mod.Contract.load(target, op)
    iters = store.iterations(target.workspace(op))
    it = rules.best(iters) if iter_n is None else next((i for i in iters if i.iter == iter_n), None)
    if it is None or it.status != "keep":
        raise UsageError(f"no kept iteration {'to explain' if iter_n is None else iter_n}",
                         "`flaloop status OP` lists the iterations; explain one whose status is keep")
    console = human(as_json)
    doc = explain.take(target, c, it, steps=steps, command=command_line(), on_event=explain_events(console))
    if as_json:
        emit_json({"ok": True, **doc})
    else:
        print_explanation(doc)
    raise typer.Exit(1 if doc["blocked"] else 0)


def explain_events(console):
    """explain's progress: each side as it starts, and each cell as the profile step reaches it."""

    def on_event(kind: str, **i) -> None:
        if kind == "side":
            console.print(f"  profiling the {i['side']} side: {i['cells']} cells x {i['steps']} steps"
                          + (f" (round {i['round']} of {i['rounds']})" if i.get("rounds", 1) > 1 else "") + " ...")
        elif kind == "cell":
            console.print(f"    {i['side']}: {i['cell']}")

    return on_event


def print_explanation(doc: dict) -> None:
    from flaloop.report import markdown

    out.print(markdown.explanation_md(doc, top=6))
    out.print(f"explanation: {doc.get('_path')}")


@app.command("report")
@command
def report_cmd(
    op: Annotated[str | None, typer.Argument(help="The op (not with --sweep).")] = None,
    out_dir: Annotated[str | None, typer.Option("--out", help="Where REPORT.md, report.json and the PNGs go "
                                                              "(default: profile/<op>-opt/report/).")] = None,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="markdown (REPORT.md, the pull request's body) or github (a "
                                                       "pull-request comment: comment.md, collapsible per op, with "
                                                       "the <!-- flaloop-report --> marker).")] = "markdown",
    sweep: Annotated[Path | None, typer.Option("--sweep", help="Render a sweep (its directory or sweep.json) "
                                                               "instead of an op's claim.")] = None,
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """The final claim from stored records (nothing is re-measured): markdown for the PR, JSON and PNG plots.

    Exits 1, naming the reason, rather than claim a win on a -k gate, a red or missing gate, a
    blocking guard finding, blocked cells, or records of another commit than the claim's.
    With --sweep: the sweep's table and each op's cells (exit 0: a sweep's own exit code judges it).
    """
    from flaloop.bench import roofline
    from flaloop.core.errors import UsageError
    from flaloop.report import build
    from flaloop.report.markdown import render, render_github

    if fmt not in ("markdown", "github"):
        raise UsageError(f"--format {fmt!r} is not markdown or github")
    if (op is None) == (sweep is None):
        raise UsageError("name an op or --sweep DIR (one of them)",
                         "e.g. `flaloop report OP` or `flaloop report --sweep profile/sweeps/<stamp> --format github`")
    if sweep is not None:
        return _report_sweep(sweep, fmt, out_dir, as_json)
    target = Target.discover(repo, python)
    try:
        family = roofline.family_for(target.op(op).registry, op)
    except Exception:  # noqa: BLE001 - no registry to read: the report says "no model"
        family = None
    doc = build.build(target, op, family=family)
    dest = Path(out_dir).resolve() if out_dir else target.workspace(op).report
    dest.mkdir(parents=True, exist_ok=True)
    if fmt == "github":
        md = render_github(doc)
        fsutil.atomic_write_text(dest / "comment.md", md)
        doc["files"] = {"github": str(dest / "comment.md")}
        if as_json:
            emit_json({**doc, "exit_code": 0 if doc["claim_ok"] else 1})
        else:
            out.print(md)
        err.print(f"comment: {dest / 'comment.md'}")  # stdout is the comment alone: `... > comment.md`
        raise typer.Exit(0 if doc["claim_ok"] else 1)
    plots = {}
    if not no_plots:
        from flaloop.report.plots import write_plots

        plots = write_plots(doc, dest)
    md = render(doc, plots)
    fsutil.atomic_write_text(dest / REPORT_FILE, md)
    doc["files"] = {"markdown": str(dest / REPORT_FILE), "json": str(dest / "report.json"), "plots": plots}
    fsutil.atomic_write_json(dest / "report.json", doc)
    console = human(as_json)
    if as_json:
        emit_json({**doc, "exit_code": 0 if doc["claim_ok"] else 1})
    else:
        out.print(md)
    if not doc["claim_ok"]:
        console.print(f"REFUSED to claim a win: {', '.join(r['reason'] for r in doc['refused'])}")
        for r in doc["refused"]:
            console.print(f"  {r['reason']}: {r['message']}\n    hint: {r['hint']}")
    recs = doc["records"]
    console.print(f"stands on: {recs['claim']} ({recs['claim_complete']})"
                  + (f"; newer interrupted or partial record(s) not used: {', '.join(recs['skipped'])}"
                     if recs["skipped"] else ""))
    console.print(f"report: {dest / REPORT_FILE}")
    raise typer.Exit(0 if doc["claim_ok"] else 1)


def _sweep_findings(rec) -> dict[str, list[dict]]:
    """Each measured row's guard findings, from its run record (the sweep row keeps only the rules)."""
    from flaloop.bench import record as record_mod

    out: dict[str, list[dict]] = {}
    here = Path(rec.path).parent
    for r in rec.rows:
        if r.record:
            try:
                out[r.key] = [f.to_dict() for f in record_mod.read(here / r.record).guard.findings]
            except FlaloopError:
                continue  # the row's own word (its guard rules) stands
    return out


def _report_sweep(where: Path, fmt: str, out_dir: str | None, as_json: bool) -> None:
    from flaloop.report.markdown import render_github_sweep
    from flaloop.report.sweep import render_markdown
    from flaloop.sweep import record as sweep_record

    rec = sweep_record.read(where.resolve())
    dest = Path(out_dir).resolve() if out_dir else Path(rec.path).parent
    dest.mkdir(parents=True, exist_ok=True)
    if fmt == "github":
        md, path = render_github_sweep(rec, _sweep_findings(rec)), dest / "comment.md"
    else:
        md, path = render_markdown(rec), dest / "sweep.md"
    fsutil.atomic_write_text(path, md)
    if as_json:
        emit_json({"ok": True, "kind": "report", "sweep": rec.path, "format": fmt, "markdown": md, "path": str(path),
                   "exit_code": 0})
    else:
        out.print(md)
    err.print(f"{'comment' if fmt == 'github' else 'sweep report'}: {path}")
    raise typer.Exit(0)
