"""The report's pure parts, in-process: a record's options spelled back to the same config, the plots,
and recorded commands made portable. `flaloop profile` and `flaloop report` on the toy target are in
tests/e2e/test_report.py."""

from __future__ import annotations

import dataclasses
import shlex
from types import SimpleNamespace

from flaloop.report import build


def test_the_options_a_record_names_ask_for_the_same_config():
    """cli_args(cfg) spells a BenchConfig on the command line; the CLI parses it back to the same config."""
    from typer.main import get_command

    from flaloop.bench.model import BenchConfig, cli_args
    from flaloop.cli import app, load_commands
    from flaloop.cli.measure import BenchOptions
    from flaloop.task.contract import MODES

    contract = SimpleNamespace(modes=list(MODES), varlen=False, input_overrides={"k": "l2norm"})
    cfgs = [BenchConfig(min_pairs=4, max_pairs=9, margin=0.01, half_width=0.005, probes=False, modes=["fwd"],
                        inputs={"k": "l2norm", "q": "sigmoid"}, independent_tuning=True, import_mode="lean",
                        cell_seconds=20.0, varlen=True, dtype="float16", forkserver=False, placements=1),
            BenchConfig(), BenchConfig(signal=True, rounds=1, max_rounds=1, min_pairs=6, max_pairs=40,
                                       half_width=0.01, cell_seconds=10.0)]
    load_commands("bench")
    bench = get_command(app).commands["bench"]  # type: ignore[attr-defined]
    for cfg in cfgs:
        cfg.inputs = {**contract.input_overrides, **cfg.inputs}
        args = cli_args(cfg, contract)
        ctx = bench.make_context("bench", ["toy_attn", *args])
        names = {f.name for f in dataclasses.fields(BenchOptions)}
        opts = BenchOptions(**{k: v for k, v in ctx.params.items() if k in names})
        got = opts.config(contract)
        got.inputs = {**contract.input_overrides, **got.inputs}
        assert got == cfg, args


def _plot_doc() -> dict:
    def cell(i, b, c):
        return {"id": f"B4_T{1024 * (i + 1)}_H16_D128/fwd", "speedup": b / c, "ci_low": b / c - 0.03,
                "ci_high": b / c + 0.03, "verdict": "FASTER", "device": {"base": {"median": b}, "cand": {"median": c}},
                "eager": {"base": {"median": b * 1.1}, "cand": {"median": c * 1.1}}}

    return {"op": "chunk_gla", "cells": [cell(0, 24.6, 17.0), cell(1, 49.0, 33.5)],
            "summary": {"geomean": {"speedup": 1.45, "ci_low": 1.42, "ci_high": 1.48}, "target_speedup": 1.3},
            "trajectory": [{"iter": 0, "status": "baseline", "speedup": None},
                           {"iter": 1, "status": "keep", "speedup": 1.2, "ci_low": 1.15, "ci_high": 1.25},
                           {"iter": 2, "status": "revert", "speedup": 1.1, "ci_low": 1.05, "ci_high": 1.15},
                           {"iter": 3, "status": "drop", "speedup": None}]}


def test_the_plots_read_right_at_a_glance():
    """Times on a linear axis from 0 with each speedup written on its bar, a colour per status, a
    dropped iteration still drawn, and no legend over the axes, its ticks or its label."""
    from matplotlib.colors import to_hex

    from flaloop.report import plots
    from flaloop.report.fmt import STATUS_COLORS

    doc = _plot_doc()
    fig = plots.times_figure(doc)
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    assert {t.get_text().strip() for t in ax.texts} >= {"1.45x", "1.46x"}
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert not fig.legends[0].get_window_extent(r).overlaps(ax.get_tightbbox(r))

    assert len(set(STATUS_COLORS.values())) == len(STATUS_COLORS)
    fig = plots.trajectory_figure(doc)
    ax = fig.axes[0]
    crosses = [ln for ln in ax.lines if ln.get_marker() == "x" and len(ln.get_xdata())]
    assert [(c.get_xdata()[0], c.get_ydata()[0]) for c in crosses] == [(3, 1.0)]
    assert to_hex(crosses[0].get_color()) == STATUS_COLORS["drop"]
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert not ax.get_legend().get_window_extent(r).overlaps(ax.get_window_extent(r))


def test_recorded_commands_lose_the_measuring_machines_paths_and_stay_one_shell_word_each():
    cmd = ("flaloop iter chunk_delta_rule 'keep the forward'\"'\"'s intermediates' --repo '/tmp/x y' --json "
           "--python=/opt/py --min-pairs 16")
    got = build.portable_command(cmd)
    assert shlex.split(got) == ["flaloop", "iter", "chunk_delta_rule", "keep the forward's intermediates",
                                "--min-pairs", "16"]
    assert build.portable_command("flaloop 'unclosed") == "flaloop 'unclosed"
