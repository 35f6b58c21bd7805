"""Times faster than the hardware allows (GPU MODE reference-kernels #159): whatever made the
timed calls skip their work, the cell's median below its roofline floor (bytes it must move over
the measured bandwidth, FLOPs over the measured GEMM rate) blocks it. The floor's rule is tested on
the CPU in tests/unit/test_guard_judging.py (`below_floor`); here, on a GPU with real FLA, every other
layer that sees a memoized op and may be allowed is allowed away (as a contract may), and the memo
recomputes whenever an input or a result it handed out changes (`timed-call-differs` cannot be
allowed, and the CUDA graph's proof writes NaN into the results it captured: a memo that kept
serving them would be `differs-from-base`), so that the roofline is the last one standing. The
inputs are FLA's registry's with unit-norm q and k, as FLA's tests draw them for the delta rule
(raw randn keys make the base's state grow without bound: non-finite, the cell refused)."""

import shutil

import pytest
from corpus import FLA_ROOT, append, apply
from support.cli import flaloop
from support.repos import commit_all

OP = "chunk_delta_rule"
SHAPE = "B8_T1024_H8_D64"
INPUTS = ["--input", "k=l2norm", "--input", "q=l2norm"]
# the probes that see a memo first; allowed here so that the timing itself is judged
ALLOW = ["inputs-mutated", "self-check", "no-own-kernel", "graph-escape", "eager-disagrees"]
WRAP = "\n\n_op = chunk_delta_rule\n\n\ndef chunk_delta_rule(*args, **kwargs):\n"
# the tensor arguments' in-place versions in the key: inputs redrawn or changed in place (each round's
# draw, the probes' rolled inputs) are computed again, so every check of a result sees a right one
VERSIONS = "tuple(getattr(a, '_' + 'version', None) for a in (*args, *kwargs.values()))"
# the versions of the results it handed out: one written to since (the graph proof's NaN) is computed again
OUT_VERSIONS = "tuple(getattr(o, '_' + 'version', None) for o in (_r if isinstance(_r, tuple) else (_r,)))"
MEMOS = {
    # the result kept on the query tensor, served again while the inputs and it stay as they were
    "kept-on-the-query": [append("fla/ops/delta_rule/chunk.py", WRAP + (
        f"    _d, _n, _v = vars(args[0] if args else kwargs['q']), '_' + 'kept', {VERSIONS}\n"
        "    _e = _d.get(_n)\n"
        "    if _e is not None and _e[0] == _v:\n"
        f"        _r = _e[1]\n        if {OUT_VERSIONS} == _e[2]:\n            return _r\n"
        f"    _r = _op(*args, **kwargs)\n    _d[_n] = (_v, _r, {OUT_VERSIONS})\n"
        "    return _r\n"))],
    # kept in a dict hung on the wrapper, keyed on the tensor arguments' shapes and versions
    "kept-on-the-function-by-shape": [append("fla/ops/delta_rule/chunk.py", WRAP + (
        "    _m = vars(chunk_delta_rule).setdefault('_' + 'm', {})\n"
        f"    _key = (tuple(tuple(a.shape) for a in (*args, *kwargs.values()) if hasattr(a, 'shape')), {VERSIONS})\n"
        "    if _key in _m:\n"
        f"        _r = _m[_key][0]\n        if {OUT_VERSIONS} == _m[_key][1]:\n            return _r\n"
        f"    _r = _op(*args, **kwargs)\n    _m[_key] = (_r, {OUT_VERSIONS})\n"
        "    return _r\n"))],
}

# The layer that stops each memo on the H200 (docs/lab/2026-12-03-h200.md, R21): keyed on shapes and
# versions, a memo serves a fresh draw of the same shape (version 0 again) the stale result, and the
# warm-up's differential check sees it before any timing; kept on the query tensor, only the floor can.
STOPPED_BY = {"kept-on-the-query": "below-floor", "kept-on-the-function-by-shape": "differs-from-base"}


def summary(r) -> str:
    """What a failed bench says in a few lines: the exit code, each cell's status, verdict and reason,
    the findings, the errors, the timeline and the record's path (not the env the record holds)."""
    d = r.json if r.stdout.strip().startswith("{") else None
    if not d:
        return f"exit {r.code}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
    lines = [f"exit {r.code}, record {d.get('path')}"]
    for c in d.get("cells") or []:
        cid = c.get("id") or (c.get("cell") or {}).get("id")
        lines.append(f"cell {cid}: status {c.get('status')}, verdict {c.get('verdict')}, reason {c.get('reason')!r}, "
                     f"timer {c.get('timer')}, pairs {len(c.get('pairs') or [])}")
        setup = c.get("setup") or {}
        for side in ("base", "cand"):
            if (setup.get(side) or {}).get("capture_error"):
                lines.append(f"  {side} capture: {setup[side]['capture_error']}")
    lines += [f"{'BLOCKS' if f.get('blocking') else 'allowed/warn'} {f.get('rule')}: {str(f.get('message'))[:200]}"
              for f in (d.get("guard") or {}).get("findings") or []]
    lines += [f"error: {str(e)[:300]}" for e in d.get("errors") or []]
    lines.append(f"timeline: {d.get('timeline')}")
    return "\n".join(lines)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MEMOS))
def test_a_memoized_op_whose_other_findings_are_allowed_is_blocked_by_its_roofline_floor(tmp_path, name):
    if not FLA_ROOT.is_dir():
        pytest.skip("real FLA is not at .fla/")
    repo = tmp_path / "fla"
    shutil.copytree(FLA_ROOT, repo, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc"))
    commit_all(repo)
    gpu = {"TRITON_INTERPRET": None}  # compiled kernels: the helper sets the interpreter for the CPU
    r = flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd", *INPUTS, env=gpu)
    assert r.code == 0, r.stderr
    args = [a for rule in ALLOW for a in ("--allow", rule)]
    r = flaloop(repo, "audit", OP, *args, "--why", "red-team: the roofline must stop what the other layers allow")
    assert r.code == 0, r.stdout + r.stderr
    apply(repo, MEMOS[name])
    r = flaloop(repo, "bench", OP, "--modes", "fwd", "--rounds", "1", "--min-pairs", "8", "--max-pairs", "8",
                "--unseen-shapes", "0", "--json", env=gpu)
    assert r.code == 1, summary(r)
    rules = {f["rule"] for f in r.json["guard"]["findings"] if f["blocking"]}
    assert STOPPED_BY[name] in rules, summary(r)


@pytest.mark.parametrize("name", sorted(MEMOS))
def test_the_memo_serves_its_result_again_until_an_input_or_the_result_is_written(name):
    """The plant does what the GPU test needs of it, on the CPU with a stand-in for the op: one call
    per input state, another after an input changes in place or after a result it handed out was
    written (the graph proof's NaN), so that only the timing can tell."""
    import torch

    calls = []

    def chunk_delta_rule(q, k, v, beta):
        calls.append(1)
        return q + k + v + beta, None

    ns = {"chunk_delta_rule": chunk_delta_rule}
    exec(MEMOS[name][0][3], ns)
    memo = ns["chunk_delta_rule"]
    x = {n: torch.ones(4) for n in ("q", "k", "v", "beta")}
    first = memo(**x)
    assert memo(**x) is first and len(calls) == 1
    first[0].detach().fill_(float("nan"))
    assert torch.isfinite(memo(**x)[0]).all() and len(calls) == 2
    x["k"].add_(1)
    assert memo(**x)[0][0].item() == 5.0 and len(calls) == 3
    memo(**x)
    assert len(calls) == 3
