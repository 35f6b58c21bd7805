"""The frozen gate, as a user meets it: each planted violation turns it red, the untouched
example stays green. Real git, real pytest subprocesses, real Triton (interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

from support.cli import flaloop
from support.repos import OP, commit_all, edit, make_toy_repo

TEST = Path("tests/ops/test_linear_attn.py")
CHUNK = Path("minifla/ops/linear_attn/chunk.py")
NAIVE = Path("minifla/ops/linear_attn/naive.py")
REF = Path("minifla/ops/linear_attn/fused_recurrent.py")
CONFTEST = Path("tests/conftest.py")
# the pure-torch toy op (tests/support/toy/), for the rules that are not about minifla or Triton: its
# two tests take milliseconds where minifla's interpret Triton kernels for seconds, at every gate
TOY_FAST = Path("toyop/ops/toy/fast.py")
TOY_ENTRY = "def toy_attn(q, k, v, scale=None, cu_seqlens=None):\n"


def gate(repo: Path, *args: str, env: dict | None = None, op: str = OP):
    r = flaloop(repo, "gate", op, "--json", *args, env=env)
    return r, json.loads(r.stdout)


def plant_in_entry(repo: Path, import_line: str, code: str) -> None:
    """Put `code` at the top of chunk_linear_attn's body (after its docstring)."""
    edit(repo / CHUNK, "import torch\n", f"import torch\n{import_line}\n")
    text = (repo / CHUNK).read_text()
    i = text.index("def chunk_linear_attn(")
    body = text.index(":\n", text.index(")", i)) + 2
    if text[body:].lstrip().startswith('"""'):
        body = text.index('"""', text.index('"""', body) + 3) + 4
    (repo / CHUNK).write_text(f"{text[:body]}    {code}\n{text[body:]}")


def kinds(doc: dict) -> set[str]:
    return {f["kind"] for f in doc["findings"]}


def test_untouched_example_is_green(repo):
    r, doc = gate(repo)
    assert r.code == 0, r.stderr
    assert doc["green"] and not doc["findings"]
    counts = doc["counts"]
    assert counts["failed"] == 0 and counts["passed"] > 0 and counts["ran"] == counts["selected"]
    assert doc["signal_only"] is False
    assert doc["baseline"]["kind"] == "collect" and doc["baseline"]["cached"] is True
    last = json.loads((repo / "profile" / f"{OP}-opt" / "gate" / "last.json").read_text())
    assert last["green"] and last["tree"]["dirty"] is False


def test_loosened_tolerance_in_test_file_is_red_and_shows_the_diff(repo):
    edit(repo / TEST, "torch.float32: 0.005,", "torch.float32: 0.5,")
    r, doc = gate(repo)
    assert r.code == 1
    assert kinds(doc) == {"frozen-changed"}
    finding = doc["findings"][0]
    assert str(TEST) in finding["message"]
    assert "+    torch.float32: 0.5," in finding["detail"] and "-    torch.float32: 0.005," in finding["detail"]


def test_added_skip_marker_is_red(repo):
    edit(repo / TEST, "def test_chunk(", "@pytest.mark.skip(reason='flaky')\ndef test_chunk(")
    r, doc = gate(repo)
    assert r.code == 1 and "frozen-changed" in kinds(doc)


def test_dropped_parametrized_case_is_red(repo):
    edit(repo / TEST, "            (2, 100, 2, 16, 16, 0.1, True, torch.float32),\n", "")
    r, doc = gate(repo)
    assert r.code == 1 and "frozen-changed" in kinds(doc)


def test_edited_naive_reference_is_red(repo):
    (repo / NAIVE).write_text((repo / NAIVE).read_text() + "\n# harmless looking edit\n")
    r, doc = gate(repo)
    assert r.code == 1
    assert [f["message"] for f in doc["findings"] if str(NAIVE) in f["message"]]


def test_edited_conftest_is_red(repo):
    edit(repo / CONFTEST, "import pytest", "import pytest  # poisoning off?")
    r, doc = gate(repo)
    assert r.code == 1 and any(str(CONFTEST) in f["message"] for f in doc["findings"])


def test_edited_reference_kernel_is_red(repo):
    (repo / REF).write_text((repo / REF).read_text() + "\n")
    r, doc = gate(repo)
    assert r.code == 1 and any(str(REF) in f["message"] for f in doc["findings"])


def test_kernel_leaving_output_unwritten_is_caught_by_poisoning(repo):
    # The checkout lives under pytest's tmp_path (".../test_kernel_leaving.../"): a path that
    # blinds FLA-style poisoning unless the gate runs the tree from a neutral path.
    assert "test_" in str(repo)
    edit(repo / CHUNK, "mask=m_t[:, None] & m_v[None, :])", "mask=m_t[:, None] & m_v[None, :] & (i_t < NT - 1))")
    r, doc = gate(repo)
    assert r.code == 1
    assert kinds(doc) == {"pytest-exit"}
    assert doc["counts"]["failed"] > 0
    assert "NaN" in doc["findings"][0]["detail"]


def test_fla_ci_env_in_callers_environment_is_removed(repo):
    # With FLA_CI_ENV=1, assert_close only warns: a wrong kernel would pass. The gate strips it.
    edit(repo / CHUNK, "b_o = b_o * scale", "b_o = b_o * scale * 1.05")
    r, doc = gate(repo, env={"FLA_CI_ENV": "1", "SKIP_TEST_CHUNK_VARLEN": "1"})
    assert r.code == 1
    assert set(doc["stripped_env"]) == {"FLA_CI_ENV", "SKIP_TEST_CHUNK_VARLEN"}
    assert "removed FLA_CI_ENV=1" in r.stderr
    assert doc["counts"]["failed"] > 0


def test_fla_ci_env_set_from_inside_the_package_is_red(toy):
    init = toy / "toyop" / "__init__.py"
    init.write_text("import os\nos.environ['FLA_CI_ENV'] = '1'\n" + init.read_text())
    r, doc = gate(toy, op="toy_attn")
    assert r.code == 1 and "weakening-env" in kinds(doc)


def test_kernel_that_skips_cases_is_red(toy):
    # The op calls pytest.skip for awkward shapes: the test file is untouched, skips grow.
    edit(toy / TOY_FAST, TOY_ENTRY,
         TOY_ENTRY + "    import pytest\n    if q.shape[1] > 16:\n        pytest.skip('long T')\n")
    r, doc = gate(toy, op="toy_attn")
    assert r.code == 1 and "more-skips" in kinds(doc), doc["findings"]
    assert doc["baseline"]["kind"] == "full"  # confirmed against a full run at the base


def test_kernel_that_kills_pytest_midway_is_red(repo):
    plant_in_entry(repo, "import os", "if q.shape[1] % 32:\n        os._exit(0)")
    r, doc = gate(repo)
    assert r.code == 1
    assert {"not-run"} <= kinds(doc), doc["findings"]


def test_k_subset_is_signal_only(repo):
    r, doc = gate(repo, "-k", "fused_recurrent")
    assert r.code == 0, r.stdout
    assert doc["signal_only"] is True and doc["k_expr"] == "fused_recurrent"
    assert "SIGNAL ONLY" in r.stderr
    assert doc["counts"]["selected"] < 10


# -- judge() on its own: the rules that need no planted repo ----------------------------------


def test_skips_decided_in_the_test_body_at_the_base_are_not_held_against_the_candidate(toy):
    # The base's own test calls pytest.skip at run time: the collect-only baseline cannot see
    # it, so the gate runs the whole file at the base before judging, and stays green.
    from support.repos import git

    test = toy / "tests/ops/test_toy.py"
    test.write_text(test.read_text() + "\n\ndef test_runtime_skip():\n    pytest.skip('not on this machine')\n")
    git(toy, "commit", "-qam", "a test that skips itself")
    assert flaloop(toy, "init", "toy_attn", "--force").code == 0
    r, doc = gate(toy, op="toy_attn")
    assert r.code == 0, doc["findings"]
    assert doc["baseline"]["kind"] == "full" and doc["baseline"]["skipped"] == 1
    assert doc["counts"]["skipped"] == 1


def test_gate_over_xdist_workers_pins_each_worker_to_a_gpu(toy):
    r, doc = gate(toy, "--workers", "2", "--gpus", "5,7", op="toy_attn")
    assert r.code == 0, doc.get("findings")
    assert doc["counts"]["ran"] == doc["counts"]["selected"] == doc["baseline"]["selected"].__len__()
    assert doc["run"]["workers"] == {"gw0": "5", "gw1": "7"}
    bad = flaloop(toy, "gate", "toy_attn", "--workers", "2", "--gpus", "0,x")
    assert bad.code == 2 and "not a GPU index" in bad.stderr


def test_the_base_is_collected_beside_the_first_run_and_trims_the_workers_after(toy):
    r, doc = gate(toy, "--workers", "3", op="toy_attn")
    assert r.code == 0, doc.get("findings")
    assert doc["baseline"]["cached"] is False and len(doc["run"]["workers"]) == 3  # not known yet
    r, doc = gate(toy, "--workers", "3", "--regate", op="toy_attn")
    assert r.code == 0 and doc["baseline"]["cached"] is True
    assert len(doc["run"]["workers"]) == 2 == doc["counts"]["ran"]  # the file has two tests


def test_a_base_that_cannot_collect_stops_the_candidates_run(toy):
    import time

    from support.repos import git

    init = toy / "toyop/ops/toy/__init__.py"
    good = init.read_text()
    init.write_text("raise ImportError('broken at the base')\n")
    git(toy, "commit", "-qam", "a base whose package cannot be imported")
    init.write_text(good)  # fixed in the working tree only
    assert flaloop(toy, "init", "toy_attn", "--force").code == 0
    edit(toy / TOY_FAST, TOY_ENTRY, TOY_ENTRY + "    import time; time.sleep(120)\n")
    t0 = time.monotonic()
    r = flaloop(toy, "gate", "toy_attn")
    assert r.code == 2 and "could not collect" in r.stderr and "broken at the base" in r.stderr
    assert time.monotonic() - t0 < 60  # the candidate's two-minute test was stopped


# -- tests that ran out of GPU memory beside the other workers ------------------------------------

# As a test that needs most of a GPU's memory: enough for one such test at a time, so it runs out
# whenever other xdist workers share the device (FLA's test_attnres on one H200 beside 15 other
# workers); `always` runs out even alone.
MEMORY_HUNGRY = '''

import os


@pytest.mark.parametrize('n', [0, 1, 'always'])
def test_big(n):
    if n == 'always' or int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')) > 1:
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (as a test beside others)')
'''


def test_tests_out_of_gpu_memory_beside_other_workers_run_again_alone_and_count_by_that(tmp_path):
    repo = make_toy_repo(tmp_path / "toy")
    (repo / "tests" / "ops" / "test_toy.py").write_text((repo / "tests" / "ops" / "test_toy.py").read_text()
                                                       + MEMORY_HUNGRY)
    commit_all(repo)
    assert flaloop(repo, "init", "toy_attn", "--shapes", "B2_T64_H2_D16", "--modes", "fwd").code == 0
    human = flaloop(repo, "gate", "toy_attn", "--workers", "3")
    assert human.code == 1, human.stderr[-2000:]  # `always` fails alone too: red, in its own words
    assert "3 test(s) ran out of GPU memory beside 2 other workers; run again alone, one at a time: 2 passed, " \
           "1 still failing" in human.stdout
    # the same run's result as the gate recorded it: what `--json` prints, less its "ok"
    doc = json.loads((repo / "profile" / "toy_attn-opt" / "gate" / "last.json").read_text())
    retry = doc["oom_retry"]
    big = "tests/ops/test_toy.py::test_big"
    assert retry["ids"] == [f"{big}[0]", f"{big}[1]", f"{big}[always]"] and retry["workers"] == 3
    assert retry["passed_alone"] == [f"{big}[0]", f"{big}[1]"]
    assert list(retry["still_failing"]) == [f"{big}[always]"]
    assert "CUDA out of memory" in retry["still_failing"][f"{big}[always]"]
    assert (doc["counts"]["passed"], doc["counts"]["failed"]) == (4, 1)
    assert [f["kind"] for f in doc["findings"]] == ["pytest-exit"]
    assert "test_big[always]" in doc["findings"][0]["detail"] and "test_big[0]" not in doc["findings"][0]["detail"]
    # nothing was changed: the base itself is red here, and the gate says so
    assert "at the base commit itself, unchanged: the op's own tests fail in this environment" in \
        doc["findings"][0]["message"]
    # without `always`, the gate is green: what ran out beside others passed with the GPU to itself
    edit(repo / "tests" / "ops" / "test_toy.py", "[0, 1, 'always']", "[0, 1]")
    commit_all(repo)
    assert flaloop(repo, "init", "toy_attn", "--force", "--shapes", "B2_T64_H2_D16", "--modes", "fwd").code == 0
    r, doc = gate(repo, "--workers", "3", op="toy_attn")
    assert r.code == 0 and doc["green"], doc["findings"]
    assert doc["oom_retry"]["passed_alone"] == [f"{big}[0]", f"{big}[1]"] and doc["counts"]["failed"] == 0
    # a change that fails the tests is the change's, not the base's
    edit(repo / TOY_FAST, TOY_ENTRY, TOY_ENTRY + "    q = q * 1.5\n")
    r, doc = gate(repo, "--workers", "1", op="toy_attn")
    assert r.code == 1 and "pytest-exit" in kinds(doc) and "at the base commit" not in doc["findings"][0]["message"]
    # one worker: nothing beside it to blame, so nothing is run again; test_big passes there, and
    # only the change's failures (test_toy's two cases) count
    assert len(doc["run"]["workers"]) == 1 and doc["oom_retry"] is None
    assert (doc["counts"]["passed"], doc["counts"]["failed"]) == (2, 2)
    assert "test_big" not in doc["findings"][0]["detail"]
