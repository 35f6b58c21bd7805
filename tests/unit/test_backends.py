"""Which backend served each side's calls (issue 24), in-process: the findings name the variables
that switch the backends involved. The toy op through a backend registry is in tests/e2e/test_backends.py."""

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
