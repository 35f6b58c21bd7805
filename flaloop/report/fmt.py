"""How a number, an interval, a verdict or a status reads, wherever flaloop shows one: the terminal,
REPORT.md, the pull-request comment, sweep.md, `compare`, OPT_LOG.md and the plots.

Formatters take None (nothing measured) and answer "-"; a number is shown with four decimals
(milliseconds, speedups, interval bounds), a share with one. The colours are here too: a verdict's
and a loop status's colour in a plot, a status's style on the terminal, a verdict's emphasis in
markdown. Nothing here imports rich or matplotlib: the strings are theirs to interpret.

`table` is a markdown table for people (a report's, a sweep's, a comparison's); OPT_LOG.md and
dispatch.md, which flaloop reads back to find hand edits, use loop/records.py's tables that round-trip.
"""

from __future__ import annotations

from collections.abc import Sequence

NONE = "-"

# -- colours ------------------------------------------------------------------------------------

GREY = "#57606a"       # SAME, the base, and whatever has no colour of its own
BLUE = "#0969da"       # the geomean, a target line, a signal-only iteration
VERDICT_COLORS = {"FASTER": "#1a7f37", "SLOWER": "#cf222e", "SAME": GREY, "UNSURE": "#bf8700"}
# one colour per loop status (a revert is measured and slower; a drop broke a rule and may have no figure)
STATUS_COLORS = {"baseline": GREY, "keep": "#1a7f37", "revert": "#bc4c00", "drop": "#cf222e",
                 "noise": "#bf8700", "signal": BLUE}
# a loop status on the terminal (rich styles); any other status is bold
STATUS_STYLE = {"keep": "bold green", "revert": "bold yellow", "noise": "yellow", "drop": "bold red",
                "signal": "cyan"}
# a gate's word on the terminal, by whether it is green
GATE_STYLE = {True: "bold green", False: "bold red"}
# a guard finding's severity on the terminal: blocking, a warning, or allowed by the contract
SEVERITY_STYLE = {"block": "bold red", "warn": "yellow", "allowed": "cyan"}
# the verdicts a markdown table sets in bold: the ones that decide something
EMPHASIZED = ("SLOWER", "FASTER")


def verdict_color(verdict: str | None) -> str:
    return VERDICT_COLORS.get(verdict or "", GREY)


def status_color(status: str | None) -> str:
    return STATUS_COLORS.get(status or "", GREY)


def status_style(status: str | None) -> str:
    return STATUS_STYLE.get(status or "", "bold")


def verdict_md(verdict: str | None, status: str | None = None) -> str:
    """A cell's verdict in a markdown table: bold where it decides, else as it is (its status when it
    has no verdict)."""
    if verdict in EMPHASIZED:
        return f"**{verdict}**"
    return verdict or status or NONE


# -- numbers --------------------------------------------------------------------------------------

def num(x: float | None, spec: str = ".4f", none: str = NONE) -> str:
    return none if x is None else format(x, spec)


def ms(x: float | None) -> str:
    """Milliseconds per call: `0.1234`."""
    return num(x)


def pct(x: float | None) -> str:
    """A share already in percent: `42.0%`."""
    return NONE if x is None else f"{x:.1f}%"


def speedup(x: float | None) -> str:
    """`1.0831x`."""
    return NONE if x is None else f"{x:.4f}x"


def interval(lo: float | None, hi: float | None, none: str = NONE) -> str:
    """A 95% CI: `[1.0712, 1.0950]`; `none` when there is no interval."""
    return none if lo is None else f"[{lo:.4f}, {hi:.4f}]"


def geomean(g: dict | None) -> str:
    """A geomean with its interval: `1.0831x [1.0712, 1.0950]`."""
    return NONE if not g else f"{g['speedup']:.4f}x {interval(g['ci_low'], g['ci_high'])}"


def worst(w: dict | None) -> str:
    """The worst cell (`{id, speedup, verdict}`): `s1/fwd 0.9812x SLOWER`."""
    return NONE if not w else f"{w['id']} {w['speedup']:.4f}x {w.get('verdict') or ''}".strip()


def floor_share(pct_of_floor: float | None, above_100: bool = False) -> str:
    """The candidate's share of the roofline floor (100% = as fast as the device can go)."""
    if pct_of_floor is None:
        return NONE
    return f"{pct_of_floor:.0f}%" + (" (>100%!)" if above_100 else "")


def tree_state(head: str | None, dirty: bool = False, diff_hash: str | None = None) -> str:
    """A tree state as a person names it: the commit, and the hash of the uncommitted diff over it."""
    return f"{str(head)[:12]}" + (f"+dirty:{diff_hash}" if dirty else "")


def launches(x: float | None) -> str:
    """Kernel launches per step: whole where they are, one decimal where a mean is not."""
    return NONE if x is None else (f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}")


# -- markdown tables ------------------------------------------------------------------------------

def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table for people: each cell as text, its pipes escaped."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out
