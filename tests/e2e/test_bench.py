"""`flaloop bench` and `flaloop verify` as a user meets them, on the CPU timer: real git
worktrees, real worker processes, real pipes. Speed is not asserted; outcomes are."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.bench import QUICK, bench
from support.cli import flaloop
from support.repos import OP, edit, git, worktrees

FAST = Path("toyop/ops/toy/fast.py")
def test_aa_measures_every_cell_in_abba_pairs_and_cleans_up(toy):
    r, rec = bench(toy, "--aa")
    assert r.code == 0, r.stderr
    assert rec["aa"] is True and len(rec["cells"]) == 2  # one shape x fwd, fwdbwd
    for cell in rec["cells"]:
        assert cell["status"] == "ok", cell["reason"]
        assert cell["timer"] == "cpu"
        orders = [p["order"] for p in cell["pairs"]]
        assert orders[:4] == ["AB", "BA", "AB", "BA"]
        # the pairs rotate over the cell's placements a whole ABBA block at a time (the CPU builds one)
        assert [p["placement"] for p in cell["pairs"]] == [i // 2 % 4 for i in range(len(cell["pairs"]))]
        assert {(b["side"], b["built"]) for b in cell["setup"]["placements"]} == {("base", 1), ("cand", 1)}
        assert cell["diff"]["match"] is True
        assert set(cell["summary"]["base"]) >= {"median", "mean", "std", "min", "p10", "p90", "n"}
        assert cell["verdict"] in {"SAME", "UNSURE", "FASTER", "SLOWER"}
        # each sample's round trip on flaloop's clock, against which every honest report falls short
        assert all(0 < p[f"{s}_reported_ms"] < p[f"{s}_rtt_ms"] for p in cell["pairs"] for s in ("base", "cand"))
    assert rec["summary"]["geomean"]["n_cells"] == 2
    # where the run's time went, in order, ending where the session ended
    steps = [what for what, _ in rec["timeline"]]
    assert steps[:3] == ["base worktree", "workers started", "warm-up: workers ready"]
    assert steps.index("warm-up done") < steps.index("round 1: workers ready") and steps[-1] == "done"
    assert [c["cell"]["id"] for c in rec["cells"]] == [w.split(": ")[1][:-len(" measured")] for w in steps
                                                       if w.startswith("round 1: ") and w.endswith(" measured")]
    times = [t for _, t in rec["timeline"]]
    assert times == sorted(times) and times[-1] <= rec["wall_s"] + 0.5
    # the pair that warmed the cells up measured none of them: round 1 had fresh processes too
    # (and k from the warm-up, since nothing compiled there: the interpreter compiles nothing)
    assert rec["primed"] is None and set(rec["warmup"].values()).isdisjoint(rec["rounds"][0].values())
    assert all(p["round"] == 0 for c in rec["cells"] for p in c["pairs"])  # QUICK: one round
    assert rec["waited_s"]["setup"] > 0 and rec["waited_s"]["sample"] > 0 and rec["waited_s"]["compare"] > 0
    assert rec["transfer"] == {"how": "file", "why": "no GPU: CUDA IPC needs one"}
    assert Path(rec["path"]).is_file()
    saved = json.loads(Path(rec["path"]).read_text())
    assert saved["cells"][0]["pairs"][0]["base_ms"] > 0
    assert worktrees(toy) == [str(toy)]


def test_base_runs_base_code_and_a_wrong_candidate_is_blocked(toy):
    edit(toy / FAST, "return o.to(q.dtype), None", "return (o * 1.5).to(q.dtype), None")
    r, rec = bench(toy)
    assert r.code == 1, r.stderr
    hello = rec["workers"]
    # the candidate is the working tree snapshotted into a commit, checked out like the base: the
    # bench never measures the directory the user goes on editing
    assert "flaloop-wt-" in hello["cand"]["op_module_file"] and not hello["cand"]["op_module_file"].startswith(str(toy))
    assert "flaloop-wt-" in hello["base"]["op_module_file"]
    assert rec["candidate"]["dirty"] is True and rec["candidate"]["diff_hash"]
    snap = rec["candidate"]["commit"]
    assert snap != rec["candidate"]["head"]
    assert "(o * 1.5)" in subprocess.run(["git", "show", f"{snap}:{FAST}"], cwd=toy, capture_output=True,
                                         text=True, check=True).stdout
    for cell in rec["cells"]:
        assert cell["status"] == "blocked" and "differs from base" in cell["reason"]
        assert cell["pairs"] == []
    assert worktrees(toy) == [str(toy)]


def test_candidate_producing_nan_is_blocked(toy):
    edit(toy / FAST, "a = a.tril()", "a = a.tril() * float('nan')")
    r, rec = bench(toy, "--modes", "fwd")
    assert r.code == 1
    cell = rec["cells"][0]
    assert cell["status"] == "blocked"
    assert any(t["nonfinite_self"] for t in cell["diff"]["tensors"].values())


def test_inputs_outside_the_domain_are_refused_and_an_override_fixes_them(toy):
    r, rec = bench(toy, "--modes", "fwd", op="toy_log")
    assert r.code == 3  # nothing measured
    cell = rec["cells"][0]
    assert cell["status"] == "refused" and "outside the op's domain" in cell["reason"]
    r, rec = bench(toy, "--modes", "fwd", "--input", "q=sigmoid", op="toy_log")
    assert r.code == 0, r.stderr
    assert rec["cells"][0]["status"] == "ok" and rec["config"]["inputs"] == {"q": "sigmoid"}


def _commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def test_a_cell_the_op_itself_refuses_at_the_base_is_refused_in_its_words_and_a_fault_is_not(toy):
    """On the H200, FLA refuses the backward of its gated ops with Triton < 3.7.1 on Hopper: its own
    code raises a RuntimeError that says why. That is the op declining the cell on this machine, not
    a failure of flaloop or of a candidate: the cell is refused with the op's words and where it
    said them. An error torch raises inside the op's code (a call, not a `raise`) stays a failure,
    and so does a refusal only the candidate makes."""
    guard = ("    if torch.is_grad_enabled() and q.requires_grad:\n"
             "        raise RuntimeError('toy_attn: no backward on this machine (see #640)')\n    scale = q.shape")
    edit(toy / FAST, "    scale = q.shape", guard)
    r, rec = bench(toy, "--modes", "fwdbwd")  # the candidate alone refuses: it broke the backward
    assert r.code == 3, r.stderr
    (cell,) = rec["cells"]
    assert cell["status"] == "failed" and cell["reason"].startswith("cand: RuntimeError: toy_attn: no backward")
    _commit(toy, "the op refuses its backward here")
    r, rec = bench(toy, "--aa", "--base", "HEAD")  # the contract's base is the commit before
    assert r.code == 0, r.stderr  # the forward is measured
    fwd, bwd = rec["cells"]
    assert fwd["status"] == "ok" and bwd["status"] == "refused" and bwd["verdict"] == "REFUSED"
    assert bwd["reason"].startswith("the op refuses this cell here: its own code raised RuntimeError: toy_attn: "
                                    "no backward on this machine (see #640) (at toyop/ops/toy/fast.py:6) on the base")
    assert "Traceback" in bwd["setup"]["base_traceback"]

    # a second disguise: the refusal in the backward of an autograd Function of another module,
    # an `assert` whose message is built at run time
    (toy / "toyop/ops/toy/guarded.py").write_text(
        "import torch\n\n\nclass Guard(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, o):\n        return o.clone()\n\n"
        "    @staticmethod\n    def backward(ctx, g):\n        what = '-'.join(['bwd', 'unsupported'])\n"
        "        assert g.shape[0] < 0, what\n        return g\n")
    edit(toy / FAST, guard, "    scale = q.shape")
    edit(toy / FAST, "    return o.to(q.dtype), None", "    from .guarded import Guard\n    return Guard.apply(o.to(q.dtype)), None")
    _commit(toy, "the backward asserts")
    r, rec = bench(toy, "--aa", "--base", "HEAD", "--modes", "fwdbwd")
    assert r.code == 3, r.stderr
    (cell,) = rec["cells"]
    assert cell["status"] == "refused", cell["reason"]
    assert "raised AssertionError: bwd-unsupported (at toyop/ops/toy/guarded.py:12)" in cell["reason"]

    # an error torch raises inside the op's own code is a fault, never a refusal
    (toy / "toyop/ops/toy/guarded.py").write_text(
        "import torch\n\n\nclass Guard(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, o):\n        return o.clone()\n\n"
        "    @staticmethod\n    def backward(ctx, g):\n        return g.view(-1, 7, 5, 3)\n")
    _commit(toy, "the backward breaks")
    r, rec = bench(toy, "--aa", "--base", "HEAD", "--modes", "fwdbwd")
    assert r.code == 3, r.stderr
    (cell,) = rec["cells"]
    assert cell["status"] == "failed" and cell["reason"].startswith("base: RuntimeError"), cell["reason"]


def test_an_input_tied_to_another_by_neg_brings_the_op_into_its_domain(toy):
    """FLA's DPLR op gives non-finite values on independent inputs: its tests draw b = -a. `--input
    b=neg:a` builds b as minus a, as built (a's own transform included); naming an input that is not
    built before it, or none, is a usage error (exit 2) before any worker starts."""
    reg = toy / "benchmarks/ops/registry.py"
    reg.write_text(reg.read_text() + (
        "register_op(OpConfig(\n    name='toy_pair', import_path='toyop.ops.toy', func_name='toy_pair',\n"
        "    inputs={'a': TensorSpec(shape_BTHD), 'b': TensorSpec(shape_BTHD)}, test_file='tests/ops/test_toy.py',\n))\n"))
    fast = toy / FAST
    fast.write_text(fast.read_text() + "\n\ndef toy_pair(a, b):\n    return (-(a.float() * b.float())).log().to(a.dtype), None\n")
    edit(toy / "toyop/ops/toy/__init__.py", "toy_attn, toy_log", "toy_attn, toy_log, toy_pair")
    _commit(toy, "an op of two tied inputs")
    assert flaloop(toy, "init", "toy_pair", "--modes", "fwd").code == 0
    r, rec = bench(toy, "--aa", "--modes", "fwd", op="toy_pair")
    assert r.code == 3 and "outside the op's domain" in rec["cells"][0]["reason"], r.stderr
    r, rec = bench(toy, "--aa", "--modes", "fwd", "--input", "b=neg:a", op="toy_pair")
    assert r.code == 0, r.stderr
    assert rec["cells"][0]["status"] == "ok" and rec["config"]["inputs"] == {"b": "neg:a"}
    for bad in ("a=neg:b", "b=neg:zz"):
        r = flaloop(toy, "init", "toy_pair", "--force", "--input", bad)
        assert r.code == 2 and f"{bad}: unknown transform" in r.stderr, r.stderr
        assert "neg:OTHER (minus an input built before it; in order: a, b)" in r.stderr


def test_crashed_worker_leaves_a_readable_report(toy):
    edit(toy / FAST, "    scale = q.shape", "    import os, sys\n    print('candidate kernel exploded', file=sys.stderr)\n"
         "    os._exit(7)\n    scale = q.shape")
    r, rec = bench(toy, "--modes", "fwd")
    assert r.code == 3
    assert rec["cells"][0]["status"] == "failed"
    assert any("candidate kernel exploded" in e for e in rec["errors"])
    assert "cand worker" in rec["cells"][0]["reason"]
    human = flaloop(toy, "bench", "toy_attn", *QUICK, "--modes", "fwd")
    assert human.code == 3 and "candidate kernel exploded" in human.stdout
    assert worktrees(toy) == [str(toy)]


def test_hung_worker_times_out_and_is_reported(toy):
    edit(toy / FAST, "    scale = q.shape", "    import time\n    time.sleep(120)\n    scale = q.shape")
    t0 = time.monotonic()
    # 20 s, far below the 120 s stall: with 8 s the run once ended before any cell on a loaded
    # 2-core CPU (most likely a worker's greeting, which the same timeout bounds, ran out first)
    r, rec = bench(toy, "--modes", "fwd", "--worker-timeout", "20")
    assert r.code == 3
    assert time.monotonic() - t0 < 100
    assert "hung" in rec["cells"][0]["reason"], rec.get("errors") or r.stderr[-2000:]
    assert worktrees(toy) == [str(toy)]


def test_ctrl_c_removes_the_worktree_and_the_workers(toy):
    edit(toy / FAST, "    scale = q.shape", "    import time\n    time.sleep(120)\n    scale = q.shape")
    proc = subprocess.Popen([sys.executable, "-m", "flaloop", "bench", "toy_attn", "--json", *QUICK], cwd=toy,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    deadline = time.monotonic() + 60
    while len(worktrees(toy)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    wt = [w for w in worktrees(toy) if w != str(toy)]
    assert wt, "the base worktree never appeared"
    time.sleep(3)  # let the workers start and block inside the op
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    doc = json.loads(out)  # an agent still gets one JSON document, naming the partial record
    assert doc["exit_code"] == 130 and doc["error"] == "interrupted"
    assert json.loads(Path(doc["record"]).read_text())["interrupted"] is True
    assert worktrees(toy) == [str(toy)]
    assert not Path(wt[0]).exists() and not Path(wt[0]).parent.exists()
    leftover = subprocess.run(["pgrep", "-f", f"worker.py --tree {wt[0]}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_verify_never_benchmarks_on_a_red_gate(toy):
    (toy / "toyop/ops/toy/naive.py").write_text((toy / "toyop/ops/toy/naive.py").read_text() + "\n# x\n")
    r = flaloop(toy, "verify", "toy_attn", "--json", *QUICK)
    assert r.code == 1
    doc = json.loads(r.stdout)
    assert doc["gate"]["green"] is False and doc["bench"] is None


def test_verify_with_no_gate_is_loudly_unverified(toy):
    r = flaloop(toy, "verify", "toy_attn", "--no-gate", *QUICK, "--modes", "fwd")
    assert r.code == 0, r.stderr
    assert "UNVERIFIED" in r.stdout and "--no-gate" in r.stdout
    r = flaloop(toy, "verify", "toy_attn", "--no-gate", "--json", *QUICK, "--modes", "fwd")
    assert json.loads(r.stdout)["bench"]["unverified"] is True


def test_verify_gate_then_bench_on_the_triton_example(repo):
    r = flaloop(repo, "verify", OP, "--json", *QUICK, "--modes", "fwd", "--dtype", "float32")
    assert r.code == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["gate"]["green"] is True
    cell = doc["bench"]["cells"][0]
    assert cell["status"] == "ok" and cell["diff"]["match"] is True
    assert doc["bench"]["workers"]["base"]["op_func_file"].endswith("minifla/ops/linear_attn/chunk.py")


def test_varlen_cells_pass_cu_seqlens(toy):
    r, rec = bench(toy, "--aa", "--modes", "fwd", "--varlen")
    assert r.code == 0, r.stderr
    cells = {c["cell"]["shape_name"]: c for c in rec["cells"]}
    varlen = cells["B2_T64_H2_D16_varlen4"]
    assert varlen["status"] == "ok"
    assert varlen["cell"]["shape"]["B"] == 1 and sum(varlen["cell"]["seqlens"]) == 128
    assert "cu_seqlens" in varlen["setup"]["base"]["extra_kwargs"]


def test_a_cell_that_fails_on_one_side_shows_as_failed_and_the_rest_is_measured(toy):
    edit(toy / FAST, "    scale = q.shape", "    if q.shape[1] == 128:\n        raise ValueError('T=128 unsupported')\n"
         "    scale = q.shape")
    r, rec = bench(toy, "--modes", "fwd", "--shapes", "B2_T64_H2_D16", "--shapes", "B1_T128_H2_D32")
    cells = {c["cell"]["shape_name"]: c for c in rec["cells"]}
    assert cells["B1_T128_H2_D32"]["status"] == "failed"
    assert "T=128 unsupported" in cells["B1_T128_H2_D32"]["reason"]
    assert cells["B2_T64_H2_D16"]["status"] == "ok"
    assert r.code == 3  # a measurement failed; what could be measured still has its verdict
    human = flaloop(toy, "bench", "toy_attn", *QUICK, "--modes", "fwd", "--shapes", "B1_T128_H2_D32",
                    "--shapes", "B2_T64_H2_D16")
    assert "FAILED" in human.stdout and "T=128 unsupported" in human.stdout


def test_an_op_imported_from_outside_its_tree_is_refused(toy, tmp_path):
    # The candidate's package hands out a function that lives elsewhere (an installed copy,
    # a vendored module): measuring it would time the wrong code.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "shadow_toy.py").write_text((toy / FAST).read_text())
    init = toy / "toyop/ops/toy/__init__.py"
    init.write_text(f"import sys\nsys.path.insert(0, {str(elsewhere)!r})\nfrom shadow_toy import toy_attn, toy_log\n")
    r = flaloop(toy, "bench", "toy_attn", *QUICK)
    assert r.code == 3
    assert "not from its tree" in r.stderr and "shadow_toy.py" in r.stderr
    assert worktrees(toy) == [str(toy)]


def test_bench_names_the_last_gate_of_the_same_tree_state_only(toy):
    assert flaloop(toy, "gate", "toy_attn").code == 0
    r = flaloop(toy, "bench", "toy_attn", *QUICK, "--modes", "fwd")
    assert r.code == 0, r.stderr
    assert "last gate of this exact tree state was GREEN" in r.stdout
    edit(toy / FAST, "a = a.tril()", "a = a.tril()  # a change the gate has not seen")
    r = flaloop(toy, "bench", "toy_attn", *QUICK, "--modes", "fwd")
    assert "UNVERIFIED" in r.stdout and "last gate" not in r.stdout


@pytest.mark.gpu
def test_aa_on_the_gpu_uses_proven_cuda_graphs_and_reads_clocks(repo):
    r = flaloop(repo, "bench", OP, "--aa", "--json", "--device", "cuda", "--shapes", "B8_T1024_H8_D64",
                "--min-pairs", "16", "--max-pairs", "64", "--cell-seconds", "20", env={"TRITON_INTERPRET": None})
    assert r.code == 0, r.stderr[-3000:]
    rec = json.loads(r.stdout)
    assert rec["env"]["device"] == "cuda" and rec["env"]["nvml"] == "ok"
    for cell in rec["cells"]:
        assert cell["status"] == "ok", cell["reason"]
        assert cell["timer"] == "cuda_graph" and cell["setup"]["base"]["graph_bitwise_equal"] is True
        assert cell["k"] >= 2  # calibrated from device time to ~10 ms samples
        assert cell["pairs"][0]["clock_before"]["sm_mhz"] > 0
        assert cell["launch_bound"] in (True, False)
        assert cell["verdict"] in ("SAME", "UNSURE")
        assert {b["built"] for b in cell["setup"]["placements"]} == {4}  # the default, on both sides
