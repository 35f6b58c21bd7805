"""A file the code or the docs send a reader to exists: every `tests/...py`, `flaloop/...py` and
`benchmarks/...py` path named in the package's docstrings and comments, the benchmarks and the docs
(the dated lab notebook aside: it names files as they were then)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/.])((?:tests|flaloop|benchmarks)/[\w/]+\.py)\b")
# paths that name a user's repo or a built wheel, not this checkout
NOT_OURS = ("tests/test_my_op.py", "flaloop/_example/", "tests/ops/", "benchmarks/ops/")  # FLA's layout


def named_paths() -> list[tuple[str, str]]:
    sources = [*sorted((ROOT / "flaloop").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
               ROOT / "README.md", ROOT / "SKILL.md", *sorted((ROOT / "docs").glob("*.md"))]
    out = []
    for src in sources:
        for m in PATH.finditer(src.read_text(encoding="utf-8", errors="replace")):
            out.append((str(src.relative_to(ROOT)), m.group(1)))
    return out


def test_every_named_file_exists():
    found = named_paths()
    assert len(found) > 20  # the pattern reads the paths the docs name
    missing = sorted({f"{src}: {path}" for src, path in found
                      if not path.startswith(NOT_OURS) and not (ROOT / path).exists()})
    assert not missing, "files named but not there (moved or renamed?):\n" + "\n".join(missing)
