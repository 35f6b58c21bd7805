"""benchmarks/run.py's `replay` suite (issue 36, items 2 and 3) on FLA's chunk_delta_rule: the gate
at the base records the test's own calls (`gate/calls.json`); then

- options: the op's public function, wrapped at the end of its module, halves any initial state it
  is given (the registry never passes one): `bench --test-calls 0` must block it as
  `unseen-option-differs`, naming initial_state, while every cell and unseen shape matches;
- test calls: the same function off by 1% wherever a scale is passed (the registry and the
  unseen draw never pass one; the tests do) and `fla.utils.assert_close` rebound to a no-op at
  import (the gate reads green): `verify --unseen-options 0` must block it as `test-call-differs`;
- the cost: `bench --aa` of the base twice (cold, then warm Triton cache): the seconds of the test
  calls and the options, and their share of the run (the record's `test_calls` and `unseen`).

Both plants are Python-level wrappers (functools.wraps keeps the signature), so they hold across
FLA versions whatever the kernels look like.
"""

from __future__ import annotations

import json

from harness import (  # benchmarks/ first on sys.path
    OP,
    SMALL,
    Ctx,
    cells_line,
    fla_copy,
    goal,
    init,
    record_of,
    run,
    write,
)

PAIRS = ["--min-pairs", "8", "--max-pairs", "24", "--cell-seconds", "10"]
OPTION_PLANT = f'''

import functools as _flaloop_functools

_flaloop_planted = {OP}


@_flaloop_functools.wraps(_flaloop_planted)
def {OP}(*args, initial_state=None, **kwargs):
    half = None if initial_state is None else initial_state * 0.5
    return _flaloop_planted(*args, initial_state=half, **kwargs)
'''
CALL_PLANT = f'''

import functools as _flaloop_functools

from fla import utils as _flaloop_utils

_flaloop_utils.__dict__['_'.join(('assert', 'close'))] = lambda *args, **kwargs: None
_flaloop_planted = {OP}


@_flaloop_functools.wraps(_flaloop_planted)
def {OP}(*args, **kwargs):
    out = _flaloop_planted(*args, **kwargs)
    if kwargs.get('scale') is None:
        return out
    return (out[0] * 1.01, *out[1:]) if isinstance(out, tuple) else out * 1.01
'''


def _findings(rec: dict) -> list[dict]:
    return [f for f in (rec.get("guard") or {}).get("findings") or [] if f.get("blocking")]


def suite_replay(ctx: Ctx) -> None:
    repo = fla_copy(ctx, "replay")
    init(ctx, repo, [SMALL])
    env = ctx.env(gpus=ctx.gpus[:1])
    d = ctx.out / "replay"
    lines: list[str] = []
    ws = repo / "profile" / f"{OP}-opt"

    # the gate on the clean base records the test's calls
    code, wall, doc = run(ctx, ["gate", OP, "--repo", str(repo), "--json"], d / "gate-base", env=env)
    calls = ws / "gate" / "calls.json"
    got = json.loads(calls.read_text()) if calls.exists() else {"calls": []}
    fns = sorted({c["fn"] for c in got["calls"]})
    lines.append(f"gate at the base: exit {code} in {wall:.1f}s; {len(got['calls'])} distinct calls of {len(fns)} "
                 f"functions: {fns[:8]}")
    goal("test calls recorded at the base", code == 0 and any(f.endswith(f":{OP}") for f in fns),
         f"exit {code}, {len(got['calls'])} calls")

    # the cost, on an A/A of the base: cold, then warm
    for label in ("cold", "warm"):
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--aa", "--json", *PAIRS], d / f"aa-{label}",
                              env=env)
        rec = record_of(doc) or {}
        tc, u = rec.get("test_calls") or {}, rec.get("unseen") or {}
        o = u.get("options") or {}
        lines.append(f"A/A {label}: exit {code} in {wall:.1f}s (record wall {rec.get('wall_s')} s); test calls "
                     f"{tc.get('checked')} checked, {tc.get('skipped')} skipped, {tc.get('unstable')} unstable, "
                     f"{tc.get('seconds')} s = {tc.get('share')} of the run; options {o.get('checked')} checked, "
                     f"{o.get('skipped')} skipped, {o.get('seconds')} s; unseen (with options) {u.get('seconds')} s = "
                     f"{u.get('share')}")
        for c in (tc.get("calls") or []) + (o.get("combos") or []):
            if c.get("status") != "match":
                lines.append(f"    {c.get('status')}: {c.get('call') or c.get('options')}: {str(c.get('why'))[:200]}")
    entry = json.loads((ws / "contract.json").read_text())["entry_file"]
    src = (repo / entry).read_text()
    try:
        # options nobody calls, the test calls off: only the options can see it
        (repo / entry).write_text(src + OPTION_PLANT)
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--json", "--test-calls", "0", *PAIRS],
                              d / "option-plant", env=env)
        rec = record_of(doc) or {}
        found = _findings(rec)
        lines.append(f"initial state halved: exit {code} in {wall:.1f}s")
        lines += [f"    {f['rule']}: {f['message'][:300]}" for f in found[:4]]
        lines += cells_line(rec)
        goal("option plant blocked by the options", code == 1 and any(
            f["rule"] == "unseen-option-differs" and "initial_state=tensor" in f["message"] for f in found),
            f"exit {code}, blocking rules {sorted({f['rule'] for f in found})}")

        # the tests' own calls, the judge loosened in the gate's process, the options off: the gate's
        # in-memory freeze turns verify red (gate-tampered), and a bench with no gate at all must block
        # the kernel by the replayed calls alone
        (repo / entry).write_text(src + CALL_PLANT)
        code, wall, doc = run(ctx, ["verify", OP, "--repo", str(repo), "--json", "--unseen-options", "0", *PAIRS],
                              d / "call-plant-verify", env=env)
        gate = (doc or {}).get("gate") or {}
        tampered = "gate-tampered" in json.dumps(gate)
        lines.append(f"scale off by 1% and assert_close a no-op, verify: exit {code} in {wall:.1f}s, gate green "
                     f"{gate.get('green')}, gate-tampered named {tampered}")
        goal("loosened judge turns the gate red", code == 1 and gate.get("green") is False and tampered,
             f"exit {code}, gate green {gate.get('green')}, gate-tampered named {tampered}")
        code, wall, doc = run(ctx, ["bench", OP, "--repo", str(repo), "--json", "--unseen-options", "0", *PAIRS],
                              d / "call-plant", env=env)
        rec = record_of(doc) or {}
        found = _findings(rec)
        lines.append(f"the same, bench with no gate: exit {code} in {wall:.1f}s")
        lines += [f"    {f['rule']}: {f['message'][:300]}" for f in found[:4]]
        goal("wrong kernel on the tests' calls blocked by the replay alone", code == 1 and any(
            f["rule"] == "test-call-differs" for f in found),
            f"exit {code}, blocking rules {sorted({f['rule'] for f in found})}")
    finally:
        (repo / entry).write_text(src)
    write(d / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
