"""Times faster than the hardware allows (GPU MODE reference-kernels #159): whatever made the
timed calls skip their work, the cell's median below its roofline floor (bytes it must move over
the measured bandwidth, FLOPs over the measured GEMM rate) blocks it. The floor's rule is tested on
the CPU in tests/test_guard_judging.py (`below_floor`); here, on a GPU with real FLA, every other
layer that sees a memoized op and may be allowed is allowed away (as a contract may), and the memo
recomputes whenever an input changes (`timed-call-differs` cannot be allowed), so that the roofline
is the last one standing."""

import shutil

import pytest
from conftest import commit_all, flaloop
from corpus import FLA_ROOT, append, apply

OP = "chunk_delta_rule"
SHAPE = "B8_T1024_H8_D64"
# the probes that see a memo first; allowed here so that the timing itself is judged
ALLOW = ["inputs-mutated", "self-check", "no-own-kernel", "graph-escape", "eager-disagrees"]
WRAP = "\n\n_op = chunk_delta_rule\n\n\ndef chunk_delta_rule(*args, **kwargs):\n"
# the tensor arguments' in-place versions in the key: inputs redrawn or changed in place (each round's
# draw, the probes' rolled inputs) are computed again, so every check of a result sees a right one
VERSIONS = "tuple(getattr(a, '_' + 'version', None) for a in (*args, *kwargs.values()))"
MEMOS = {
    # the result kept on the query tensor, served again while the inputs stay as they were
    "kept-on-the-query": [append("fla/ops/delta_rule/chunk.py", WRAP + (
        f"    _d, _n, _v = vars(args[0] if args else kwargs['q']), '_' + 'kept', {VERSIONS}\n"
        "    if _d.get(_n, (None,))[0] != _v:\n        _d[_n] = (_v, _op(*args, **kwargs))\n"
        "    return _d[_n][1]\n"))],
    # kept in a dict hung on the wrapper, keyed on the tensor arguments' shapes and versions
    "kept-on-the-function-by-shape": [append("fla/ops/delta_rule/chunk.py", WRAP + (
        "    _m = vars(chunk_delta_rule).setdefault('_' + 'm', {})\n"
        f"    _key = (tuple(tuple(a.shape) for a in (*args, *kwargs.values()) if hasattr(a, 'shape')), {VERSIONS})\n"
        "    if _key not in _m:\n        _m[_key] = _op(*args, **kwargs)\n"
        "    return _m[_key]\n"))],
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MEMOS))
def test_a_memoized_op_whose_other_findings_are_allowed_is_blocked_by_its_roofline_floor(tmp_path, name):
    if not FLA_ROOT.is_dir():
        pytest.skip("real FLA is not at .fla/")
    repo = tmp_path / "fla"
    shutil.copytree(FLA_ROOT, repo, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc"))
    commit_all(repo)
    gpu = {"TRITON_INTERPRET": None}  # compiled kernels: the helper sets the interpreter for the CPU
    r = flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd", env=gpu)
    assert r.code == 0, r.stderr
    args = [a for rule in ALLOW for a in ("--allow", rule)]
    r = flaloop(repo, "audit", OP, *args, "--why", "red-team: the roofline must stop what the other layers allow")
    assert r.code == 0, r.stdout + r.stderr
    apply(repo, MEMOS[name])
    r = flaloop(repo, "bench", OP, "--modes", "fwd", "--rounds", "1", "--min-pairs", "8", "--max-pairs", "8",
                "--unseen-shapes", "0", "--json", env=gpu)
    assert r.code == 1, r.stdout[-3000:] + r.stderr[-3000:]
    rules = {f["rule"] for f in r.json["guard"]["findings"] if f["blocking"]}
    assert "below-floor" in rules, r.json["guard"]["findings"]
