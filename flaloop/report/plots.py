"""The report's PNG plots (matplotlib, Agg backend): speedup per cell with its CI, device and
eager time per cell, the loop's trajectory, the model check's trajectories, a sweep's geomeans.
Imported only when a plot is drawn."""

from __future__ import annotations

from pathlib import Path

from flaloop.report import fmt
from flaloop.report.cells import CellView


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speedup_plot(doc: dict, path: Path) -> Path | None:
    views = [v for v in map(CellView.from_dict, doc["cells"]) if v.speedup]
    if not views:
        return None
    plt = _plt()
    geo = doc["summary"]["geomean"]
    labels = [v.id for v in views] + (["geomean"] if geo else [])
    vals = [v.speedup for v in views] + ([geo["speedup"]] if geo else [])
    lo = [v.ci_low for v in views] + ([geo["ci_low"]] if geo else [])
    hi = [v.ci_high for v in views] + ([geo["ci_high"]] if geo else [])
    colors = [fmt.verdict_color(v.verdict) for v in views] + ([fmt.BLUE] if geo else [])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.6))
    y = list(range(len(labels)))[::-1]
    for yi, v, a, b, c in zip(y, vals, lo, hi, colors, strict=True):
        _interval_x(ax, v, yi, a, b, c)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y, labels)
    ax.set_xlabel("speedup (base / candidate device time), 95% CI")
    ax.set_title(f"{doc['op']}: speedup per cell")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def times_plot(doc: dict, path: Path) -> Path | None:
    return _save(times_figure(doc), path, bbox_inches="tight")


def _save(fig, path: Path, **savefig) -> Path | None:
    """`fig` as a PNG at `path` (110 dpi), closed; None for no figure."""
    if fig is None:
        return None
    fig.savefig(path, dpi=110, **savefig)
    _plt().close(fig)
    return path


def _interval_x(ax, x: float, y: float, lo: float, hi: float, color: str) -> None:
    """One estimate on a horizontal axis with its interval as error bars."""
    ax.errorbar([x], [y], xerr=[[x - lo], [hi - x]], fmt="o", color=color, capsize=4)


def times_figure(doc: dict):
    """Base and candidate per cell on a linear axis from 0 (a log axis, or one that starts near the
    bars' ends, makes a 1.45x win look like 10x), each candidate bar labelled with its speedup."""
    views = [v for v in map(CellView.from_dict, doc["cells"]) if v.ms("base")]
    if not views:
        return None
    plt = _plt()
    series = [("base device", False, "base", "#8c959f"), ("cand device", False, "cand", "#1a7f37"),
              ("base eager", True, "base", "#d0d7de"), ("cand eager", True, "cand", "#7ee2a8")]
    series = [s for s in series if any(v.ms(s[2], eager=s[1]) for v in views)]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(views) * len(series) + 1.8), layout="constrained")
    h = 0.8 / len(series)
    top = 0.0
    for i, (label, eager, side, color) in enumerate(series):
        ys = [len(views) - 1 - j + ((len(series) - 1) / 2 - i) * h for j in range(len(views))]
        xs = [v.ms(side, eager=eager) or 0.0 for v in views]
        top = max(top, *xs)
        ax.barh(ys, xs, height=h, color=color, label=label)
        if side == "cand":
            for y, x, v in zip(ys, xs, views, strict=True):
                base = v.ms("base", eager=eager)
                if x and base:
                    ax.text(x, y, f" {base / x:.2f}x", va="center", fontsize=7)
    ax.set_yticks(range(len(views))[::-1], [v.id for v in views])
    ax.set_xlim(0, top * 1.18)  # from 0: bar lengths compare as the times do; room for the labels
    ax.set_xlabel("ms per call (median); labels: base / candidate")
    ax.set_title(f"{doc['op']}: device time and eager latency per cell")
    ax.grid(axis="x", alpha=0.3)
    # below the axis label, laid out with it: never over a bar or the label
    fig.legend(loc="outside lower center", ncol=len(series), fontsize=8, frameon=False)
    return fig


def trajectory_plot(doc: dict, path: Path) -> Path | None:
    return _save(trajectory_figure(doc), path, bbox_inches="tight")


def trajectory_figure(doc: dict):
    rows = doc["trajectory"]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    best, best_x, best_y = 1.0, [], []
    for t in rows:
        x = t["iter"]
        if t["status"] == "baseline" and not t["speedup"]:
            ax.plot([x], [1.0], "o", color=fmt.STATUS_COLORS["baseline"])  # the base itself
        if t["speedup"]:
            c = fmt.status_color(t["status"])
            ax.errorbar([x], [t["speedup"]], yerr=[[t["speedup"] - t["ci_low"]], [t["ci_high"] - t["speedup"]]],
                        fmt="o", color=c, capsize=3)
            if t["status"] in ("keep", "baseline"):
                best = max(best, t["speedup"]) if t["status"] == "keep" else best
        elif t["status"] != "baseline":  # no figure (a red gate, a blocked bench): a cross on the 1.0 line
            ax.plot([x], [1.0], "x", color=fmt.status_color(t["status"]), ms=8, mew=2)
        best_x.append(x)
        best_y.append(best)
    ax.step(best_x, best_y, where="post", color="#1a7f37", lw=1, label="best kept")
    target = doc["summary"].get("target_speedup")
    if target:
        ax.axhline(target, color=fmt.BLUE, ls="--", lw=0.8, label=f"target {target:g}x")
    ax.axhline(1.0, color="black", lw=0.6)
    for status, c in fmt.STATUS_COLORS.items():
        if any(t["status"] == status for t in rows):
            ax.plot([], [], "o", color=c, label=status)
    if any(not t["speedup"] and t["status"] != "baseline" for t in rows):
        ax.plot([], [], "x", color=fmt.GREY, mew=2, label="no figure (gate red or blocked)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("geomean speedup vs base (95% CI)")
    ax.set_title(f"{doc['op']}: optimization trajectory")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside, never on a point
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def model_plot(doc: dict, path: Path) -> Path | None:
    """The model check's trajectories: the base's loss and gradient norm with the band around them,
    the candidate's over it."""
    tr = (doc.get("model") or {}).get("trajectory") or {}
    j = tr.get("judgement") or {}
    if not (tr.get("base") and tr.get("cand") and j):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, series, label in zip(axes, ("losses", "grad_norms"), ("loss", "gradient norm"), strict=True):
        base, cand = tr["base"].get(series) or [], tr["cand"].get(series) or []
        width = (j.get("band") or {}).get(series) or [0.0] * len(base)
        steps = list(range(1, len(base) + 1))
        ax.fill_between(steps, [b - w for b, w in zip(base, width, strict=False)],
                        [b + w for b, w in zip(base, width, strict=False)], color=fmt.GREY, alpha=0.25, label="band")
        ax.plot(steps, base, color=fmt.GREY, lw=1.2, label="base")
        ax.plot(steps[:len(cand)], cand, color=fmt.BLUE, lw=1.0, ls="--", label="candidate")
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{doc['op']} in {((doc['model'].get('model') or {}).get('model_class'))}: base vs candidate")
    fig.tight_layout()
    return _save(fig, path)


def sweep_plot(rec, path: Path) -> Path | None:
    """sweep.png of a sweep (sweep/record.SweepRecord): each measured row's geomean with its CI; blocked
    and failed rows named, without a point."""
    rows = rec.rows
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.6))
    labels = []
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        name = r.ref if rec.kind == "candidates" else r.op
        labels.append((y, name if len(name) <= 40 else "..." + name[-37:]))
        g = r.geomean
        if r.status == "ok" and g:
            _interval_x(ax, g["speedup"], y, g["ci_low"], g["ci_high"], fmt.verdict_color(r.verdict))
        else:
            ax.text(1.0, y, f"  {r.status.upper()}", va="center", color="#cf222e" if r.status == "blocked" else "#6e7781")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_yticks([y for y, _ in labels], [n for _, n in labels])
    ax.set_xlabel("geomean speedup vs base (base / candidate device time), 95% CI")
    ax.set_title(f"sweep of {', '.join(rec.ops)[:60]} against {rec.base.commit[:12]}")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def write_plots(doc: dict, out_dir: Path) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, fn in (("speedup", speedup_plot), ("times", times_plot), ("trajectory", trajectory_plot),
                     ("model", model_plot)):
        p = fn(doc, out_dir / f"{name}.png")
        if p:
            made[name] = str(p)
    return made
