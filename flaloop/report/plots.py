"""The report's PNG plots (matplotlib, Agg backend): speedup per cell with its CI, device and
eager time per cell, and the loop's trajectory. Imported only when a report is written."""

from __future__ import annotations

from pathlib import Path

VERDICT_COLORS = {"FASTER": "#1a7f37", "SLOWER": "#cf222e", "SAME": "#57606a", "UNSURE": "#bf8700"}
# one colour per status (a revert is measured and slower; a drop broke a rule and may have no figure)
STATUS_COLORS = {"baseline": "#57606a", "keep": "#1a7f37", "revert": "#bc4c00", "drop": "#cf222e",
                 "noise": "#bf8700", "signal": "#0969da"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speedup_plot(doc: dict, path: Path) -> Path | None:
    rows = [r for r in doc["cells"] if r["speedup"]]
    if not rows:
        return None
    plt = _plt()
    geo = doc["summary"]["geomean"]
    labels = [r["id"] for r in rows] + (["geomean"] if geo else [])
    vals = [r["speedup"] for r in rows] + ([geo["speedup"]] if geo else [])
    lo = [r["ci_low"] for r in rows] + ([geo["ci_low"]] if geo else [])
    hi = [r["ci_high"] for r in rows] + ([geo["ci_high"]] if geo else [])
    colors = [VERDICT_COLORS.get(r["verdict"], "#57606a") for r in rows] + (["#0969da"] if geo else [])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.6))
    y = list(range(len(labels)))[::-1]
    for yi, v, a, b, c in zip(y, vals, lo, hi, colors, strict=True):
        ax.errorbar([v], [yi], xerr=[[v - a], [b - v]], fmt="o", color=c, capsize=4)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y, labels)
    ax.set_xlabel("speedup (base / candidate device time), 95% CI")
    ax.set_title(f"{doc['op']}: speedup per cell")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def times_plot(doc: dict, path: Path) -> Path | None:
    return _save(times_figure(doc), path)


def _save(fig, path: Path) -> Path | None:
    if fig is None:
        return None
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


def times_figure(doc: dict):
    """Base and candidate per cell on a linear axis from 0 (a log axis, or one that starts near the
    bars' ends, makes a 1.45x win look like 10x), each candidate bar labelled with its speedup."""
    rows = [r for r in doc["cells"] if (r["device"]["base"] or {}).get("median")]
    if not rows:
        return None
    plt = _plt()
    series = [("base device", "device", "base", "#8c959f"), ("cand device", "device", "cand", "#1a7f37"),
              ("base eager", "eager", "base", "#d0d7de"), ("cand eager", "eager", "cand", "#7ee2a8")]
    series = [s for s in series if any((r[s[1]][s[2]] or {}).get("median") for r in rows)]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) * len(series) + 1.8), layout="constrained")
    h = 0.8 / len(series)
    top = 0.0
    for i, (label, key, side, color) in enumerate(series):
        ys = [len(rows) - 1 - j + ((len(series) - 1) / 2 - i) * h for j in range(len(rows))]
        xs = [((r[key][side] or {}).get("median") or 0.0) for r in rows]
        top = max(top, *xs)
        ax.barh(ys, xs, height=h, color=color, label=label)
        if side == "cand":
            for y, x, r in zip(ys, xs, rows, strict=True):
                base = (r[key]["base"] or {}).get("median")
                if x and base:
                    ax.text(x, y, f" {base / x:.2f}x", va="center", fontsize=7)
    ax.set_yticks(range(len(rows))[::-1], [r["id"] for r in rows])
    ax.set_xlim(0, top * 1.18)  # from 0: bar lengths compare as the times do; room for the labels
    ax.set_xlabel("ms per call (median); labels: base / candidate")
    ax.set_title(f"{doc['op']}: device time and eager latency per cell")
    ax.grid(axis="x", alpha=0.3)
    # below the axis label, laid out with it: never over a bar or the label
    fig.legend(loc="outside lower center", ncol=len(series), fontsize=8, frameon=False)
    return fig


def trajectory_plot(doc: dict, path: Path) -> Path | None:
    return _save(trajectory_figure(doc), path)


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
            ax.plot([x], [1.0], "o", color=STATUS_COLORS["baseline"])  # the base itself
        if t["speedup"]:
            c = STATUS_COLORS.get(t["status"], "#57606a")
            ax.errorbar([x], [t["speedup"]], yerr=[[t["speedup"] - t["ci_low"]], [t["ci_high"] - t["speedup"]]],
                        fmt="o", color=c, capsize=3)
            if t["status"] in ("keep", "baseline"):
                best = max(best, t["speedup"]) if t["status"] == "keep" else best
        elif t["status"] != "baseline":  # no figure (a red gate, a blocked bench): a cross on the 1.0 line
            ax.plot([x], [1.0], "x", color=STATUS_COLORS.get(t["status"], "#57606a"), ms=8, mew=2)
        best_x.append(x)
        best_y.append(best)
    ax.step(best_x, best_y, where="post", color="#1a7f37", lw=1, label="best kept")
    target = doc["summary"].get("target_speedup")
    if target:
        ax.axhline(target, color="#0969da", ls="--", lw=0.8, label=f"target {target:g}x")
    ax.axhline(1.0, color="black", lw=0.6)
    for status, c in STATUS_COLORS.items():
        if any(t["status"] == status for t in rows):
            ax.plot([], [], "o", color=c, label=status)
    if any(not t["speedup"] and t["status"] != "baseline" for t in rows):
        ax.plot([], [], "x", color="#57606a", mew=2, label="no figure (gate red or blocked)")
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
                        [b + w for b, w in zip(base, width, strict=False)], color="#57606a", alpha=0.25, label="band")
        ax.plot(steps, base, color="#57606a", lw=1.2, label="base")
        ax.plot(steps[:len(cand)], cand, color="#0969da", lw=1.0, ls="--", label="candidate")
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{doc['op']} in {((doc['model'].get('model') or {}).get('model_class'))}: base vs candidate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(doc: dict, out_dir: Path) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, fn in (("speedup", speedup_plot), ("times", times_plot), ("trajectory", trajectory_plot),
                     ("model", model_plot)):
        p = fn(doc, out_dir / f"{name}.png")
        if p:
            made[name] = str(p)
    return made
