"""TRAPS.md: the ways a kernel optimization goes wrong or looks better than it is.

`flaloop baseline` seeds `profile/<op>-opt/TRAPS.md` from the catalogue below; `flaloop trap add`
appends one trap. The file is the user's after seeding: flaloop only appends a section at the
end, so hand edits stay. Each trap is Fact (what is true), Why (why it bites), How to apply
(what to do about it), in flaloop's own words; METHOD.md has the measurements behind several.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flaloop.core.workspace import Workspace
from flaloop.loop.store import atomic_write


@dataclass(frozen=True)
class Trap:
    title: str
    fact: str
    why: str
    how: str
    source: str = "flaloop catalogue"


CATALOGUE = (
    Trap("NaN poisoning and partial writes",
         "A kernel that forgets to store part of its output (the last chunk, a masked tail) still passes a "
         "test whose output buffer already holds the right numbers: torch.empty often hands back the memory "
         "of the previous, correct call.",
         "The gate then proves nothing about the rows the kernel never wrote.",
         "Keep the test's NaN-filled allocation (FLA's conftest poisons torch.empty) and never run the gate "
         "from a path containing `tests/` or `test_`, where that poisoning switches itself off; flaloop runs "
         "it through a neutral symlink for this reason."),
    Trap("TF32 in fp32 references",
         "With TF32 allowed, an fp32 matmul on Ampere or newer rounds its inputs to 10 mantissa bits, so an "
         "'fp32' reference computed that way is only good to about 1e-3.",
         "A loose reference widens what the test accepts, and a candidate that turns TF32 on for itself buys "
         "speed with precision the contract did not give away.",
         "Compute references with TF32 off (input_precision='ieee' in Triton); treat any change to allow_tf32, "
         "TRITON_F32_DEFAULT or input_precision in the op's code as a finding to justify."),
    Trap("assert_close's relative tolerance",
         "A check of the form |a - b| <= atol + rtol * |b| accepts large absolute errors where the reference "
         "is large, and FLA's assert_close compares an RMS error ratio over the whole tensor.",
         "A few wrong elements, or a small systematic scale error, pass.",
         "Never loosen a tolerance (the frozen set catches it); read the error ratio the test prints, not "
         "just pass or fail; rely on the bench's base-versus-candidate check at the larger bench shapes too."),
    Trap("One-sided numeric flags",
         "Flags such as allow_tf32, fast-math intrinsics, a lower-precision accumulator or FLA_CI_ENV change "
         "the numbers or turn failures into warnings, and can be flipped for one side only.",
         "Base and candidate are then compared under different rules.",
         "Both sides compute under the same flags: the gate strips weakening variables, and a precision flag "
         "in the diff is a guard finding until justified in the contract."),
    Trap("Autotune-cache staleness across edits",
         "Triton caches autotune picks by kernel source and key; an edit to launch code in Python (a grid, a "
         "heuristic) leaves the kernel's source unchanged and reuses a pick tuned for different code. Two "
         "processes tuning the same kernel can also pick different configs.",
         "The measured difference then belongs to a config choice, not to the change.",
         "After editing launch code, delete the workspace's Triton cache (profile/<op>-opt/triton-cache); "
         "read the autotune picks listed under the bench table when two sides differ."),
    Trap("int64 address arithmetic",
         "Offsets such as (bos + t) * H * K overflow int32 once a tensor passes 2^31 elements, and Triton "
         "computes in int32 unless an operand is int64.",
         "Test shapes are small: a kernel that drops a `.to(tl.int64)` passes the gate and corrupts memory "
         "at long sequences.",
         "Keep int64 casts on sequence and batch offsets; when the op can see such sizes, run one shape above "
         "2^31 elements before promoting."),
    Trap("Implausible speedups",
         "A speedup beyond what the op's memory traffic and FLOPs allow on the device, or far beyond what the "
         "diff could explain, is nearly always a fault: a skipped kernel, a cached result, a patched timer.",
         "Celebrating it ships a wrong kernel or a broken benchmark.",
         "Compare each cell with its roofline floor and investigate anything past it; check that the "
         "candidate still launches its own kernels."),
    Trap("Host-bound small shapes",
         "At small shapes the Python wrapper's host time (0.5-0.8 ms per call in FLA) exceeds the GPU time, "
         "so eager timings measure launch overhead.",
         "A kernel improvement reads as nothing there, and trimming Python overhead reads as a kernel win.",
         "Take device time (CUDA graph replay) as the primary number and eager latency as the second; a cell "
         "marked launch-bound needs a host-side change to gain in eager use."),
    Trap("Un-normalized delta-rule keys",
         "Delta-rule ops assume L2-normalized keys; fed raw random keys, as FLA's registry does, their "
         "gradients turn NaN at B8_T1024_H8_D64.",
         "The benchmark then times a kernel chewing NaNs, and comparing NaN outputs checks nothing.",
         "Normalize the keys for the bench (`flaloop init OP --input k=l2norm`); the bench refuses a cell "
         "whose base outputs are not finite."),
    Trap("The start-order effect",
         "On the H200, whichever side's process started and set up first ran a cell about 0.5-0.7% slower, "
         "and the process that compiled and autotuned ran about 1.1% slower than processes that loaded the "
         "same kernels from the cache.",
         "A bench with one process per side reads a process effect of that size as a code effect.",
         "Measure in fresh processes that compiled nothing, in rounds with the start order swapped, and "
         "require every round to agree (flaloop bench does); distrust sub-1% differences from one process "
         "pair."),
)

_HEAD = re.compile(r"^## T(\d+)\. (.*)$")
_FIELD = re.compile(r"^- \*\*(Fact|Why|How to apply):\*\* (.*)$")
_SOURCE = re.compile(r"^- \*Source:\* (.*)$")


def render_trap(n: int, t: Trap) -> str:
    return (f"## T{n}. {t.title}\n- **Fact:** {_line(t.fact)}\n- **Why:** {_line(t.why)}\n"
            f"- **How to apply:** {_line(t.how)}\n- *Source:* {_line(t.source)}\n")


def _line(text: str) -> str:
    return " ".join(text.split())


def render_traps(op: str, traps: list[Trap] | tuple[Trap, ...]) -> str:
    head = (f"# Traps: `{op}`\n\nWays a kernel optimization goes wrong or looks better than it is. Seeded from "
            f"flaloop's catalogue; `flaloop trap add {op} --fact ... --why ... --how ...` appends one.\n"
            "This file is yours: flaloop only ever appends to it.\n")
    return head + "".join("\n" + render_trap(i + 1, t) for i, t in enumerate(traps))


def parse_traps(text: str) -> list[Trap]:
    """The traps of a TRAPS.md, in order (hand-added sections in the same shape included)."""
    traps, cur = [], None
    for line in text.splitlines():
        m = _HEAD.match(line)
        if m:
            if cur:
                traps.append(Trap(**cur))
            cur = {"title": m.group(2).strip(), "fact": "", "why": "", "how": "", "source": ""}
            continue
        if cur is None:
            continue
        f = _FIELD.match(line)
        if f:
            cur[{"Fact": "fact", "Why": "why", "How to apply": "how"}[f.group(1)]] = f.group(2).strip()
        s = _SOURCE.match(line)
        if s:
            cur["source"] = s.group(1).strip()
    if cur:
        traps.append(Trap(**cur))
    return traps


def seed(ws: Workspace, op: str) -> bool:
    """Write TRAPS.md from the catalogue unless it exists; True when written."""
    if ws.traps_md.exists():
        return False
    atomic_write(ws.traps_md, render_traps(op, CATALOGUE))
    return True


def add(ws: Workspace, op: str, trap: Trap) -> int:
    """Append one trap (seeding the file first if needed); its number."""
    seed(ws, op)
    text = ws.traps_md.read_text()
    numbers = [int(m.group(1)) for m in (_HEAD.match(ln) for ln in text.splitlines()) if m]
    n = max(numbers, default=0) + 1
    atomic_write(ws.traps_md, text.rstrip("\n") + "\n\n" + render_trap(n, trap))
    return n
