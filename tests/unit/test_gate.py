"""The gate's judge, in-process: green when everything matches; changed ids, extra skips, missing runs
and a wrong tree named. The frozen gate as a user meets it is in tests/e2e/test_gate.py."""

from __future__ import annotations

from pathlib import Path

from flaloop.task.gate import judge
from flaloop.task.pytest_run import PytestRun


def _run(**kw) -> PytestRun:
    base = {"exit_code": 0, "selected": ["a", "b"], "outcomes": {"a": "passed", "b": "passed"}, "passed": 2,
            "package_file": "/repo/pkg/__init__.py"}
    return PytestRun(**{**base, **kw})


def test_judge_green_when_everything_matches():
    assert judge(_run(), {"selected": ["a", "b"], "skipped": 0}, "pkg", Path("/repo")) == []


def test_judge_flags_changed_ids_extra_skips_missing_runs_and_wrong_tree():
    base = {"selected": ["a", "b"], "skipped": 0}
    assert {f.kind for f in judge(_run(selected=["a", "c"], outcomes={"a": "passed", "c": "passed"}), base,
                                  "pkg", Path("/repo"))} == {"ids-changed"}
    assert {f.kind for f in judge(_run(passed=1, skipped=1, outcomes={"a": "passed", "b": "skipped"}), base,
                                  "pkg", Path("/repo"))} == {"more-skips"}
    assert "not-run" in {f.kind for f in judge(_run(passed=1, outcomes={"a": "passed"}), base, "pkg",
                                               Path("/repo"))}
    assert {f.kind for f in judge(_run(package_file="/site-packages/pkg/__init__.py"), base, "pkg",
                                  Path("/repo"))} == {"wrong-tree"}
    empty = judge(_run(exit_code=5, selected=[], outcomes={}, passed=0), {"selected": [], "skipped": 0}, "pkg",
                  Path("/repo"))
    assert {"no-test-ran", "pytest-exit"} <= {f.kind for f in empty}
