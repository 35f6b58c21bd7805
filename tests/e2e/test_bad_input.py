"""Bad input everywhere a user controls it: one clear message naming what is wrong and what to do,
a documented exit code, and never a traceback (only with --debug).

Each case corrupts one input of a prepared toy repo and runs the first command that reads it.
docs/RELIABILITY.md lists every case with its message and exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import flaloop
from support.repos import git, make_toy_repo

# the unseen-shapes check is off here (it has its own tests, tests/e2e/test_unseen.py): the suite's time
QUICK = ["--device", "cpu", "--min-pairs", "4", "--max-pairs", "6", "--cell-seconds", "20", "--modes", "fwd",
         "--rounds", "1", "--unseen-shapes", "0"]


def refused(r, code: int, *fragments: str) -> None:
    """Exit `code`, every fragment in stderr, and no traceback."""
    assert r.code == code, f"exit {r.code}, wanted {code}:\n{r.stderr[-3000:]}"
    for f in fragments:
        assert f in r.stderr, f"{f!r} not in stderr:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]


def contract_path(repo: Path, op: str = "toy_attn") -> Path:
    return repo / "profile" / f"{op}-opt" / "contract.json"


# -- contract.json --------------------------------------------------------------------------------

def _set(key, value):
    def change(c: dict):
        c[key] = value
        return c
    return change


def _drop(key):
    def change(c: dict):
        del c[key]
        return c
    return change


def _frozen_without_sha(c: dict):
    del c["frozen"][0]["sha256"]
    return c


CONTRACT_CASES = {
    "truncated": (lambda text: text[: len(text) // 2], "is damaged (not readable JSON"),
    "empty": (lambda text: "", "is damaged (not readable JSON"),
    "a list": (lambda text: "[1, 2]", "expected a JSON object, found list"),
    "frozen not a list": (_set("frozen", "all"), "frozen must be a list, not str"),
    "speedup a string": (_set("target_speedup", "fast"), "target_speedup must be a number, not str"),
    "missing base_commit": (_drop("base_commit"), "it lacks base_commit"),
    "unknown schema": (_set("schema", 99), "has contract schema 99; this flaloop"),
    "frozen entry without sha": (_frozen_without_sha, "frozen[0] (tests/conftest.py) has no sha256"),
    "unknown mode": (_set("modes", ["fwd", "bwd_only"]), "modes: 'bwd_only' not among fwd, fwdbwd"),
    "short base sha": (_set("base_commit", "abc123"), "base_commit 'abc123' is not a full commit sha"),
    "base commit not in the repo": (_set("base_commit", "f" * 40), "is not in this clone"),
    "another op's contract": (_set("op", "toy_log"), "is the contract of 'toy_log', not 'toy_attn'"),
}


@pytest.mark.parametrize("case", list(CONTRACT_CASES))
def test_a_damaged_contract_is_named_with_a_way_out(toy, case):
    change, message = CONTRACT_CASES[case]
    path = contract_path(toy)
    text = path.read_text()
    path.write_text(change(text) if case in ("truncated", "empty", "a list") else json.dumps(change(json.loads(text))))
    r = flaloop(toy, "gate", "toy_attn", "--json")
    refused(r, 2, "profile/toy_attn-opt/contract.json", message)
    assert r.json["ok"] is False and r.json["exit_code"] == 2 and r.json["hint"]
    if case not in ("unknown schema", "base commit not in the repo"):
        assert "flaloop init toy_attn --force" in r.stderr


def test_a_contract_naming_an_unknown_shape(toy):
    path = contract_path(toy)
    path.write_text(json.dumps({**json.loads(path.read_text()), "shapes": ["B9_T9_H9_D9"]}))
    refused(flaloop(toy, "bench", "toy_attn", *QUICK), 2, "unknown shape(s) B9_T9_H9_D9", "known: B2_T64_H2_D16")


def test_fewer_pairs_than_a_verdict_needs_are_refused_before_anything_runs(toy):
    """A cell needs 6 kept pairs for a verdict: a cap below that could only ever fail every cell."""
    for a, b in (("2", "4"), ("6", "4")):
        refused(flaloop(toy, "bench", "toy_attn", "--device", "cpu", "--min-pairs", a, "--max-pairs", b), 2,
                f"--min-pairs {a} / --max-pairs {b}: need 2 <= min-pairs <= max-pairs, and max-pairs >= 6")


# -- the registry and the op ----------------------------------------------------------------------

REGISTRY = Path("benchmarks/ops/registry.py")


def test_a_registry_with_a_syntax_error(toy):
    (toy / REGISTRY).write_text((toy / REGISTRY).read_text() + "\ndef broken(:\n    pass\n")
    refused(flaloop(toy, "list"), 2, f"could not import the registry {REGISTRY}", "SyntaxError", "registry.py")


def test_the_registry_answer_is_reused_until_a_file_it_loaded_changes(toy, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    reg, pkg = toy / REGISTRY, toy / "toyop/__init__.py"
    reg.write_text(reg.read_text().replace("import torch\n", "import torch\n\nimport toyop  # noqa: F401\n", 1))
    assert flaloop(toy, "list", "--json", env=env).code == 0
    [kept] = (tmp_path / "cache" / "flaloop" / "registry").glob("*.json")
    doc = json.loads(kept.read_text())
    [entry] = doc["entries"]
    assert {"benchmarks/ops/registry.py", "toyop/__init__.py"} <= set(entry["answer"]["files"])
    # a planted answer shows that the next command reads the cache instead of the registry
    for op in entry["answer"]["ops"]:
        op["name"] = op["name"].replace("toy_attn", "toy_cached")
    kept.write_text(json.dumps(doc))
    assert "toy_cached" in flaloop(toy, "list", "--json", env=env).stdout
    # the answer holds no path: the same files elsewhere (a clone, a copy, a worktree) reuse it
    elsewhere = shutil.copytree(toy, tmp_path / "elsewhere" / "toy", symlinks=True)
    assert "toy_cached" in flaloop(elsewhere, "list", "--json", env=env).stdout
    # a module the registry imported changes: read again; changed back: the kept answer again
    pkg.write_text("# an edit\n")
    fresh = flaloop(toy, "list", "--json", env=env).stdout
    assert "toy_attn" in fresh and "toy_cached" not in fresh
    assert len(json.loads(kept.read_text())["entries"]) == 2
    pkg.write_text("")
    assert "toy_cached" in flaloop(toy, "list", "--json", env=env).stdout
    reg.write_text(reg.read_text() + "\n# an edit\n")
    fresh = flaloop(toy, "list", "--json", env=env).stdout
    assert "toy_attn" in fresh and "toy_cached" not in fresh
    # a registry outside the tree, named in flaloop.toml, is read as well
    outside = tmp_path / "outside" / "registry.py"
    outside.parent.mkdir()
    outside.write_text(reg.read_text())
    (toy / "flaloop.toml").write_text(f"[target]\nregistry = {str(outside)!r}\n")
    assert "toy_attn" in flaloop(toy, "list", "--json", env=env).stdout
    outside.write_text(outside.read_text() + "\nraise RuntimeError('needs a GPU')\n")
    refused(flaloop(toy, "list", env=env), 2, f"could not import the registry {outside}", "RuntimeError: needs a GPU")


def test_a_registry_that_raises_on_import_names_the_line(toy):
    (toy / REGISTRY).write_text((toy / REGISTRY).read_text() + "\nraise RuntimeError('needs a GPU')\n")
    refused(flaloop(toy, "list"), 2, "RuntimeError: needs a GPU", f"(at {REGISTRY}:")


def test_a_shape_entry_missing_a_dimension_fails_its_cell_by_name(toy):
    reg = toy / REGISTRY
    reg.write_text(reg.read_text().replace("'B2_T64_H2_D16': {'B': 2, 'T': 64, 'H': 2, 'D': 16}",
                                           "'B2_T64_H2_D16': {'B': 2, 'T': 64}"))
    git(toy, "commit", "-qam", "registry: a shape without H and D")  # the base reads it too
    r = flaloop(toy, "bench", "toy_attn", *QUICK, "--base", "HEAD")
    refused(r, 3)
    assert "B2_T64_H2_D16" in r.stdout and "FAILED" in r.stdout and "shape lacks 'H'" in r.stdout


def test_an_op_whose_import_raises(toy):
    init = toy / "toyop/ops/toy/__init__.py"
    init.write_text("raise ImportError('toyop needs libfoo')\n" + init.read_text())
    refused(flaloop(toy, "init", "toy_attn", "--force"), 2, "could not import toyop.ops.toy.toy_attn",
            "ImportError: toyop needs libfoo", "(at toyop/ops/toy/__init__.py:1)")
    refused(flaloop(toy, "bench", "toy_attn", *QUICK), 3, "the cand worker could not import toy_attn",
            "toyop needs libfoo", "(at toyop/ops/toy/__init__.py:1)", "--debug")
    r = flaloop(toy, "--debug", "bench", "toy_attn", *QUICK)
    assert r.code == 3 and "Traceback" in r.stderr and "raise ImportError('toyop needs libfoo')" in r.stderr


# -- flaloop.toml ---------------------------------------------------------------------------------

TOML_CASES = {
    "not TOML": ("[ops.x\nimport_path = 'a'\n", "flaloop.toml is not valid TOML"),
    "import_path a number": ("[ops.x]\nimport_path = 5\n", "[ops.x] import_path must be a str, not int (5)"),
    "ops not tables": ('ops = "toy"\n', "ops must be tables [ops.NAME], not str"),
    "strip_env a string": ('[gate]\nstrip_env = "FOO"\n', "[gate] strip_env must be a list, not str"),
    "op without import_path": ('[ops.x]\nfunc_name = "x"\n', "[ops.x] has no import_path"),
    "registry a number": ("[target]\nregistry = 5\n", "[target] registry must be a str, not int"),
    "import_path not a module": ('[ops.x]\nimport_path = "toy ops/x.py"\n', "is not a dotted module name"),
}


@pytest.mark.parametrize("case", list(TOML_CASES))
def test_a_bad_flaloop_toml_is_named(toy, case):
    text, message = TOML_CASES[case]
    (toy / "flaloop.toml").write_text(text)
    r = flaloop(toy, "list", "--json")
    refused(r, 2, message)
    assert r.json["hint"]


# -- git ------------------------------------------------------------------------------------------

def test_not_a_git_repository(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    refused(flaloop(plain, "gate", "toy_attn"), 2, "is not inside a git repository", "git init")


def test_an_unknown_base_ref(toy):
    refused(flaloop(toy, "bench", "toy_attn", "--base", "no-such-branch", *QUICK), 2,
            "unknown base ref 'no-such-branch'", "git branch -a")


def test_a_detached_head_benches_as_usual(toy):
    git(toy, "checkout", "-q", "--detach")
    r = flaloop(toy, "bench", "toy_attn", "--json", *QUICK, "--aa")
    assert r.code == 0, r.stderr[-2000:]
    assert r.json["candidate"]["head"] == git(toy, "rev-parse", "HEAD").strip()


def test_a_shallow_clone_without_the_base_commit(tmp_path):
    full = make_toy_repo(tmp_path / "full")
    (full / "README").write_text("second commit\n")
    git(full, "add", "README")
    git(full, "commit", "-qm", "second")
    r = flaloop(full, "init", "toy_attn", "--base", "HEAD~1")
    assert r.code == 0, r.stderr
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{full}", str(shallow)], check=True)
    refused(flaloop(shallow, "init", "toy_attn", "--base", "HEAD~1"), 2, "unknown base ref 'HEAD~1'",
            "shallow clone", "git fetch --unshallow")
    shutil.copytree(full / "profile", shallow / "profile")  # the contract travels, its base does not
    refused(flaloop(shallow, "gate", "toy_attn"), 2, "the base commit of profile/toy_attn-opt/contract.json",
            "is not in this clone", "git fetch --unshallow")


# -- paths and storage ----------------------------------------------------------------------------

def test_paths_with_spaces_and_non_ascii_letters(tmp_path):
    repo = make_toy_repo(tmp_path / "my repö with spaces" / "töy")
    assert flaloop(repo, "init", "toy_attn", "--shapes", "B2_T64_H2_D16").code == 0
    r = flaloop(repo, "gate", "toy_attn", "--json")
    assert r.code == 0 and r.json["green"] is True, r.stderr[-2000:]
    r = flaloop(repo, "bench", "toy_attn", "--json", *QUICK)
    # what blocked or failed, when it did (exit 1 once under a full suite's load, with only the
    # progress lines to read)
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    said = {"guard": (doc.get("guard") or {}).get("findings"), "errors": doc.get("errors"),
            "cells": [(c.get("verdict"), c.get("status"), c.get("reason"), c.get("findings"))
                      for c in doc.get("cells", [])]}
    assert r.code == 0, f"{said}\n{r.stderr[-2000:]}"
    assert Path(r.json["path"]).is_file() and "my repö with spaces" in r.json["path"]


def _read_only(path: Path):
    """Make `path` (and everything below) unwritable even for root; returns the undo, or skips."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
        return lambda: subprocess.run(["chmod", "-R", "u+w", str(path)], check=False)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "-R", "+i", str(path)],
                                                        capture_output=True).returncode != 0:
        pytest.skip("running as root on a file system without chattr +i: cannot make a directory read-only")
    return lambda: subprocess.run(["chattr", "-R", "-i", str(path)], check=False)


def test_a_read_only_workspace(toy):
    ws = toy / "profile" / "toy_attn-opt"
    undo = _read_only(ws)
    try:
        refused(flaloop(toy, "gate", "toy_attn"), 2, "cannot write", "profile/toy_attn-opt",
                "writable")
        refused(flaloop(toy, "bench", "toy_attn", *QUICK), 2, "cannot write", "profile/toy_attn-opt")
    finally:
        undo()


def test_a_full_disk_keeps_the_old_contract_and_reports_the_lost_run_record(toy):
    path = contract_path(toy)
    before = path.read_bytes()
    r = flaloop(toy, "init", "toy_attn", "--force", "--target", "2x", env={"FLALOOP_TEST_ENOSPC": "contract.json"})
    refused(r, 2, "cannot write", "contract.json: No space left on device", "free some disk space")
    assert path.read_bytes() == before  # the old contract, whole
    assert not list(path.parent.glob(".contract.json.*"))  # and no half-written temp file
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # atomic writes keep ordinary permissions
    r = flaloop(toy, "bench", "toy_attn", "--json", *QUICK, env={"FLALOOP_TEST_ENOSPC": "record.json"})
    refused(r, 2, "record.json: No space left on device")
    assert r.json["exit_code"] == 2
    runs = list((toy / "profile/toy_attn-opt/runs").iterdir())
    assert len(runs) == 1 and not list(runs[0].glob("*record.json*"))


# -- flaloop's own bugs ---------------------------------------------------------------------------

BOOM = """import sys
from flaloop.task import contract
def boom(*a, **k):
    raise ZeroDivisionError("planted bug")
contract.Contract.load = boom
from flaloop.cli import main
sys.argv = ["flaloop", *sys.argv[1:]]
main()
"""


def test_an_unexpected_exception_is_exit_4_and_a_traceback_only_with_debug(toy):
    def run(*args):
        return subprocess.run([sys.executable, "-c", BOOM, *args], cwd=toy, capture_output=True, text=True)

    r = run("gate", "toy_attn", "--json")
    assert r.returncode == 4 and "Traceback" not in r.stderr
    assert "internal error: ZeroDivisionError: planted bug (rerun with --debug" in r.stderr
    assert json.loads(r.stdout)["exit_code"] == 4
    r = run("--debug", "gate", "toy_attn")
    assert r.returncode == 4 and "Traceback" in r.stderr and "planted bug" in r.stderr

