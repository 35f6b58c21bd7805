"""Reading compute-sanitizer's output (pure): the error records of one run by cell, its summary,
and whether the tool ran at all. A record is reduced to (cell, kind, kernel), so that the same bug
reads the same on the base and on the candidate (flaloop/diagnose/sanitizer/flow.py compares them)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from flaloop.diagnose.profile import CELL_MARKER

MARKER = CELL_MARKER  # the step script names each cell before running it
STARTUP = "(start-up)"      # records before the first cell: imports, the worker's hello
# the step script names "(exit)" after the last cell: teardown belongs to no cell
PREFIX = "========="
NO_CUDA = "Target application terminated before first instrumented API call"
# what compute-sanitizer says when it cannot run here (matched lower-case, only without a summary)
REFUSALS = ("not supported", "internal sanitizer error", "failed to initialize", "unable to", "permission",
            "err_nvgpuctrperm", "could not be initialized", "no cuda-capable device", "insufficient")
_ERROR_HEAD = re.compile(r"^(Invalid |Uninitialized |Misaligned |Out-of-range |Illegal |Warp |Lane |"
                         r"Device Hardware|Hardware |Malloc|Free |Leaked |Program hit |Barrier error|"
                         r"(Error|Warning): Race reported)")
_SUMMARY = re.compile(r"^ERROR SUMMARY: ([\d,]+) errors?$")
_NOT_PRINTED = re.compile(r"^ERROR SUMMARY: ([\d,]+) errors? (?:were|was) not printed")
_RACE_SUMMARY = re.compile(r"^RACECHECK SUMMARY: [\d,]+ hazards? displayed \(([\d,]+) errors?, ([\d,]+) warnings?\)")
_RACE = re.compile(r"^(?:(Error|Warning): Race reported between|and) (\w+) access at (.+)$")


@dataclass(frozen=True)
class ErrorRecord:
    """One kind of error in one kernel on one cell, as often as the tool printed it."""

    cell: str
    kind: str                 # e.g. "Invalid __global__ write (out of bounds)", sizes and addresses dropped
    kernel: str | None        # None for an error on a CUDA API call
    severity: str = "error"   # "warning": racecheck's hazards it deems possibly benign
    where: str | None = None  # source file:line, where the tool names one
    count: int = 1
    example: str = ""         # the first record's head and location, as printed

    @property
    def key(self) -> tuple:
        return (self.cell, self.severity, self.kind, self.kernel)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class SanitizerLog:
    """What one compute-sanitizer run printed, read back."""

    records: list[ErrorRecord] = field(default_factory=list)
    errors: int | None = None       # the tool's own count (ERROR / RACECHECK SUMMARY); None: no summary
    warnings: int = 0
    truncated: bool = False         # more errors than --print-limit printed
    no_cuda: bool = False           # the target made no CUDA call (a CPU-only run)
    problem: str | None = None      # a line saying the tool could not run


def parse_log(text: str) -> SanitizerLog:
    """Error records by cell, the summary, and whether the tool ran at all."""
    log = SanitizerLog()
    found: dict[tuple, ErrorRecord] = {}
    cell, cur = STARTUP, None

    def close() -> None:
        nonlocal cur
        if cur is not None:
            rec = _record(cell_of_cur, cur)
            old = found.get(rec.key)
            found[rec.key] = dataclasses.replace(old, count=old.count + 1) if old else rec
        cur = None

    cell_of_cur = cell
    for raw in text.splitlines():
        if raw.startswith(MARKER):
            close()
            cell = raw[len(MARKER):].strip()
            continue
        if not raw.startswith(PREFIX):
            continue  # the target's own output
        body = raw[len(PREFIX):]
        line = body.strip()
        if not line:
            close()  # an empty prefixed line ends a record
            continue
        if len(body) - len(body.lstrip()) > 1:
            if cur is not None:
                cur.append(line)  # a detail line of the record being read
            continue
        close()
        if _head(log, line):
            cur, cell_of_cur = [line], cell
    close()
    log.records = list(found.values())
    return log


def _head(log: SanitizerLog, line: str) -> bool:
    """Read a top-level line into `log`; True when it starts an error record."""
    if _NOT_PRINTED.match(line):
        log.truncated = True
    elif m := _SUMMARY.match(line):
        log.errors = int(m[1].replace(",", ""))
    elif m := _RACE_SUMMARY.match(line):
        log.errors, log.warnings = int(m[1].replace(",", "")), int(m[2].replace(",", ""))
    elif NO_CUDA in line:
        log.no_cuda = True
    elif _ERROR_HEAD.match(line):
        return True
    elif log.problem is None and (line.startswith(("Error", "Internal")) or
                                  any(w in line.lower() for w in REFUSALS)):
        log.problem = line
    return False


def _record(cell: str, lines: list[str]) -> ErrorRecord:
    """One printed record (its head and detail lines) as an ErrorRecord."""
    head = lines[0]
    race = _RACE.match(head)
    if race:
        others = sorted({m[2] for ln in lines[1:] if (m := _RACE.match(ln))})  # the tool's order may vary
        kernel, where = location(race[3])
        kind = f"Race reported between {race[2]} access and {' / '.join(others) or '?'} access"
        return ErrorRecord(cell, kind, kernel, "warning" if race[1] == "Warning" else "error", where,
                           example=head)
    at = next((ln[3:] for ln in lines[1:] if ln.startswith("at ")), None)
    kernel, where = location(at) if at else (None, None)
    kind = normalize_kind(head)
    why = next((m[1] for ln in lines[1:] if (m := re.search(r"is (out of bounds|misaligned)", ln))), None)
    if why:
        kind += f" ({why})"
    return ErrorRecord(cell, kind, kernel, "error", where, example=" / ".join(lines[:2]))


def normalize_kind(head: str) -> str:
    """An error head without what changes from one occurrence to the next (sizes, addresses, codes)."""
    s = re.sub(r" of size \d+ bytes?", "", head)
    s = re.sub(r"0x[0-9a-fA-F]+", "0x?", s)
    s = re.sub(r" \(error \d+\)", "", s)
    return re.sub(r"\s+", " ", s).strip().rstrip(".")


def location(text: str) -> tuple[str | None, str | None]:
    """(kernel, file:line) of an `at ...` clause, in both formats compute-sanitizer has printed:
    `kernel(int *)+0x70`, `kernel+0x110 in chunk.py:42` (2023 on) and `0x70 in file.cu:6:kernel(int *)`."""
    text = re.sub(r"\s*\[[\d,]+ hazards?\]$", "", text.strip())
    if re.match(r"0x[0-9a-fA-F]+\b", text):
        rest = text.split(" in ", 1)[1] if " in " in text else ""
        m = re.match(r"^(?P<file>[^:\s()]+):(?P<line>\d+):(?P<kernel>.+)$", rest)
        if m:
            return kernel_name(m["kernel"]), f"{m['file']}:{m['line']}"
        return kernel_name(rest), None
    head, _, where = text.partition(" in ")
    return kernel_name(head), where.strip() or None


def kernel_name(text: str) -> str | None:
    """A kernel's name without its offset and argument list."""
    s = re.sub(r"\+0x[0-9a-fA-F]+$", "", text.strip())
    return s.split("(", 1)[0].strip() or None


def compare(base: list[ErrorRecord], cand: list[ErrorRecord]) -> tuple[list[ErrorRecord], list[ErrorRecord]]:
    """(what only the candidate has, what the base has too), by (cell, severity, kind, kernel)."""
    seen = {r.key for r in base}
    return [r for r in cand if r.key not in seen], [r for r in cand if r.key in seen]
