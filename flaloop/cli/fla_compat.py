"""FLA users' habits: the flags of `python -m benchmarks.ops.verify` on `flaloop verify`.

FLA's driver is `verify.py --op OP [--base REF] [--modes fwd fwdbwd] [--gate-k EXPR]
[--test-file PATH] [--no-gate] [--profile] [--list] [--kind op]`. flaloop's verify takes the op
as a positional argument, `-k`, and `--modes fwd,fwdbwd`; `--base` and `--no-gate` already mean
the same. `FlaVerifyFlags` is an option group (see `cli.app.with_options`) for the flags
flaloop lacks, and `resolve()` maps them onto flaloop's, so a loop's documented commands work
by swapping the program name:

    python -m benchmarks.ops.verify --op chunk_gla --gate-k T15 --modes fwd fwdbwd
    flaloop verify --op chunk_gla --gate-k T15 --modes fwd fwdbwd

Meanings kept: `--gate-k` is a signal-only `-k` gate; `--test-file` names the gate file, which
in flaloop is frozen by the contract, so it must name that file (another file is refused, with
how to change it); `--profile` adds a torch.profiler step after the bench (`flaloop profile`);
`--list` lists the ops; `--kind layer` is refused, as FLA refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import typer

from flaloop.core.errors import UsageError

MODES = ("fwd", "fwdbwd")


@dataclass
class FlaVerifyFlags:
    op_flag: Annotated[str | None, typer.Option(
        "--op", help="The op, as FLA's verify.py spells it (same as the positional OP).")] = None
    gate_k: Annotated[str | None, typer.Option(
        "--gate-k", help="FLA's spelling of -k: gate on a pytest -k subset (signal only, never a promotion gate).")] = None
    test_file: Annotated[str | None, typer.Option(
        "--test-file", help="The gate's test file (FLA: overrides the derived path); must be the contract's.")] = None
    profile: Annotated[bool, typer.Option(
        "--profile", help="After the bench, profile one step of the first cell (flaloop profile).")] = False
    list_ops: Annotated[bool, typer.Option("--list", help="List the target's ops and exit (flaloop list).")] = False
    kind: Annotated[str, typer.Option("--kind", help="op (FLA reserves 'layer'; not implemented there either).")] = "op"


@dataclass
class VerifyCall:
    """What `flaloop verify` should do once the FLA spellings are mapped."""

    op: str | None
    k_expr: str | None
    modes: str | None
    list_only: bool = False
    profile: bool = False
    test_file: str | None = None
    notes: list[str] = field(default_factory=list)


def resolve(op: str | None, extra: list[str], flags: FlaVerifyFlags, k_expr: str | None,
            modes: str | None) -> VerifyCall:
    """Map FLA's flags onto flaloop's.

    `op` is the positional argument and `extra` the further positional tokens (typer's
    `ctx.args`): with FLA's `--modes fwd fwdbwd` the second mode arrives there, or as the
    positional op when `--op` names the op.
    """
    if flags.kind != "op":
        raise UsageError(f"--kind {flags.kind!r}: only 'op' is implemented (FLA reserves 'layer' too)")
    if flags.list_ops:
        return VerifyCall(None, None, None, list_only=True)
    tokens = ([op] if op is not None else []) + list(extra)
    name = flags.op_flag
    more_modes = []
    for tok in tokens:
        if tok in MODES and modes is not None:
            more_modes.append(tok)  # `--modes fwd fwdbwd`: the second one lands here
        elif name is None:
            name = tok
        elif tok != name:
            raise UsageError(f"two ops given: {name!r} and {tok!r}", "name the op once: `flaloop verify OP` or `--op OP`")
    if name is None:
        raise UsageError("no op given", "`flaloop verify OP` (or FLA's spelling `--op OP`); `--list` lists them")
    if flags.gate_k and k_expr and flags.gate_k != k_expr:
        raise UsageError(f"-k {k_expr!r} and --gate-k {flags.gate_k!r} disagree", "give one of them")
    if modes is not None:
        parts = [m for item in [modes, *more_modes] for m in item.replace(" ", ",").split(",") if m]
        bad = [m for m in parts if m not in MODES]
        if bad:
            raise UsageError(f"unknown mode(s) {', '.join(bad)}", "choose from fwd, fwdbwd")
        modes = ",".join(dict.fromkeys(parts))
    notes = []
    if flags.op_flag:
        notes.append("--op is FLA's spelling of the positional OP")
    if flags.gate_k:
        notes.append("--gate-k is FLA's spelling of -k: a signal-only gate")
    return VerifyCall(name, flags.gate_k or k_expr, modes, profile=flags.profile, test_file=flags.test_file,
                      notes=notes)


def check_test_file(call: VerifyCall, contract_test_file: str) -> None:
    """FLA's --test-file picks the gate file; flaloop's is frozen by the contract, so it must match."""
    if call.test_file is None:
        return
    want = contract_test_file.strip().removeprefix("./")
    got = call.test_file.strip().removeprefix("./")
    if got != want:
        raise UsageError(
            f"--test-file {call.test_file} is not the contract's gate file {contract_test_file}",
            "the gate file is frozen in the contract: set test_file= on the op's registry entry (or "
            "`test_file = ...` under [ops.OP] in flaloop.toml) and rerun `flaloop init OP --force`")
