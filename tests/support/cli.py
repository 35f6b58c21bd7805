"""flaloop run as a real subprocess, as a user or an agent runs it; each call checks that it left the
user's git state alone (support/userstate.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.userstate import assert_user_state_kept, user_state


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        return json.loads(self.stdout)


def flaloop(repo: Path, *args: str, env: dict | None = None, timeout: float = 600) -> Result:
    """Run the CLI as a real subprocess, and check that it left the user's git state alone."""
    # piped, as an agent or CI runs it: no terminal width leaks in from the shell (COLUMNS is the
    # user's, set only by the tests about widths)
    run_env = {**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": None, "LINES": None, **(env or {})}
    for k in [k for k, v in run_env.items() if v is None]:
        del run_env[k]
    target = Path(args[args.index("--repo") + 1]) if "--repo" in args else repo
    before = user_state(target)
    with subprocess.Popen([sys.executable, "-m", "flaloop", *args], cwd=repo, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=run_env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            raise
    assert_user_state_kept(target, before, args, proc.pid)
    return Result(proc.returncode, out, err)

