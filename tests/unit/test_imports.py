"""The package's shape, read with ast (nothing is imported): no import circle, no module loose
directly under flaloop/ or over 700 lines, and nothing under flaloop/inside/ that imports flaloop
(that code runs in the target's interpreter, by path, where flaloop may not be installed at all).

Every import counts: at module level, inside a function, under `if TYPE_CHECKING:`. A circle that
only a function-level import closes is still two modules that cannot be understood apart. An
import names the module it reads from (`from flaloop.guard.rules.check import Hit` is an edge to
`flaloop.guard.rules.check`, not to the package around it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flaloop"


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} of every module under `root`."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def imported(name: str, mods: dict) -> str | None:
    """The module of the package that an imported name lives in (the longest known prefix)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(mod: str, path: Path, is_pkg: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of everything `mod` imports, relative imports resolved; `from X import Y`
    is X.Y, the module X.Y where there is one, else a name in X (`imported` tells which)."""
    here = mod if is_pkg else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            out += [(f"{src}.{a.name}", node.lineno) for a in node.names]
    return out


def graph(root: Path) -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """The import graph of the package at `root` ({module: modules it imports}) and the line of
    each edge's first import."""
    mods = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    lines: dict[tuple[str, str], int] = {}
    for m, (path, is_pkg) in mods.items():
        for name, line in imports(m, path, is_pkg):
            target = imported(name, mods) if name.split(".")[0] == root.name else None
            if target and target != m:
                edges[m].add(target)
                lines.setdefault((m, target), line)
    return edges, lines


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def cycle_in(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One circle through a component's first module, as the modules along it (first repeated last)."""
    inside, start = set(comp), comp[0]
    paths = {start: [start]}
    todo = [start]
    while todo:  # breadth first: the shortest way back
        v = todo.pop(0)
        for w in sorted(edges[v] & inside):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return comp + [start]


def describe(comp: list[str], edges: dict[str, set[str]], lines: dict[tuple[str, str], int]) -> str:
    path = cycle_in(comp, edges)
    steps = " -> ".join(f"{a} (line {lines[(a, b)]})" for a, b in zip(path[:-1], path[1:], strict=True))
    return (f"import circle among {len(comp)} modules ({', '.join(comp)}): {steps} -> {path[-1]}; "
            "move what both need into a module of its own that neither imports back")


def circle_messages(root: Path) -> list[str]:
    edges, lines = graph(root)
    return [describe(c, edges, lines) for c in circles(edges)]


# -- the package ----------------------------------------------------------------------------------

def test_no_module_of_flaloop_imports_itself_round_a_circle():
    found = circle_messages(PACKAGE)
    assert not found, "\n".join(found)


def test_no_module_sits_loose_directly_under_flaloop():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, (f"modules directly under flaloop/: {', '.join(loose)}; each belongs to the package of "
                       "its concept (core, task, bench, guard, ...)")


def test_nothing_run_inside_the_targets_interpreter_imports_flaloop():
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
           for m, (path, is_pkg) in modules(PACKAGE).items() if m.startswith("flaloop.inside.")
           for name, line in imports(m, path, is_pkg)
           if name.split(".")[0] == "flaloop" and not name.startswith("flaloop.inside.")]
    assert not bad, ("code under flaloop/inside/ runs in the target's interpreter by path and may not import "
                     "flaloop:\n" + "\n".join(bad))


def test_no_module_of_flaloop_is_over_700_lines():
    long = sorted(f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > 700)
    assert not long, "modules over 700 lines (split each by concept):\n" + "\n".join(long)


def test_the_session_port_declares_every_member_its_phases_use():
    """bench/port.SessionPort is the session as warmup, sampling, replay and timed see it: each
    `s.<name>` they read is declared there, and `Session` has each member the port declares."""
    from flaloop.bench.port import SessionPort
    from flaloop.bench.session import Session

    declared = set(SessionPort.__annotations__) | {n for n in vars(SessionPort) if not n.startswith("_")}
    used: dict[str, set[str]] = {}
    for phase in ("warmup", "sampling", "replay", "timed"):
        tree = ast.parse((PACKAGE / "bench" / f"{phase}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "s":
                used.setdefault(node.attr, set()).add(phase)
    missing = {n: sorted(p) for n, p in used.items() if n not in declared}
    assert not missing, f"used by the session's phases but not declared in bench/port.SessionPort: {missing}"
    session_init = ast.parse((PACKAGE / "bench" / "session.py").read_text())
    assigned = {t.attr for node in ast.walk(session_init) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for t in ast.walk(t) if isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name) and t.value.id == "self"}
    absent = sorted(n for n in declared if not hasattr(Session, n) and n not in assigned)
    assert not absent, f"declared in bench/port.SessionPort but not on Session: {absent}"


# -- the check itself ----------------------------------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_planted_circle_is_named_with_the_modules_and_lines_that_close_it(tmp_path):
    root = _package(tmp_path, {
        "a/__init__.py": "",
        "a/one.py": "from pkg.a import two\n",
        "a/two.py": "import os\n\n\ndef later():\n    from ..b import three  # closes the circle, in a function\n",
        "b/__init__.py": "",
        "b/three.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a.one import x\n",
        "b/alone.py": "from pkg.a import one\n",
    })
    (msg,) = circle_messages(root)
    assert msg.startswith("import circle among 3 modules (pkg.a.one, pkg.a.two, pkg.b.three): ")
    assert "pkg.a.one (line 1) -> pkg.a.two (line 5) -> pkg.b.three (line 3) -> pkg.a.one" in msg
    with pytest.raises(AssertionError, match=r"pkg\.a\.two \(line 5\)"):
        found = circle_messages(root)
        assert not found, "\n".join(found)


def test_a_package_that_imports_its_own_modules_is_no_circle_unless_one_imports_it_back(tmp_path):
    root = _package(tmp_path, {
        "rules/__init__.py": "from pkg.rules import one\nfrom pkg.rules.check import Hit\n",
        "rules/check.py": "class Hit: ...\n",
        "rules/one.py": "from pkg.rules.check import Hit\n",
    })
    assert circle_messages(root) == []
    (root / "rules" / "one.py").write_text("from pkg.rules import Hit\n")
    (msg,) = circle_messages(root)
    assert "pkg.rules (line 1) -> pkg.rules.one (line 1) -> pkg.rules" in msg


def test_the_modules_the_suite_starts_first_exist():
    """tests/conftest.py orders the longest modules first by name: a renamed one would lose its place."""
    import conftest

    tests = Path(conftest.__file__).parent
    assert [m for m in conftest.LONGEST_FIRST if not (tests / m).is_file()] == []
