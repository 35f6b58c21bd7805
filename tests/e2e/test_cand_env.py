"""`--cand-env`: the same code on both sides, the candidate's workers with a variable set (FLA's
FLA_TILELANG=1 switches a backend). Planted on minifla: the op reads FLA_MINIFLA_PATH (a name in
the numeric-settings probe's watched prefixes) and takes a slower path when it says "slow". The
difference is measured, named in the record and the table, and not a numeric-settings finding."""

from __future__ import annotations

from support.cli import flaloop
from support.repos import OP, commit_all, make_repo

SHAPE = "B1_T64_H2_D32"
CHUNK = "minifla/ops/linear_attn/chunk.py"
CALL = "    N, scale, max_len = check_inputs(q, k, v, scale, initial_state, cu_seqlens)\n"
SWITCH = CALL + ("    import os as _os\n"
                 "    if _os.environ.get('FLA_MINIFLA_PATH') == 'slow':\n"
                 "        import time as _t\n"
                 "        _t.sleep(0.02)\n")
BENCH = ["--device", "cpu", "--modes", "fwd", "--min-pairs", "6", "--max-pairs", "8", "--cell-seconds", "30",
         "--rounds", "1", "--json"]


def test_one_side_with_a_backend_switched_is_measured_and_named(tmp_path):
    repo = make_repo(tmp_path / "minifla")
    p = repo / CHUNK
    p.write_text(p.read_text().replace(CALL, SWITCH))
    commit_all(repo)  # the base has the switch too: both sides run the same code
    assert flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd").code == 0
    r = flaloop(repo, "bench", OP, *BENCH, "--cand-env", "FLA_MINIFLA_PATH=slow")
    assert r.code == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = r.json
    assert doc["config"]["cand_env"] == {"FLA_MINIFLA_PATH": "slow"}
    [cell] = doc["cells"]
    assert cell["verdict"] == "SLOWER", cell["verdict"]
    assert not [f for f in doc["guard"]["findings"] if f["rule"] == "numeric-settings"]
    assert doc["env"]["forkserver"]["used"] is False and "--cand-env" in doc["env"]["forkserver"]["why"]
    human = flaloop(repo, "bench", OP, *BENCH[:-1], "--cand-env", "FLA_MINIFLA_PATH=slow")
    assert "candidate's environment FLA_MINIFLA_PATH=slow" in human.stdout


def test_a_variable_set_without_cand_env_is_still_a_numeric_settings_finding(tmp_path):
    repo = make_repo(tmp_path / "minifla")
    assert flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd").code == 0
    init = repo / "minifla" / "__init__.py"
    init.write_text(init.read_text() + "\nimport os as _os\n_os.environ['FLA_MINIFLA_PATH'] = 'slow'\n")
    r = flaloop(repo, "bench", OP, *BENCH, "--cand-env", "FLA_OTHER=1")
    assert r.code == 1, r.stderr[-2000:]
    msgs = [f["message"] for f in r.json["guard"]["findings"] if f["rule"] == "numeric-settings"]
    assert msgs and "FLA_MINIFLA_PATH" in msgs[0] and "FLA_OTHER" not in msgs[0]


def test_a_bad_cand_env_is_named_before_any_worker(tmp_path):
    repo = make_repo(tmp_path / "minifla")
    assert flaloop(repo, "init", OP, "--shapes", SHAPE, "--modes", "fwd").code == 0
    for arg, said in (("FLA_TILELANG", "--cand-env 'FLA_TILELANG' is not NAME=VALUE"),
                      ("1BAD=x", "--cand-env 1BAD: not an environment variable's name"),
                      ("CUDA_VISIBLE_DEVICES=1", "--cand-env CUDA_VISIBLE_DEVICES: flaloop sets it for both sides")):
        r = flaloop(repo, "bench", OP, *BENCH, "--cand-env", arg)
        assert r.code == 2 and said in r.json["error"], (arg, r.stdout, r.stderr)
