"""Which backend served each side's calls (issue 24): the toy op dispatched through a backend
registry shaped like FLA's `fla.ops.backends` (per operation a registry, backends tried in order
with a verifier, the op's own code when none takes the call, `_logged` keys of what served).

A candidate whose edit makes the verifier decline runs the op's own code instead: the results
agree, so only the backend census sees it (`backend-differs`, blocking). The same switch asked for
with `--cand-env` is expected and named. An honest edit passes with both sides on one backend."""

from __future__ import annotations

import json

import pytest
from support.cli import flaloop
from support.repos import commit_all, edit, fresh_copy, make_dispatched_repo

OP = "toy_attn"
QUICK = ["--device", "cpu", "--modes", "fwd", "--min-pairs", "4", "--max-pairs", "6", "--rounds", "1",
         "--cell-seconds", "20", "--unseen-shapes", "0", "--json"]


@pytest.fixture(scope="module")
def dispatched(tmp_path_factory):
    repo = make_dispatched_repo(tmp_path_factory.mktemp("backends") / "toy", "q.shape[-1] <= 64")
    r = flaloop(repo, "init", OP, "--shapes", "B2_T64_H2_D16", "--modes", "fwd")
    assert r.code == 0, r.stderr
    return repo


def bench(repo, *extra):
    r = flaloop(repo, "bench", OP, *QUICK, *extra)
    return r, (json.loads(r.stdout) if r.stdout.strip() else {})


def backend_findings(rec: dict) -> list[dict]:
    return [f for c in rec.get("cells") or [] for f in c.get("findings") or [] if f["rule"] == "backend-differs"]


def test_an_edit_that_makes_the_verifier_decline_is_blocked_naming_both_backends(dispatched, tmp_path):
    repo = fresh_copy(dispatched, tmp_path / "toy")
    edit(repo / "toyop" / "ops" / "toy" / "blocked.py", "return q.shape[-1] <= 64", "return q.shape[-1] < 16")
    r, rec = bench(repo)
    assert r.code == 1, r.stderr[-2000:]
    (cell,) = rec["cells"]
    assert cell["verdict"] == "BLOCKED" and "backend-differs" in cell["reason"]
    (f,) = backend_findings(rec)
    assert f["blocking"] and "toy.toy_attn: base blocked, candidate (its own code)" in f["message"]
    base, cand = cell["setup"]["base"]["backends"], cell["setup"]["cand"]["backends"]
    assert base["toy"] == {"registered": {"blocked": "TOY_BLOCKED"}, "served": ["toy_attn -> blocked"], "rejected": []}
    assert cand["toy"]["served"] == [] and cand["toy"]["rejected"] == ["toy_attn -> blocked"]


def test_the_same_switch_asked_for_with_cand_env_is_expected_and_named(dispatched, tmp_path):
    repo = fresh_copy(dispatched, tmp_path / "toy")
    r, rec = bench(repo, "--base", "HEAD", "--cand-env", "TOY_BLOCKED=0")
    assert r.code == 0, r.stderr[-2000:]
    (f,) = backend_findings(rec)
    assert not f["blocking"] and "expected: --cand-env TOY_BLOCKED" in f["message"]
    assert rec["cells"][0]["verdict"] != "BLOCKED"


def test_an_honest_edit_stays_on_the_base_backend_and_passes(dispatched, tmp_path):
    repo = fresh_copy(dispatched, tmp_path / "toy")
    edit(repo / "toyop" / "ops" / "toy" / "blocked.py", "s.tril()", "torch.tril(s)")
    r, rec = bench(repo)
    assert r.code == 0, r.stderr[-2000:]
    assert backend_findings(rec) == []
    cell = rec["cells"][0]
    assert cell["setup"]["cand"]["backends"] == cell["setup"]["base"]["backends"]


def test_a_refusal_after_a_backend_declined_the_call_names_the_backend(tmp_path):
    """FLA's simple GLA refuses its gated backward on Hopper "... or install tilelang" where tilelang
    is installed and its verifier declined the call (fp32 state): the REFUSED cell says which backend
    had declined, and the record keeps the base's snapshot."""
    repo = make_dispatched_repo(tmp_path / "toy", "q.shape[-1] <= 8")  # the cells' D16 is declined
    edit(repo / "toyop" / "ops" / "toy" / "fast.py", "    scale = q.shape[-1] ** -0.5 if scale is None else scale\n",
         "    if q.shape[-1] > 8:\n        raise RuntimeError('wrong above 8 here: install the blocked backend')\n"
         "    scale = q.shape[-1] ** -0.5 if scale is None else scale\n")
    commit_all(repo)
    assert flaloop(repo, "init", OP, "--shapes", "B2_T64_H2_D16", "--modes", "fwd").code == 0
    r, rec = bench(repo, "--aa")
    (cell,) = rec["cells"]
    assert cell["verdict"] == "REFUSED", r.stderr[-2000:]
    assert "install the blocked backend" in cell["reason"]
    assert "(the target's backends had declined: toy.toy_attn -> blocked)" in cell["reason"]
    assert cell["setup"]["base_backends"]["toy"]["rejected"] == ["toy_attn -> blocked"]
