"""The model check (`flaloop model`): the op inside examples/minifla's tiny causal LM, on the
Triton interpreter. The worker's model cell in this process (a fresh model trains the same run
from the same seed; noise of the op's tolerance moves it; the op's calls are found and timed);
the band and its finding, pure; the mapping and its refusals; and the command end to end on a
candidate with a planted drift, and on a model that does not import."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
import types

import pytest
from support.cli import flaloop
from support.repos import MINIFLA, OP, edit

from flaloop.core.errors import UsageError
from flaloop.inside import WORKER as WORKER_PKG
from flaloop.modelcheck import band
from flaloop.modelcheck.run import predicted_step_speedup
from flaloop.modelcheck.spec import MODELS, ModelSpec, parse_sets, resolve

WORKER = WORKER_PKG
TINY = ModelSpec.from_dict(MODELS["minifla"][OP])


@pytest.fixture(scope="module")
def worker_model():
    """The worker's model module, loaded as the worker loads it (under a private name), and
    minifla's op, imported from the example on the interpreter."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("_flaloop_worker_mc", WORKER / "__init__.py",
                                                  submodule_search_locations=[str(WORKER)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pkg
    spec.loader.exec_module(pkg)
    sys.path.insert(0, str(MINIFLA))
    try:
        from minifla.ops.linear_attn import chunk_linear_attn
        yield importlib.import_module(f"{spec.name}.model"), chunk_linear_attn
    finally:
        sys.path.remove(str(MINIFLA))
        for name in [n for n in sys.modules if n == "minifla" or n.startswith(("minifla.", spec.name))]:
            del sys.modules[name]


def model_cell(worker_model, steps: int = 3, **over):
    mod, fn = worker_model
    import torch

    server = types.SimpleNamespace(fn=fn, device=torch.device("cpu"))
    wire = {**TINY.to_wire(), "steps": steps, **over}
    return mod.ModelCell(server, {"id": "model/step", "model": wire, "seed": 0})


# -- the worker's model cell -----------------------------------------------------------------------

def test_a_seeded_run_repeats_bitwise_and_noise_of_the_tolerance_moves_it(worker_model):
    cell = model_cell(worker_model)
    a, b = cell.trajectory(2), cell.trajectory(2)
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
    assert a["op_calls"] == 2 * TINY.config["num_hidden_layers"]  # the layers reach the registry's op
    moved = cell.trajectory(2, perturb=0.005, noise_seed=1)
    assert moved["losses"] != a["losses"]
    assert all(abs(x - y) < 0.05 * abs(y) for x, y in zip(moved["losses"], a["losses"], strict=True))
    other = cell.trajectory(2, perturb=0.005, noise_seed=2)
    assert other["losses"] != moved["losses"]


def test_the_step_times_and_the_ops_share_of_it(worker_model):
    cell = model_cell(worker_model, warmup_steps=1)
    built = cell.build()
    assert built["ok"] and built["k"] == 1 and built["params"] > 0 and len(built["init_digest"]) == 64
    assert model_cell(worker_model, warmup_steps=0).build()["init_digest"] == built["init_digest"]  # same seed, same weights
    dev, wall = cell.sample()
    assert dev > 0 and wall > 0
    share = cell.opshare(reps=1)
    assert share["calls"] == TINY.config["num_hidden_layers"] and share["sites"] >= 2
    assert 0 < share["op_ms"] and 0 < share["share"] < 2  # replayed alone: noise may put it past the step
    # a model whose layers reach another function than the registry's op: no calls, which the session refuses
    cell.worker.fn = lambda *a, **k: None
    assert cell.opshare(reps=1) == {"calls": 0, "sites": 0}


@pytest.mark.parametrize("over, says", [
    ({"module": "minifla.no_such_models"}, "does not import"),
    ({"model_class": "NoSuchForCausalLM"}, "has no NoSuchForCausalLM"),
    ({"config": {**TINY.config, "hidden_size": 33}}, "refuses the config"),
])
def test_a_model_that_cannot_be_built_is_refused_with_the_reason(worker_model, over, says):
    mod, _ = worker_model
    with pytest.raises(mod.ModelRefused, match=says):
        model_cell(worker_model, **over).build()


# -- the band, pure --------------------------------------------------------------------------------

BASE = {"losses": [4.0, 3.9, 3.8, 3.7, 3.6], "grad_norms": [1.0, 1.0, 1.0, 1.0, 1.0]}
NOISY = [{"losses": [4.0, 3.901, 3.8, 3.702, 3.6], "grad_norms": [1.001, 1.0, 1.0, 1.0, 1.0]}]


def test_the_band_is_the_widest_perturbed_run_so_far_scaled():
    assert band.band([1.0, 1.0, 1.0], [[1.0, 1.01, 1.0], [1.0, 0.995, 1.002]], 3.0) == \
        pytest.approx([1e-6, 0.03, 0.03])


def test_a_planted_drift_is_named_by_its_step_and_its_size():
    drift = {"losses": [4.0, 3.9, 3.8, 3.75, 3.7], "grad_norms": BASE["grad_norms"]}
    j = band.judge(BASE, NOISY, drift, scale=3.0)
    assert not j.inside
    (d,) = j.departures
    assert (d.series, d.step) == ("losses", 3) and d.deviation == pytest.approx(0.05)
    assert d.band == pytest.approx(0.006) and d.times == pytest.approx(0.05 / 0.006)
    (f,) = band.findings(j, "model/step", 0.005, 1, 3.0)
    assert f.rule == "model-trajectory-left-band" and f.blocking
    assert "loss left the base's band at step 4" in f.message and "8.3x" in f.message


def test_the_same_run_is_inside_and_a_non_finite_loss_leaves():
    assert band.judge(BASE, NOISY, dict(BASE), 3.0).inside
    nan = {"losses": [4.0, math.nan, 3.8, 3.7, 3.6], "grad_norms": BASE["grad_norms"]}
    (d,) = band.judge(BASE, NOISY, nan, 3.0).departures
    assert d.step == 1 and math.isinf(d.deviation)
    assert "a non-finite value" in band.findings(band.judge(BASE, NOISY, nan, 3.0), "m", 0.005, 1, 3.0)[0].message


# -- which model, and refusals -----------------------------------------------------------------------

def test_the_mapping_the_contract_and_the_command_line_in_that_order():
    spec = resolve(OP, "minifla.ops.linear_attn", {"steps": 9, "config": {"num_hidden_layers": 2}},
                   parse_sets(["batch=2", "config.hidden_size=64", "dtype=bfloat16"]))
    assert (spec.steps, spec.batch, spec.dtype, spec.model_class) == (9, 2, "bfloat16", "LinearAttnForCausalLM")
    assert spec.config == {**TINY.config, "num_hidden_layers": 2, "hidden_size": 64}
    fla = resolve("chunk_delta_rule", "fla.ops.delta_rule")
    assert (fla.model_class, fla.config["attn_mode"], fla.batch, fla.seq_len) == ("DeltaNetForCausalLM", "chunk", 8, 2048)


@pytest.mark.parametrize("op, path, contract, says", [
    ("fused_recurrent_linear_attn", "minifla.ops.linear_attn", None, "no model is known for fused_recurrent_linear_attn"),
    ("chunk_delta_rule", "otherpkg.ops", None, "no op of this package"),
    (OP, "minifla.ops.linear_attn", {"off": True}, "has no model check"),
    (OP, "minifla.ops.linear_attn", {"stepz": 3}, "unknown model field"),
])
def test_no_model_for_the_op_is_a_usage_error(op, path, contract, says):
    with pytest.raises(UsageError, match=says):
        resolve(op, path, contract)


def test_a_set_that_is_not_key_value_is_refused():
    with pytest.raises(UsageError, match="not KEY=VALUE"):
        parse_sets(["steps"])


def test_the_ops_speedup_predicts_the_step_by_its_share():
    assert predicted_step_speedup(0.5, 2.0) == pytest.approx(1 / 0.75)
    assert predicted_step_speedup(0.25, 1.07) == pytest.approx(1 / (0.75 + 0.25 / 1.07))
    assert predicted_step_speedup(None, 1.1) is None and predicted_step_speedup(0.3, None) is None
    assert predicted_step_speedup(1.2, 2.0) == pytest.approx(2.0)  # a replay longer than the step: all of it


# -- the command end to end ------------------------------------------------------------------------

FAST = ("--min-pairs", "4", "--max-pairs", "6", "--sample-ms", "1", "--steps", "4", "--no-forkserver", "--json")


def test_a_planted_drift_blocks_and_the_step_time_is_measured_beside_it(repo):
    # the forward's output grows by a quarter: what a kernel that drops a normalisation does
    edit(repo / "minifla" / "ops" / "linear_attn" / "chunk.py", "b_o = b_o * scale", "b_o = b_o * scale * 1.25")
    r = flaloop(repo, "model", OP, *FAST)
    assert r.code == 1, r.stdout[-2000:] + r.stderr[-3000:]
    rec = r.json
    (f,) = [f for f in rec["findings"] if "loss" in f["message"]]
    assert f["rule"] == "model-trajectory-left-band" and f["blocking"]
    left = next(d for d in rec["trajectory"]["judgement"]["departures"] if d["series"] == "losses")
    assert f"at step {left['step'] + 1}:" in f["message"] and left["times"] > 1
    runs = rec["trajectory"]["runs"]
    assert set(runs) == {"base", "cand", "band1", "band2"} and all(len(x["losses"]) == 4 for x in runs.values())
    step = rec["step"]
    assert step["verdict"] == "BLOCKED" and step["pairs"] >= 6 and step["speedup"] > 0
    assert len(step["rounds"]) == 2 and step["op_share"] > 0 and step["predicted"] > 0
    assert {p["round"] for p in rec["cell"]["pairs"]} == {0, 1}  # fresh processes per round, as the bench
    assert os.path.isfile(rec["path"])


def test_a_model_that_does_not_import_is_refused_with_exit_2_and_save_names_it_in_the_contract(repo):
    r = flaloop(repo, "model", OP, *FAST, "--set", "module=minifla.no_such_models", "--save")
    assert r.code == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "does not import" in r.json["error"] and "--set" in r.json["hint"]
    contract = json.loads((repo / "profile" / f"{OP}-opt" / "contract.json").read_text())
    assert contract["model"] == {"module": "minifla.no_such_models", "steps": 4}  # what `stop --go` will run


# -- in the loop: the go's record, the report's section ------------------------------------------------

def _record(tmp_path, name: str, *, blocked: bool = False, cand: str = "c" * 40, aa: bool = False) -> dict:
    from flaloop.core.fsutil import atomic_write_json

    j = band.judge(BASE, NOISY, {"losses": [4.0, 3.9, 3.8, 3.75, 3.7], "grad_norms": BASE["grad_norms"]}
                   if blocked else dict(BASE), 3.0)
    found = [f.to_dict() for f in band.findings(j, "model/step", 0.005, 1, 3.0)]
    rec = {"kind": "model", "op": OP, "aa": aa, "refused": None, "base": {"commit": "b" * 40},
           "candidate": {"commit": cand}, "model": TINY.to_dict(), "errors": [], "blocked": bool(found),
           "findings": found, "command": f"flaloop model {OP}",
           "step": {"verdict": "FASTER", "status": "ok", "speedup": 1.05, "ci_low": 1.02, "ci_high": 1.08,
                    "base_ms": 10.0, "cand_ms": 9.5, "pairs": 16, "op_share": 0.4, "op_speedup": 1.1,
                    "op_speedup_from": "replay", "predicted": predicted_step_speedup(0.4, 1.1)},
           "trajectory": {"steps": 5, "perturb": 0.005, "band_seeds": 1, "band_scale": 3.0,
                          "runs": {"base": BASE, "cand": BASE, "band1": NOISY[0]}, "judgement": j.to_dict()}}
    path = tmp_path / "model" / name / "record.json"
    atomic_write_json(path, rec)
    return rec


def test_the_go_takes_the_newest_model_record_of_the_kept_commit_and_a_left_band_is_missing(tmp_path):
    from flaloop.modelcheck import run as mc

    _record(tmp_path, "20260101T000000Z-model")
    _record(tmp_path, "20260102T000000Z-model", blocked=True)
    _record(tmp_path, "20260103T000000Z-aa", aa=True)
    _record(tmp_path, "20260104T000000Z-model", cand="d" * 40)
    rec = mc.latest(tmp_path, "b" * 40, "c" * 40)
    assert rec["path"].endswith("20260102T000000Z-model/record.json")
    ((item, why),) = mc.go_missing(rec)
    assert item == "model" and "left the base's band at step 4" in why and rec["path"] in why
    assert mc.go_missing(mc.latest(tmp_path, "b" * 40, "d" * 40)) == []
    assert mc.latest(tmp_path, "b" * 40, "e" * 40) is None
    assert mc.named(types.SimpleNamespace(model={})) and not mc.named(types.SimpleNamespace(model=None))
    assert not mc.named(types.SimpleNamespace(model={"off": True}))


def test_the_reports_in_the_model_section_and_its_plot(tmp_path):
    from flaloop.modelcheck import run as mc
    from flaloop.report.markdown import _in_model
    from flaloop.report.plots import model_plot

    rec = _record(tmp_path, "20260102T000000Z-model", blocked=True)
    rec["path"] = str(tmp_path / "model" / "20260102T000000Z-model" / "record.json")
    doc = {"op": OP, "repo": str(tmp_path), "model": mc.summary(rec)}
    png = model_plot(doc, tmp_path / "model.png")
    assert png is not None and png.stat().st_size > 1000
    text = "\n".join(_in_model(doc, {"model": str(png)}))
    assert "| training step | 10.00 | 9.50 | 1.0500 | [1.0200, 1.0800] | FASTER | 16 |" in text
    assert "**outside**" in text and "model-trajectory-left-band" in text and "![model](model.png)" in text


def test_a_sweep_ranked_by_the_model_puts_the_faster_step_first_and_an_unchecked_one_unranked():
    from flaloop.bench.record import TreeRef
    from flaloop.report.sweep import render_markdown
    from flaloop.sweep.record import SweepRecord, SweepRow

    def row(ref, geo, model):
        return SweepRow(key=ref, op=OP, ref=ref, status="ok",
                        geomean={"speedup": geo, "ci_low": geo - 0.01, "ci_high": geo + 0.01},
                        model=model)

    rows = [row("opt/a", 1.20, {"speedup": 1.01, "ci_low": 1.0, "ci_high": 1.02, "verdict": "SAME"}),
            row("opt/b", 1.05, {"speedup": 1.04, "ci_low": 1.03, "ci_high": 1.05, "verdict": "FASTER"}),
            row("opt/c", 1.10, {"error": "the model does not fit"})]
    rec = SweepRecord(kind="candidates", created="t", base=TreeRef(commit="b" * 40), ops=[OP], rows=rows)
    rec.rank()
    assert [(r.ref, r.rank) for r in rec.rows] == [("opt/a", 1), ("opt/c", 2), ("opt/b", 3)]  # the op's geomean
    rec.rank_by = "model"
    rec.rank()
    assert [(r.ref, r.rank) for r in rec.rows] == [("opt/b", 1), ("opt/a", 2), ("opt/c", None)]
    text = render_markdown(rec)
    assert "Ranked by the model check's step-time speedup" in text and "- opt/c: the model does not fit" in text
    assert SweepRecord.from_dict(rec.to_dict()).rank_by == "model"
