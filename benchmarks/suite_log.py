"""Where the test suite's wall goes: each test's start and end per xdist worker, and a summary.

As a pytest plugin, it writes one JSON line per test start and end to
$SUITE_LOG_DIR/<worker>.jsonl (the worker's id, `main` without xdist):

    SUITE_LOG_DIR=/tmp/suite TRITON_INTERPRET=1 PYTHONPATH=benchmarks \\
        .venv/bin/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder -p suite_log tests

As a script, it reads such a directory and prints, per worker, when it ended and each module's
span, then each module's summed test time, longest first (what tests/conftest.py's LONGEST_FIRST
is drawn from), and the tests that took longest:

    python benchmarks/suite_log.py /tmp/suite [--modules 30] [--tests 15] [--json]

A test's time is from its start to its end, set-up and teardown included. The log holds wall
times only: what a test waited for and what it computed needs a CPU log beside it
(docs/lab/2026-12-04-cpu.md, R26).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

# -- the plugin ------------------------------------------------------------------------------------

_out = None


def _write(event: str, nodeid: str) -> None:
    global _out
    where = os.environ.get("SUITE_LOG_DIR")
    if not where:
        return
    if _out is None:
        Path(where).mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = open(Path(where) / f"{worker}.jsonl", "a")  # noqa: SIM115 - open for the worker's life
    _out.write(json.dumps({"ev": event, "id": nodeid, "t": time.time()}) + "\n")
    _out.flush()


def pytest_runtest_logstart(nodeid, location):
    _write("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _write("end", nodeid)


# -- the summary -----------------------------------------------------------------------------------

def summarize(log_dir: Path) -> dict:
    files = sorted(log_dir.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no <worker>.jsonl in {log_dir}: run pytest with -p suite_log and SUITE_LOG_DIR set")
    events = {f.stem: [json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files}
    events = {worker: evs for worker, evs in events.items() if evs}
    if not events:
        raise ValueError(f"the logs in {log_dir} hold no test: did pytest run any with -p suite_log?")
    t0 = min(e["t"] for evs in events.values() for e in evs)
    workers, tests, modules = {}, {}, defaultdict(float)
    for worker, evs in events.items():
        started, spans = {}, {}
        for e in evs:
            module = e["id"].split("::")[0]
            if e["ev"] == "start":
                started[e["id"]] = e["t"]
            elif e["id"] in started:
                took = e["t"] - started.pop(e["id"])
                tests[e["id"]] = took
                modules[module] += took
            first, last = spans.get(module, (e["t"], e["t"]))
            spans[module] = (min(first, e["t"]), max(last, e["t"]))
        workers[worker] = {"ended_s": round(max(e["t"] for e in evs) - t0, 1),
                           "modules": [{"module": m, "start_s": round(a - t0, 1), "end_s": round(b - t0, 1)}
                                       for m, (a, b) in sorted(spans.items(), key=lambda kv: kv[1][0])]}
    ends = [w["ended_s"] for w in workers.values()]
    return {"workers": workers, "end_gap_s": round(max(ends) - min(ends), 1),
            "sum_s": round(sum(tests.values()), 1),
            "modules": sorted(((m, round(s, 1)) for m, s in modules.items()), key=lambda kv: -kv[1]),
            "tests": sorted(((t, round(s, 1)) for t, s in tests.items()), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log_dir", type=Path)
    ap.add_argument("--modules", type=int, default=30, help="modules to list, longest first")
    ap.add_argument("--tests", type=int, default=15, help="tests to list, longest first")
    ap.add_argument("--json", action="store_true", help="the whole summary as one JSON document")
    args = ap.parse_args(argv)
    try:
        doc = summarize(args.log_dir)
    except (OSError, ValueError) as exc:
        print(f"suite_log: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"tests' summed time {doc['sum_s']} s; the workers ended {doc['end_gap_s']} s apart")
    for worker, w in sorted(doc["workers"].items()):
        print(f"{worker}: ended at {w['ended_s']} s")
        for m in w["modules"]:
            if m["end_s"] - m["start_s"] >= 5:
                print(f"  {m['start_s']:7.1f} {m['end_s']:7.1f}  {m['module']}")
    print("modules, summed test time:")
    for module, s in doc["modules"][:args.modules]:
        print(f"  {s:7.1f}  {module}")
    print("tests:")
    for test, s in doc["tests"][:args.tests]:
        print(f"  {s:7.1f}  {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
