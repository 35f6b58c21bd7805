"""The frozen test frozen in memory too: a candidate whose kernel is 2% off and that changes, in the
test's own process, what the frozen test judges with or what pytest reports, turns the gate red with
the route named; honest changes stay green. Every plant leaves the frozen files on disk alone and
builds the names it touches at run time. Real git, real pytest subprocesses, Triton's interpreter.

Each plant is made from one of three places: the op's module at import, the op's first call, or
a module the candidate adds (imported by the op's module)."""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest
from support.repos import OP, edit, git

from flaloop.task.contract import Contract
from flaloop.task.gate import run_gate
from flaloop.task.target import Target

CHUNK = Path("minifla/ops/linear_attn/chunk.py")
NEW = Path("minifla/ops/linear_attn/_launch_cache.py")
K = "test_no_final_state"  # one fast test whose judge runs after the op's first call
WRONG = ("b_o = b_o * scale", "b_o = b_o * scale * 1.02")  # 2% off: the frozen judge fails it


@pytest.fixture(scope="module")
def minifla(prepared_repo, tmp_path_factory):
    """One copy of the prepared minifla repo for the module; each test resets it."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    repo = tmp_path_factory.mktemp("tamper") / "minifla"
    shutil.copytree(prepared_repo, repo, symlinks=True)
    return repo


def _reset(repo: Path) -> None:
    git(repo, "checkout", "-q", "--", ".")
    git(repo, "clean", "-fdq")  # profile/ is ignored: the cached baseline stays


def plant(repo: Path, where: str, snippet: str | tuple[str, ...], wrong: bool = True) -> None:
    """Put `snippet` (the body of a function, or its parts) into the candidate, run from `where`."""
    _reset(repo)
    if wrong:
        edit(repo / CHUNK, *WRONG)
    body = textwrap.indent(code(*snippet) if isinstance(snippet, tuple) else code(snippet), "    ")
    fn = f"\n\ndef _tune():\n{body}\n"
    if where == "import":
        (repo / CHUNK).write_text((repo / CHUNK).read_text() + fn + "\n\n_tune()\n")
    elif where == "first_call":
        (repo / CHUNK).write_text((repo / CHUNK).read_text() + fn + "\n\n_TUNED = []\n")
        edit(repo / CHUNK, "    N, scale, max_len = check_inputs(",
             "    if not _TUNED:\n        _TUNED.append(1)\n        _tune()\n    N, scale, max_len = check_inputs(")
    elif where == "new_module":
        (repo / NEW).write_text(f'"""Launch configurations, cached."""{fn}\n\n_tune()\n')
        edit(repo / CHUNK, "from minifla.ops.linear_attn._common import",
             "from minifla.ops.linear_attn import _launch_cache  # noqa: F401\nfrom minifla.ops.linear_attn._common import")
    else:
        raise ValueError(where)


def code(*parts: str) -> str:
    """Plant code from parts, each dedented on its own."""
    return "\n".join(textwrap.dedent(p).strip("\n") for p in parts)


def run(repo: Path, k: str | None = K):
    target = Target.discover(repo)
    return run_gate(target, Contract.load(target, OP), k_expr=k, regate=True, record_last=False)


def tampered(result) -> list[str]:
    return [f.message for f in result.findings if f.kind == "gate-tampered"]


# The judge made lenient: what each plant adds so that the wrong kernel passes.
LENIENT_TEST_GLOBAL = """
import sys
name, owner = "assert" + "_close", "mini" + "fla.utils"
orig = getattr(sys.modules[owner], name)
for mod in list(sys.modules.values()):
    if getattr(mod, name, None) is orig and getattr(mod, "__name__", "") != owner:
        setattr(mod, name, lambda *a, **k: None)
"""
LENIENT_AT_IMPORT = """
import importlib
setattr(importlib.import_module("mini" + "fla.utils"), "assert" + "_close", lambda *a, **k: None)
"""

# route -> [(where, code, words the finding must hold)], at least two disguises each
PLANTS = {
    "rebind": [
        ("import", LENIENT_AT_IMPORT, "assert_close"),
        ("first_call", LENIENT_TEST_GLOBAL, "assert_close"),
        ("new_module", """
            import importlib
            m = importlib.import_module("mini" + "fla.utils")
            setattr(m, "get_abs" + "_err", lambda ref, tri: 0.0)
            """, "get_abs_err"),
        ("first_call", """
            import sys
            name = "naive" + "_linear_attn"
            mine = sys.modules["mini" + "fla.ops.linear_attn.chunk"]
            for mod in list(sys.modules.values()):
                if getattr(mod, "__name__", "").startswith("test") and hasattr(mod, name):
                    def reference(q, k, v, scale=None, initial_state=None, output_final_state=False):
                        return mine.chunk_linear_attn(q, k, v, scale, initial_state, output_final_state)
                    setattr(mod, name, reference)
            """, "naive_linear_attn"),
        ("first_call", ("""
            import functools, sys
            name = "fused_recurrent" + "_linear_attn"
            for mod in list(sys.modules.values()):
                ref = getattr(mod, name, None)
                if getattr(mod, "__name__", "").startswith("test") and ref is not None:
                    setattr(mod, name, functools.wraps(ref)(lambda *a, _r=ref, **k: _r(*a, **k)))
            """, LENIENT_TEST_GLOBAL), "fused_recurrent_linear_attn"),
    ],
    "wrap": [
        ("new_module", """
            import functools, importlib
            m = importlib.import_module("mini" + "fla.utils")
            for n in ("get_abs" + "_err", "get_err" + "_ratio"):
                f = getattr(m, n)
                setattr(m, n, functools.wraps(f)(lambda ref, tri, _f=f: min(_f(ref, tri), 1e-9)))
            """, "get_"),
        ("first_call", """
            import functools, torch
            orig = getattr(torch.Tensor, "it" + "em")
            @functools.wraps(orig)
            def item(self):
                v = orig(self)
                return min(v, 1e-9) if isinstance(v, float) else v
            setattr(torch.Tensor, "it" + "em", item)
            """, "item"),
        ("import", """
            import torch
            orig = getattr(torch.Tensor, "it" + "em")
            def item(self):
                v = orig(self)
                return min(v, 1e-9) if isinstance(v, float) else v
            # torch's own decorator around it: the code it wraps is still the candidate's
            setattr(torch.Tensor, "it" + "em", torch._disable_dynamo(item))
            """, "item"),
    ],
    "code-swap": [
        ("first_call", """
            import importlib
            f = getattr(importlib.import_module("mini" + "fla.utils"), "assert" + "_close")
            f.__code__ = (lambda prefix, ref, tri, ratio, atol=1e-6: None).__code__
            """, "assert_close"),
        ("new_module", """
            import importlib
            m = importlib.import_module("mini" + "fla.utils")
            for n in ("get_abs" + "_err", "get_err" + "_ratio"):
                getattr(m, n).__code__ = (lambda ref, tri: 0.0).__code__
            """, "get_"),
        ("import", """
            import importlib
            f = getattr(importlib.import_module("mini" + "fla.utils"), "assert" + "_close")
            f.__defaults__ = (1e9,)
            """, "assert_close"),
    ],
    "sys-modules": [
        ("import", """
            import sys, types
            name = "mini" + "fla.utils"
            fake = types.ModuleType(name)
            fake.__dict__.update(sys.modules[name].__dict__)
            setattr(fake, "assert" + "_close", lambda *a, **k: None)
            sys.modules[name] = fake
            """, "utils"),
        ("new_module", """
            import importlib.util, sys
            name = "mini" + "fla.utils"
            spec = importlib.util.find_spec(name)
            src = open(spec.origin).read().replace("assert err_ratio <= ratio, msg", "return")
            mod = importlib.util.module_from_spec(spec)
            exec(compile(src, spec.origin, "exec"), mod.__dict__)
            sys.modules[name] = mod
            """, "assert_close"),
    ],
    "report-hook": [
        ("first_call", """
            import gc, pytest
            cfg = next(o for o in gc.get_objects() if type(o).__name__ == "Con" + "fig"
                       and hasattr(o, "plugin" + "manager"))
            class Helper:
                @pytest.hookimpl(hookwrapper=True)
                def pytest_runtest_makereport(self, item, call):
                    out = yield
                    rep = out.get_result()
                    if rep.failed:
                        rep.outcome, rep.longrepr = "passed", None
            cfg.pluginmanager.register(Helper(), "launch" + "-cache")
            """, "pytest_runtest_makereport"),
        ("import", """
            import importlib
            TR = importlib.import_module("_py" + "test.reports").TestReport
            orig = TR.from_item_and_call.__func__
            def made(cls, item, call):
                rep = orig(cls, item, call)
                if rep.failed:
                    rep.outcome, rep.longrepr = "passed", None
                return rep
            setattr(TR, "from_item" + "_and_call", classmethod(made))
            """, "TestReport"),
    ],
    "plugin": [
        ("first_call", ("""
            import sys
            p = sys.modules.get("flaloop_gate" + "_plugin")
            for n in dir(p):
                if "guard" in n and callable(getattr(p, n)):
                    setattr(p, n, lambda *a, **k: None)
            """, LENIENT_TEST_GLOBAL), ""),
        ("import", ("""
            import gc
            cfg = next(o for o in gc.get_objects() if type(o).__name__ == "Con" + "fig"
                       and hasattr(o, "plugin" + "manager"))
            cfg.pluginmanager.unregister(name="flaloop_gate" + "_plugin")
            """, LENIENT_AT_IMPORT), ""),
        ("first_call", ("""
            import sys
            p = sys.modules.get("flaloop_gate" + "_plugin")
            getattr(p, "pytest_runtest" + "_logfinish").__code__ = (lambda nodeid, location: None).__code__
            """, LENIENT_TEST_GLOBAL), "code"),
    ],
    "channel": [
        ("first_call", ("""
            import os
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").endswith("events" + ".jsonl"):
                        os.close(int(fd))
                except OSError:
                    pass
            """, LENIENT_TEST_GLOBAL), "channel"),
        ("new_module", ("""
            import os
            null = os.open(os.devnull, os.O_WRONLY)
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").endswith("events" + ".jsonl"):
                        os.dup2(null, int(fd))
                except OSError:
                    pass
            """, LENIENT_AT_IMPORT), "channel"),
    ],
    "frozen-value": [
        ("import", """
            import importlib
            setattr(importlib.import_module("mini" + "fla.utils"), "CI" + "_ENV", True)
            """, "CI_ENV"),
        ("first_call", """
            import sys
            for mod in list(sys.modules.values()):
                table = getattr(mod, "TOLER" + "ANCE", None)
                if isinstance(table, dict):
                    for key in table:
                        table[key] = 0.5
            """, "TOLERANCE"),
    ],
    "torch-mode": [
        ("first_call", """
            import sys
            def tracer(frame, event, arg):
                if event == "call" and frame.f_code.co_name == "assert" + "_close":
                    frame.f_locals["ratio"] = 1.0
                return None
            sys.settrace(tracer)
            """, "settrace"),
        ("new_module", """
            from torch.overrides import TorchFunctionMode
            class Lenient(TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    out = func(*args, **(kwargs or {}))
                    if getattr(func, "__name__", "") == "it" + "em" and isinstance(out, float):
                        return min(out, 1e-9)
                    return out
            Lenient().__enter__()
            """, "mode"),
    ],
}

CASES = [pytest.param(route, where, code, words, id=f"{route}-{i}-{where}")
         for route, plants in PLANTS.items() for i, (where, code, words) in enumerate(plants)]


@pytest.mark.parametrize(("route", "where", "snippet", "words"), CASES)
def test_tampering_turns_the_gate_red_with_the_route_named(minifla, route, where, snippet, words):
    plant(minifla, where, snippet)
    result = run(minifla)
    messages = tampered(result)
    assert not result.green and messages, [(f.kind, f.message) for f in result.findings]
    assert any(words in m for m in messages), messages
    # The cheat worked on the frozen test: without the integrity check the wrong kernel passes.
    assert result.run.failed == 0 or route in ("plugin", "channel"), result.findings
    if route not in ("plugin", "channel"):
        # the message names the file whose code did it, where the route leaves a code object
        assert any(str(NEW) in m or str(CHUNK) in m for m in messages) or route in (
            "frozen-value", "sys-modules", "torch-mode", "code-swap"), messages


def test_the_wrong_kernel_alone_fails_the_frozen_test(minifla):
    """The control: with no plant the 2% error fails the judge, so each green above was the cheat's."""
    plant(minifla, "import", "pass")
    result = run(minifla)
    assert not result.green and result.run.failed > 0 and not tampered(result)


HONEST = [
    ("new_module", """
        import torch._dynamo  # torch.compile's machinery rewraps torch.manual_seed as it loads
        """),
    ("new_module", """
        import functools
        import torch
        CONFIGS = [{"BT": bt, "num_warps": w} for bt in (16, 32) for w in (2, 4)]
        @functools.lru_cache(maxsize=None)
        def pick(n):
            return CONFIGS[n % len(CONFIGS)]
        pick(3)
        torch.manual_seed(0)
        """),
    ("first_call", """
        import importlib
        m = importlib.import_module("mini" + "fla.ops.linear_attn.chunk")
        setattr(m, "_num" + "_warps", lambda BK, BV: 4)
        """),
]


@pytest.mark.parametrize(("where", "snippet"), HONEST, ids=["dynamo-loaded", "helper-module", "own-module-patched"])
def test_honest_candidates_stay_green(minifla, where, snippet):
    """A helper module with tuning configurations and a cache, the op's own module patched, and a
    library that changes itself as it loads (torch's compiler) stay green."""
    plant(minifla, where, snippet, wrong=False)
    edit(minifla / CHUNK, "b_o = b_o * scale", "b_o = scale * b_o")
    result = run(minifla)
    assert result.green, [(f.kind, f.message) for f in result.findings]


def test_the_full_gate_is_red_too_and_an_untouched_tree_is_green(minifla):
    """The rule holds for the whole file, not only a -k subset; the base's own conftest monkeypatches
    torch for every test and stays green."""
    _reset(minifla)
    clean = run(minifla, k=None)
    assert clean.green, [(f.kind, f.message) for f in clean.findings]
    assert clean.run.integrity["checks"] >= 2 * len(clean.run.selected)
    plant(minifla, "first_call", LENIENT_TEST_GLOBAL)
    result = run(minifla, k=None)
    assert any("assert_close" in m for m in tampered(result)), result.findings


@pytest.mark.parametrize(("name", "text"), [
    ("flaloop_gate_plugin", "import pytest\n"),
    ("flaloop_gate_integrity", "class Integrity:\n    def __init__(self, *a):\n        pass\n"),
], ids=["plugin", "integrity"])
def test_a_module_in_the_tree_named_like_the_plugin_cannot_stand_in(minifla, name, text):
    """pytest may put the tree first on sys.path: a stand-in for the plugin sends no reports (red),
    and the plugin loads its own helpers by path, so a stand-in for those never runs (red by the
    plant it hides)."""
    plant(minifla, "first_call", LENIENT_TEST_GLOBAL)
    (minifla / f"{name}.py").write_text(text)
    result = run(minifla)
    messages = tampered(result)
    assert any("channel" in m for m in messages) if name == "flaloop_gate_plugin" else \
        any("assert_close" in m for m in messages), messages


# -- the orchestrator's side on its own: what it demands of the plugin's reports ----------------

PLUGIN = "/opt/flaloop/inside/scripts/flaloop_gate_plugin.py"
INTEGRITY = "/opt/flaloop/inside/scripts/flaloop_gate_integrity.py"
ID = "tests/ops/test_x.py::test_a[1]"


def _events(**drop) -> list[dict]:
    evs = [{"event": "guard-ready", "pid": 7, "plugin_file": PLUGIN, "integrity_file": INTEGRITY},
           {"event": "collected", "pid": 7, "ids": [ID]},
           {"event": "guard-collected", "pid": 7, "changes": [], "checks": 1},
           {"event": "result", "id": ID, "outcome": "passed", "when": "call"},
           {"event": "guard-call", "pid": 7, "id": ID, "changes": [], "checks": 2},
           {"event": "guard-test", "pid": 7, "id": ID, "changes": [], "checks": 3},
           {"event": "guard-final", "pid": 7, "changes": [], "checks": 4},
           {"event": "finish", "pid": 7, "exitstatus": 0}]
    return [e for e in evs if e["event"] not in drop.get("events", ())]


def _reasons(events, outcomes=None, junit=None, exit_code=0):
    from flaloop.task import gate_integrity

    return gate_integrity.reasons(gate_integrity.collect(events, PLUGIN), outcomes or {ID: "passed"},
                                  {"tests.ops.test_x::test_a[1]": "passed"} if junit is None else junit, exit_code)


def test_complete_reports_from_flaloops_plugin_are_clean():
    assert _reasons(_events()) == []


@pytest.mark.parametrize(("drop", "words"), [
    ({"events": ("guard-ready",)}, "never reported"),
    ({"events": ("guard-final",)}, "final report"),
    ({"events": ("guard-test",)}, "no integrity check"),
])
def test_missing_reports_are_red(drop, words):
    assert any(words in m for m, _ in _reasons(_events(**drop))), _reasons(_events(**drop))


def test_a_stand_in_plugin_and_a_forged_junit_are_red():
    forged = [dict(e, plugin_file="/tree/flaloop_gate_plugin.py") if e["event"] == "guard-ready" else e
              for e in _events()]
    assert any("not flaloop's" in m for m, _ in _reasons(forged))
    failed = _reasons(_events(), outcomes={ID: "failed"})
    assert any("JUnit's outcomes disagree" in m for m, _ in failed), failed


def test_a_change_reported_by_the_plugin_names_route_what_and_file():
    evs = _events()
    evs[4] = dict(evs[4], changes=[{"route": "rebind", "what": "minifla.utils.assert_close",
                                    "origin": "minifla/ops/x.py", "setter": None}])
    (message, detail), = _reasons(evs)
    assert "(rebind)" in message and "minifla.utils.assert_close" in message and "minifla/ops/x.py" in message
    assert ID in detail


def test_a_change_the_bases_own_process_makes_too_is_inherited_and_only_that_one():
    """On the H200 an honest FLA base read red: pytest-mock rebinds unittest.mock's asserts, hypothesis'
    plugin rebinds pytest's fixture marker, FLA deletes a helper after use. The base's own run of the
    file makes the same changes, and the gate holds against the candidate only what the base did not."""
    from flaloop.task import gate_integrity

    site = "/venv/lib/python3.12/site-packages/pytest_mock/plugin.py"
    env_change = {"route": "rebind", "what": "unittest.mock.NonCallableMock.assert_called", "origin": site}
    base_module = {"route": "frozen-code", "what": "fla/utils/__init__.py: _register_aliases deleted", "origin": ""}
    base_run = {"changes": [env_change, dict(base_module, origin="/wt/base/fla/utils/__init__.py")]}
    base_keys = gate_integrity.keys(base_run, ("/wt/base",))
    cand_own = {"route": "rebind", "what": "unittest.mock.NonCallableMock.assert_called", "origin": "minifla/ops/x.py"}
    evs = _events()
    evs[2] = dict(evs[2], changes=[env_change, dict(base_module, origin="/home/u/fla/fla/utils/__init__.py"), cand_own])
    found = gate_integrity.reasons(gate_integrity.collect(evs, PLUGIN), {ID: "passed"},
                                   {"tests.ops.test_x::test_a[1]": "passed"}, 0, base_keys, ("/home/u/fla",))
    # the same judge rebound from the candidate's file is still the candidate's doing
    assert [m for m, _ in found] == [
        "the test process was tampered with (rebind): unittest.mock.NonCallableMock.assert_called by minifla/ops/x.py"]
    # without the base's record every change is held against the candidate
    assert len(_reasons(evs)) == 3


# In the test's process, the checks' own module: annotations a library reads on a class after the
# snapshot, and a method planted over a base class's, on the MRO the H200 showed.
ANNOTATIONS_READ = """
import collections.abc, json, sys, importlib.util
sys.path.insert(0, sys.argv[1].rpartition("/")[0])  # its sibling flaloop_gate_frozen, as the plugin loads it
spec = importlib.util.spec_from_file_location("flaloop_gate_integrity", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
collections.abc.Iterable.__annotations__  # read before the snapshot: Iterable holds one
guard = mod.Integrity(sys.argv[2], [])
guard.snapshot_libraries()
guard._take_class(collections.abc.Sequence)  # Sized before Iterable in its MRO
out = {}
collections.abc.Sized.__annotations__  # read after it: the interpreter adds an empty dict to Sized
out["read"] = [c["what"] for c in guard.check()]
collections.abc.Sized.__iter__ = lambda self: iter(())  # a method over Iterable's
out["planted"] = [c["what"] for c in guard.check()]
print(json.dumps(out))
"""


def test_annotations_a_library_reads_are_no_change_but_a_method_over_a_base_class_is(tmp_path):
    """On the H200 an unchanged FLA tree read red: a library read collections.abc.Sized's
    annotations during the run, which makes the interpreter add an empty `__annotations__` to the
    class, over its later base Iterable's. That is no change; a method planted the same way is one."""
    import json
    import subprocess
    import sys

    from flaloop import inside

    r = subprocess.run([sys.executable, "-c", ANNOTATIONS_READ, str(inside.script("flaloop_gate_integrity.py")),
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["read"] == [], got
    assert got["planted"] == ["collections.abc.Sized.__iter__ (over its base class's)"], got


def test_the_bases_collect_only_run_records_its_own_in_memory_changes(minifla):
    _reset(minifla)
    result = run(minifla)
    assert result.green, [f.message for f in result.findings]
    import json

    cached = [json.loads(p.read_text()) for p in (minifla / "profile").rglob("baseline-*.json")]
    assert cached and all(isinstance(c.get("integrity_changes"), list) for c in cached)


# An honest base that installs a wrapper of its own at the op's first call: a collection never calls
# the op, so only the base's full run can show that the change is the base's.
BASE_OWN_WRAPPER = """
    import functools, torch
    orig = torch.Tensor.item
    torch.Tensor.item = functools.wraps(orig)(lambda self: orig(self))
"""


def test_a_change_the_base_makes_only_while_its_tests_run_is_the_bases_and_a_new_one_still_red(prepared_repo, tmp_path):
    import json

    repo = tmp_path / "minifla"
    shutil.copytree(prepared_repo, repo, symlinks=True)
    plant(repo, "first_call", BASE_OWN_WRAPPER, wrong=False)
    git(repo, "commit", "-qam", "the base wraps Tensor.item at the op's first call")
    contract = repo / "profile" / f"{OP}-opt" / "contract.json"
    doc = json.loads(contract.read_text())
    doc["base_commit"] = git(repo, "rev-parse", "HEAD").strip()
    contract.write_text(json.dumps(doc, indent=2))

    # an honest change on that base: green, and the base ran whole once to say so
    edit(repo / CHUNK, "    BV = min(64, block_size(V))\n", "    BV = min(64, block_size(V))  # tiles of V\n")
    result = run(repo)
    assert result.green, [f.message for f in result.findings]
    assert result.baseline["kind"] == "full" and result.baseline["integrity_changes"]
    # a change of the candidate's own beside the base's: red, and only the candidate's is named
    edit(repo / CHUNK, "        _tune()\n", "        _tune()\n        _lenient()\n")
    (repo / CHUNK).write_text((repo / CHUNK).read_text() + "\n\ndef _lenient():\n"
                              + textwrap.indent(code(LENIENT_TEST_GLOBAL), "    ") + "\n")
    edit(repo / CHUNK, *WRONG)
    result = run(repo)
    found = tampered(result)
    assert found and all("assert_close" in m for m in found) and not any("item" in m for m in found), found


def test_a_test_process_forked_from_a_warm_server_judges_as_a_fresh_one(minifla, tmp_path, monkeypatch):
    """The gate's pytest forks from the op's fork server (a bench's, or one the gate starts when
    none is warm), where a fresh interpreter would import the same: the same plant is red with the
    same findings either way, an untouched tree green; a directory on the test's path that shadows
    a module the server holds, or the package under test among them, keeps the test process fresh."""
    from flaloop.bench import forkservers
    from flaloop.task import gate as gate_mod
    from flaloop.task.gate import warm_preload
    from flaloop.task.pytest_run import clean_env, warm_server

    target = Target.discover(minifla)
    contract = Contract.load(target, OP)
    env, preload = clean_env(target.extra_strip_env())[0], warm_preload(target, contract)
    plant(minifla, "first_call", LENIENT_TEST_GLOBAL)
    with monkeypatch.context() as m:  # no module list to look for: a fresh interpreter
        m.setattr(gate_mod, "warm_preload", lambda *a: None)
        fresh = run(minifla, k=None)
    assert not fresh.run.forked and any("assert_close" in m for m in tampered(fresh)), fresh.findings
    assert fresh.run.fresh_why == "no preload list was given"

    forkservers.stop_all()  # this worker's servers: the gate below finds none warm and starts one
    forked = run(minifla, k=None)
    assert forked.run.forked and forked.run.fresh_why == ""
    server = forkservers.ForkServer.connect(target.python, env, preload, wait=False)
    assert server is not None, "the gate left no fork server warm"
    tops = server.ready["tops"]
    server.close()
    assert {"torch", "triton"} <= set(tops) and "minifla" not in tops
    assert "# forked by the warm fork server" in Path(forked.log_path).read_text()
    assert [(f.kind, f.message) for f in forked.findings] == [(f.kind, f.message) for f in fresh.findings]
    assert (forked.run.passed, forked.run.failed, forked.run.selected) == \
        (fresh.run.passed, fresh.run.failed, fresh.run.selected)
    _reset(minifla)
    clean = run(minifla, k=None)
    assert clean.run.forked and clean.green, [(f.kind, f.message) for f in clean.findings]

    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("")
    kept, why = warm_server(target.python, env, preload, "minifla", [tmp_path])
    assert kept is None and f"{tmp_path}/triton would stand in" in why
    kept, why = warm_server(target.python, env, preload, "torch", [])
    assert kept is None and "imported torch, the package under test" in why
    kept, why = warm_server(target.python, env, preload, "minifla", [tmp_path / "triton"])
    assert kept is not None and why == ""
    kept.close()
