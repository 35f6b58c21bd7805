"""Which backend served each side's calls (issue 24): the toy op dispatched through a backend
registry shaped like FLA's `fla.ops.backends` (per operation a registry, backends tried in order
with a verifier, the op's own code when none takes the call, `_logged` keys of what served).

A candidate whose edit makes the verifier decline runs the op's own code instead: the results
agree, so only the backend census sees it (`backend-differs`, blocking). The same switch asked for
with `--cand-env` is expected and named. An honest edit passes with both sides on one backend."""

from __future__ import annotations

from flaloop.guard.dynamic import backend_differences


def test_differences_name_the_variables_that_switch_the_backends_involved():
    base = {"chunk": {"registered": {"tilelang": "FLA_TILELANG", "triton": None},
                      "served": ["chunk_bwd_dqkwg -> tilelang", "chunk_fwd -> triton"], "rejected": []}}
    cand = {"chunk": {"registered": {"tilelang": "FLA_TILELANG", "triton": None},
                      "served": ["chunk_fwd -> triton"], "rejected": ["chunk_bwd_dqkwg -> tilelang"]}}
    assert backend_differences(base, cand) == [("chunk.chunk_bwd_dqkwg: base tilelang, candidate (its own code)",
                                                {"FLA_TILELANG"})]
    assert backend_differences(base, base) == [] and backend_differences({}, {}) == []
    gone = {"chunk": {**cand["chunk"], "registered": {"triton": None}}}
    lines = [line for line, _ in backend_differences(base, gone)]
    assert "chunk: backends registered base ['tilelang', 'triton'], candidate ['triton']" in lines
