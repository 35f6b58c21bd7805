#!/usr/bin/env python3
"""The pull-request check of flaloop for a CI job: sweep the ops a pull request touches, and write the
comment to post.

    python pr_check.py EVENT_JSON OUT_DIR [--repo PATH] [-- SWEEP_OPTIONS ...]

EVENT_JSON is the `pull_request` event's payload (`$GITHUB_EVENT_PATH` on GitHub Actions): its
`pull_request.base.sha` is the base, its `pull_request.head.sha` must be checked out in the repository
(`--repo`, default `$GITHUB_WORKSPACE` or the current directory). It runs

    flaloop sweep --ops changed --base BASE_SHA --fail-on slower --json SWEEP_OPTIONS
    flaloop report --sweep SWEEP_DIR --format github --out OUT_DIR

and leaves in OUT_DIR: `comment.md` (the comment, with the `<!-- flaloop-report -->` marker the
workflow finds its own comment by), `sweep.json` (the sweep's JSON), `sweep.log` (its stderr) and
`exit_code`; it exits with the sweep's code (0 nothing slower or blocked, 1 an op SLOWER or blocked,
2 a usage error, 3 a measurement failed). `$FLALOOP` overrides the command (default:
`python -m flaloop` of this interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

MARKER = "<!-- flaloop-report -->"


def flaloop_cmd() -> list[str]:
    return shlex.split(os.environ["FLALOOP"]) if os.environ.get("FLALOOP") else [sys.executable, "-m", "flaloop"]


def git(repo: Path, *args: str) -> str | None:
    p = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def shas(event: dict) -> tuple[str, str, int | None]:
    pr = event.get("pull_request") or {}
    try:
        return pr["base"]["sha"], pr["head"]["sha"], pr.get("number") or event.get("number")
    except (KeyError, TypeError):
        raise SystemExit("the event has no pull_request.base.sha / pull_request.head.sha: is it a pull_request event?") from None


def finish(out: Path, comment: str, code: int) -> int:
    (out / "comment.md").write_text(comment)
    (out / "exit_code").write_text(f"{code}\n")
    print(f"comment: {out / 'comment.md'}; exit {code}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("event", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--repo", type=Path, default=Path(os.environ.get("GITHUB_WORKSPACE") or "."))
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out, repo = args.out.resolve(), args.repo.resolve()
    out.mkdir(parents=True, exist_ok=True)
    base, head, number = shas(json.loads(args.event.read_text()))
    title = f"### flaloop: pull request #{number}" if number else "### flaloop"
    at = git(repo, "rev-parse", "HEAD")
    if at != head:
        return finish(out, f"{MARKER}\n{title}\n\nNot checked: the checkout is at `{at}`, not the pull request's head "
                           f"`{head}` (check out `pull_request.head.sha`).\n", 2)
    if git(repo, "cat-file", "-e", f"{base}^{{commit}}") is None:
        return finish(out, f"{MARKER}\n{title}\n\nNot checked: the base `{base}` is not in the clone (check out with "
                           "full history: `fetch-depth: 0`).\n", 2)
    cmd = [*flaloop_cmd(), "sweep", "--ops", "changed", "--base", base, "--repo", str(repo), "--fail-on", "slower",
           "--json", *extra]
    print("$ " + shlex.join(cmd), file=sys.stderr)
    p = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    (out / "sweep.log").write_text(p.stderr)
    (out / "sweep.json").write_text(p.stdout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {"ok": False, "error": f"flaloop sweep printed no JSON (exit {p.returncode})", "hint": p.stderr[-800:]}
    if not doc.get("ok"):
        return finish(out, f"{MARKER}\n{title}\n\nThe check could not run: {doc.get('error')}\n\n"
                           f"```\n{doc.get('hint') or ''}\n```\n", p.returncode or 2)
    if not doc.get("candidates") or not doc.get("path"):
        return finish(out, f"{MARKER}\n{title}\n\nThe change against `{base[:12]}` touches no op's code: nothing was "
                           "measured.\n", p.returncode)
    rep = subprocess.run([*flaloop_cmd(), "report", "--sweep", str(Path(doc["path"]).parent), "--format", "github",
                          "--out", str(out)], cwd=repo, capture_output=True, text=True)
    if rep.returncode != 0 or not (out / "comment.md").is_file():
        return finish(out, f"{MARKER}\n{title}\n\nThe sweep ran (exit {p.returncode}) but its report failed:\n\n"
                           f"```\n{rep.stderr[-800:]}\n```\n", p.returncode or 2)
    comment = (out / "comment.md").read_text()
    comment += f"\n_Pull request head `{head[:12]}` against base `{base[:12]}`; exit {p.returncode}._\n"
    return finish(out, comment, p.returncode)


if __name__ == "__main__":
    sys.exit(main())
