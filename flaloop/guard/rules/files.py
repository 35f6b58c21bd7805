"""Rules about whole files rather than code: shadow-module, test-harness, not-analysed (and driver-l2
tokens in native sources, which no Python AST covers)."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import PurePosixPath

from flaloop.guard.catalogue import finding
from flaloop.guard.findings import Finding
from flaloop.guard.rules.harness import l2_tokens
from flaloop.guard.source import changed_lines

# names whose shadowing replaces a dependency or the standard library (the tree is first on sys.path)
DEPENDENCIES = frozenset({"torch", "triton", "numpy", "scipy", "pytest", "_pytest", "pluggy", "einops", "transformers",
                          "flaloop", "flaloop_gate_plugin", "typing_extensions", "packaging", "setuptools",
                          "pkg_resources", "filelock", "jinja2", "sympy", "networkx", "fsspec", "nvidia", "cuda",
                          "cupy", "pycuda", "rich", "typer", "click", "yaml", "xdist", "tilelang", "cutlass"})
STARTUP_HOOKS = ("sitecustomize.py", "usercustomize.py")
NATIVE = frozenset({".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hip", ".pyx", ".pxd", ".mlir", ".ll",
                    ".ptx", ".s"})
BINARY = frozenset({".so", ".pyd", ".dylib", ".o", ".a", ".cubin", ".fatbin", ".hsaco"})
DOCS = frozenset({".md", ".rst", ".txt", ".png", ".jpg", ".svg", ".gitignore"})
PYTEST_SECTIONS = {"pytest.ini": r"^\[pytest\]", "tox.ini": r"^\[pytest\]", "setup.cfg": r"^\[tool:pytest\]",
                   "pyproject.toml": r"^\[tool\.pytest[^\]]*\]"}
EXT_SUFFIX = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(\.[A-Za-z0-9_-]+)?\.(so|pyd)$")


def _module_stem(p: PurePosixPath) -> str | None:
    """The module name a file provides to `import`: x.py, x/__init__.py, x.cpython-311-....so."""
    if p.name == "__init__.py":
        return p.parent.name or None
    if p.suffix == ".py":
        return p.stem
    m = EXT_SUFFIX.match(p.name)
    return m.group("name") if m else None


def shadowing(path: str, exists) -> str | None:
    """Why a newly added file shadows another module, or None. `exists(rel)` tells whether a file is there."""
    p = PurePosixPath(path)
    if p.name in STARTUP_HOOKS:
        return f"{p.name} runs at interpreter start-up"
    stem = _module_stem(p)
    if stem is None:
        return None
    top_level = len(p.parts) == 1 or (p.name == "__init__.py" and len(p.parts) == 2)
    if top_level and (stem in DEPENDENCIES or stem in sys.stdlib_module_names):
        return f"a top-level `{stem}` replaces the installed/standard `{stem}` for code run from the tree"
    here = p.parent.parent if p.name == "__init__.py" else p.parent
    if p.name != f"{stem}.py" and exists(str(here / f"{stem}.py")):
        what = "a package directory" if p.name == "__init__.py" else "a compiled extension"
        return f"{what} `{stem}` is imported instead of {here / (stem + '.py')}"
    return None


def _pytest_section(text: str, name: str) -> str:
    pattern = PYTEST_SECTIONS.get(name)
    if not pattern:
        return ""
    lines, out, inside = text.splitlines(), [], False
    for line in lines:
        if line.startswith("["):
            inside = bool(re.match(pattern, line))
        if inside:
            out.append(line)
    return "\n".join(out)


def _new_token_lines(base: str, cand: str) -> list[tuple[int, str]]:
    """(line, token) for L2/driver tokens the candidate adds over the base, on added or changed lines."""
    before = Counter(t for line in base.splitlines() for t in l2_tokens(line))
    cand_lines = cand.splitlines()
    after = Counter(t for line in cand_lines for t in l2_tokens(line))
    fresh = changed_lines(base, cand)
    return [(i, t) for i, line in enumerate(cand_lines, 1) for t in l2_tokens(line)
            if i in fresh and after[t] > before[t]]


def file_findings(path: str, status: str, base_text: str | None, cand_text: str | None, exists,
                  frozen: bool) -> list[Finding]:
    """Findings about a changed file as a file. `status`: added, modified, untracked or ignored."""
    out: list[Finding] = []
    p = PurePosixPath(path)
    new = status in ("added", "untracked", "ignored")
    if new and (why := shadowing(path, exists)):
        out.append(finding("shadow-module", f"new file {path}: {why}", file=path))
    if not frozen:
        if p.name == "conftest.py":
            out.append(finding("test-harness", f"{'new' if new else 'changed'} conftest.py: pytest loads it "
                                               "around the gate's test file", file=path))
        elif p.name in PYTEST_SECTIONS and cand_text is not None:
            before = _pytest_section(base_text or "", p.name)
            after = _pytest_section(cand_text, p.name)
            if after != before and (after or p.name == "pytest.ini"):
                out.append(finding("test-harness", f"{path}: pytest configuration {'added' if new else 'changed'}",
                                   file=path))
    if p.suffix in NATIVE and cand_text is not None:
        out.append(finding("not-analysed", f"{path}: native source, not analysed by the static rules", file=path))
        for line, tok in _new_token_lines(base_text or "", cand_text):
            out.append(finding("driver-l2", f"{path}: {tok} (L2 residency or device limits)", file=path, line=line))
    elif p.suffix in BINARY:
        out.append(finding("not-analysed", f"{path}: a binary, not analysed by the static rules", file=path))
    return out
