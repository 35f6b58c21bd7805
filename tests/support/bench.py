"""`flaloop bench` as the bench tests call it: one round, a few pairs, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

from support.cli import flaloop

# One round: these tests are about what a bench does with a cell, not about rounds (tests/e2e/test_tuning_rounds.py).
# the unseen-shapes check is off here (it has its own tests, tests/e2e/test_unseen.py): the suite's time
QUICK = ["--device", "cpu", "--min-pairs", "6", "--max-pairs", "8", "--cell-seconds", "30", "--rounds", "1",
         "--unseen-shapes", "0"]


def bench(repo: Path, *args: str, op: str = "toy_attn", env: dict | None = None):
    r = flaloop(repo, "bench", op, "--json", *QUICK, *args, env=env)
    return r, (json.loads(r.stdout) if r.stdout.strip() else {})
