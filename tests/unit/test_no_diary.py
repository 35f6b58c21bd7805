"""The package and the tests speak of the code, not of how it was built: no comment justifies code by a
work session ("the seventh ..."), and none cites a section of docs/BENCHMARKS.md by its position;
a claim is cited by the file that holds it (docs/BENCHMARKS.md's tables, docs/lab/<date>-<topic>.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEN = ["this", "that", "last", "previous", "next", "earlier", "later", "same", "current", "prior", "first", "second",
        "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth", "eleventh", "twelfth",
        r"\d+(?:st|nd|rd|th)"]
# the word is split so that this file never matches its own pattern
DIARY = re.compile(r"\b(?:" + "|".join(WHEN) + r")(?:\s+and\s+\w+)?\s+(?:work\s+)?sess" + r"ions?\b"
                   r"|\bfound\s+last\s+ti" + r"me\b|\bBENCHMARKS\.md," + r" ", re.IGNORECASE)
# a pytest or process session is the code's own word: "its own session", "a test session"
ALLOWED = re.compile(r"\b(?:this|same|current|first|that)\s+(?:test|pytest|process|Ray|MCP|ssh|login|worker)\s+sess",
                     re.IGNORECASE)


def hits(text: str) -> list[str]:
    return [m.group(0) for m in DIARY.finditer(text) if not ALLOWED.search(text[max(0, m.start() - 20):m.end()])]


def test_the_pattern_finds_a_diary_line_and_passes_the_codes_own_words():
    diary = "# the sev" + "enth sess" + "ion found this; " + "eighth and ninth sess" + "ions; see BENCHMARKS.md" + ", R3"
    assert len(hits(diary)) == 3
    assert hits("its own session (setsid); a pytest session; the Session class; this test session") == []


def test_no_diary_words_in_the_package_or_the_tests():
    found = []
    for base in ("flaloop", "tests"):
        for path in sorted((ROOT / base).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for h in hits(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {h!r}")
    assert not found, "lines that tell how the code was built, not why it is so:\n" + "\n".join(found)
