"""The gate's in-memory integrity, as the orchestrator judges it (pure; no torch, no pytest).

Inside the test process `inside/scripts/flaloop_gate_integrity.py` snapshots what the frozen test judges
and reports with before the tree's code runs, and `inside/scripts/flaloop_gate_plugin.py` sends every
change it finds as `guard-*` events. Code in that process can also silence or rewrite the channel,
so the orchestrator demands positive evidence: each pytest process says it is ready (from the
plugin file flaloop ships) and reports at the end, every test that has an outcome was checked,
and JUnit's outcomes agree with the plugin's. Anything missing is a `gate-tampered` reason too.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

ROUTES = {
    "rebind": "a name the test judges or reports with is another object",
    "code-swap": "a function's code, defaults or closure was replaced",
    "frozen-code": "a frozen module's function or class is not the code of its file",
    "frozen-value": "a frozen module's constant is not what its file says",
    "import-swap": "a name a frozen module imported is not the object it names",
    "sys-modules": "a frozen module's sys.modules entry was swapped",
    "report-hook": "a pytest hook or plugin was added or removed by the tree",
    "torch-mode": "a torch function/dispatch mode or a trace function was left in place",
    "test-item": "a collected test's function, parameters or fixture changed",
    "guard-error": "the integrity check itself failed",
    "channel": "the integrity check's reports are missing or disagree with JUnit",
}


def junit_outcomes(path: Path) -> dict[str, str]:
    """JUnit's outcome per `classname::name`: passed, failed, error or skipped."""
    out: dict[str, str] = {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return out
    for case in root.iter("testcase"):
        kind = "passed"
        for child, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if case.find(child) is not None:
                kind = word
                break
        out[f"{case.get('classname', '')}::{case.get('name', '')}"] = kind
    return out


def junit_id(nodeid: str) -> str:
    """pytest's junitxml name for a node id (classname::name)."""
    names = nodeid.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    return ".".join(names[:-1]) + "::" + names[-1]


def collect(events: list[dict], plugin_file: str) -> dict:
    """The run's integrity evidence from the plugin's events, compact."""
    ready = {e.get("pid"): [e.get("plugin_file"), e.get("integrity_file")] for e in events
             if e.get("event") == "guard-ready"}
    errors = [e["error"] for e in events if e.get("event") == "guard-ready" and e.get("error")]
    final = sorted({e.get("pid") for e in events if e.get("event") == "guard-final"})
    spoke = sorted({e.get("pid") for e in events if e.get("event") in ("collected", "finish")})
    tested = sorted({e["id"] for e in events if e.get("event") == "guard-test" and "id" in e})
    changes, seen = [], set()
    for e in events:
        for c in e.get("changes") or () if str(e.get("event", "")).startswith("guard-") else ():
            # the origin too: the candidate rebinding a name a plugin also rebinds is a change of its own
            key = (c.get("route"), c.get("what"), c.get("origin"))
            if key not in seen:
                seen.add(key)
                changes.append({**c, "stage": e["event"][len("guard-"):], "id": e.get("id")})
    checks = max([e.get("checks", 0) for e in events if str(e.get("event", "")).startswith("guard-")] or [0])
    return {"plugin_file": plugin_file, "ready": {str(k): v for k, v in ready.items()}, "final": final,
            "spoke": spoke, "tested": tested, "errors": errors, "changes": changes, "checks": checks}


def change_key(change: dict, trees: tuple[str, ...] = ()) -> str:
    """One change as the base and the candidate can both name it: route, what, and the replacing code's
    file, relative to its tree where it lies inside one (the base runs in a worktree, the candidate in
    the user's checkout)."""
    origin = str(change.get("origin") or "")
    for tree in trees:
        for root in {tree.rstrip(os.sep), os.path.realpath(tree).rstrip(os.sep)}:
            if root and origin.startswith(root + os.sep):
                origin = origin[len(root) + 1:]
                break
    return f"{change.get('route')}|{change.get('what')}|{origin}"


def keys(integrity: dict | None, trees: tuple[str, ...] = ()) -> list[str]:
    """The keys of every change a run saw (stored with the base's baseline)."""
    return sorted({change_key(c, trees) for c in (integrity or {}).get("changes", [])})


def unexplained(integrity: dict | None, base_keys: list[str] | None, trees: tuple[str, ...] = ()) -> list[dict]:
    """The changes a run saw that the base's recorded run of the same file did not make."""
    inherited = set(base_keys or ())
    return [c for c in (integrity or {}).get("changes", []) if change_key(c, trees) not in inherited]


def reasons(integrity: dict, outcomes: dict[str, str], junit: dict[str, str],
            exit_code: int | None, base_keys: list[str] | None = None,
            trees: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(message, detail) for each way the in-memory integrity was broken or went unverified. A change
    the base's own run of the same file made too (`base_keys`: installed pytest plugins rebinding
    unittest.mock's asserts, a base module deleting a helper after use, a decorator the base applies)
    is the environment's or the base's doing, never the candidate's."""
    out: list[tuple[str, str]] = []
    for c in unexplained(integrity, base_keys, trees):
        where = f" by {c['origin']}" if c.get("origin") else ""
        if c.get("setter") and c.get("setter") != c.get("origin"):
            where += f" (set from {c['setter']})"
        when = f" during {c['id']}" if c.get("id") else f" at {c.get('stage')}"
        out.append((f"the test process was tampered with ({c.get('route')}): {c.get('what')}{where}",
                    f"{ROUTES.get(c.get('route'), '')}; seen{when}. The frozen test must run with the "
                    "original judges and report through pytest's own path."))
    ready = integrity.get("ready", {})
    if not ready:
        out.append(("the gate plugin's integrity check never reported (channel): the plugin was not loaded, "
                    "or its events were silenced", "no guard-ready event from any pytest process"))
        return out
    errors = sorted({f for f in integrity.get("errors", []) if f})
    if errors:
        out.append(("the integrity check could not take its snapshot (guard-error)", "\n".join(errors)))
    plugin = integrity.get("plugin_file", "")
    want = [plugin, os.path.join(os.path.dirname(plugin), "flaloop_gate_integrity.py")]
    wrong = sorted({f or "(none)" for files in ready.values() for f, w in zip(files, want, strict=True)
                    if os.path.realpath(f or "") != os.path.realpath(w)})
    if wrong:
        out.append((f"the gate plugin was loaded from {wrong[0]}, not flaloop's (channel)",
                    "a module in the tree shadows flaloop's plugin"))
    missing_final = [p for p in ready if int(p) not in integrity.get("final", [])]
    if exit_code is not None and exit_code >= 0 and missing_final:
        out.append((f"{len(missing_final)} pytest process(es) never sent the integrity check's final report "
                    "(channel)", "pids " + ", ".join(missing_final)))
    unknown = [p for p in integrity.get("spoke", []) if str(p) not in ready]
    if unknown:
        out.append(("a pytest process reported without the integrity check ready (channel)",
                    "pids " + ", ".join(map(str, unknown))))
    tested = set(integrity.get("tested", []))
    unchecked = sorted(i for i in outcomes if i not in tested)
    if unchecked:
        out.append((f"{len(unchecked)} test(s) have an outcome but no integrity check (channel)",
                    "\n".join(unchecked[:30])))
    if junit and outcomes:
        forged = sorted(i for i, o in outcomes.items() if o == "failed" and junit.get(junit_id(i)) == "passed")
        if forged or len(junit) < len(outcomes):
            out.append(("JUnit's outcomes disagree with the gate plugin's (channel)",
                        "\n".join([f"{i}: plugin failed, JUnit passed" for i in forged[:30]]
                                  + [f"JUnit lists {len(junit)} cases, the plugin {len(outcomes)}"])))
    return out
