"""The static rules over the diff: what the candidate adds relative to the base, never what it had.

For every changed file (flaloop.guard.audit finds them) this module decides what the file is
to the op, runs the rules of guard/rules/ on the base and on the candidate version, and keeps
the hits the candidate adds:

- *op code*: files of the op's package and any repo module the package imports. All rules run.
- *bench code*: the registry and the repo modules it imports (the bench worker imports them in
  the candidate's process). The rules about the process (patches, environment, threads...) run.
- anything else (a new script, a doc) is not loaded by the gate or the bench: listed, not judged.
- frozen files are the gate's business (any edit turns it red): listed, not judged twice.

"Adds" is counted per file and per function: a hit key (e.g. `cast:torch.bfloat16`) fires when
the candidate has more of it than the base in the file, or in a function both versions define;
the occurrences reported are those on added or changed lines. So code the base already had
never fires, and neither does moving it into a new function.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package
    import tomli as tomllib

from flaloop.core import git
from flaloop.guard.catalogue import finding
from flaloop.guard.findings import Finding
from flaloop.guard.rules import run_checks
from flaloop.guard.rules.check import FileContext, Hit
from flaloop.guard.rules.delegation import has_own_kernels
from flaloop.guard.rules.files import file_findings
from flaloop.guard.source import Source, changed_lines, module_name

TENSOR_NAMES = frozenset({"x", "t", "q", "k", "v", "o", "g", "w", "u", "beta", "do", "dq", "dk", "dv", "h0", "ht",
                          "initial_state", "cu_seqlens", "input", "inputs", "tensor", "out", "output", "A", "a"})


@dataclass(frozen=True)
class Change:
    path: str    # repo-relative, posix
    status: str  # added, modified, deleted, untracked, ignored
    base_path: str | None = None  # where the file was at the base, when git saw it move (else path)


@dataclass
class StaticResult:
    findings: list[Finding] = field(default_factory=list)
    analysed: list[str] = field(default_factory=list)     # Python files the rules read
    not_loaded: list[str] = field(default_factory=list)   # changed, but neither the op, the gate nor the bench imports them
    frozen: list[str] = field(default_factory=list)       # changed frozen files (the gate turns red on them)


class Resolver:
    """Repo-local modules of the candidate tree: which file defines a module or a name, and who imports it."""

    def __init__(self, root: Path, import_root: str = ""):
        self.root = root
        self.prefix = f"{import_root}/" if import_root else ""  # "src/" for a src layout
        self._sources: dict[str, Source | None] = {}
        self._files: dict[str, str | None] = {}

    def modname(self, rel: str) -> str:
        return module_name(rel[len(self.prefix):] if rel.startswith(self.prefix) else rel)

    def source(self, rel: str) -> Source | None:
        if rel not in self._sources:
            p = self.root / rel
            try:
                self._sources[rel] = Source(rel, p.read_text(errors="replace"), self.modname(rel)) \
                    if p.is_file() else None
            except OSError:
                self._sources[rel] = None
        return self._sources[rel]

    def file_of(self, mod: str) -> str | None:
        """The repo-relative file of module `mod` in the candidate tree, or None."""
        if mod not in self._files:
            base = self.prefix + mod.replace(".", "/")
            found = None
            for rel in (f"{base}.py", f"{base}/__init__.py"):
                if mod and (self.root / rel).is_file():
                    found = rel
                    break
            self._files[mod] = found
        return self._files[mod]

    def resolve(self, mod: str, name: str | None = None, depth: int = 0) -> str | None:
        """The file that defines `mod.name` (following re-exports like `from .x import name`), or `mod`'s file."""
        if name and (sub := self.file_of(f"{mod}.{name}")):
            return sub
        f = self.file_of(mod)
        if not f or not name or depth > 5:
            return f
        src = self.source(f)
        for node in src.walk() if src else []:
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name and (m := src.resolve_from(node)):
                        return self.resolve(m, a.name, depth + 1) or f
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname == name:
                        return self.file_of(a.name) or f
        return f

    def imported_by(self, module: str, files: list[str]) -> bool:
        """Whether any of `files` imports `module` (a text scan: cheap over a whole package, and it
        over-approximates, which is the safe side for deciding what runs)."""
        pattern = re.compile(rf"^\s*(from\s+{re.escape(module)}[\s.]|import\s[^#\n]*\b{re.escape(module)}\b)", re.M)
        for rel in files:
            try:
                if pattern.search((self.root / rel).read_text(errors="replace")):
                    return True
            except OSError:
                continue
        return False


def shape_literals(root: Path, base_commit: str, test_file: str, registry: str | None,
                   shapes: list[str]) -> frozenset[int]:
    """Integers the gate's tests or the bench's shape configs use (0 and 1 left out: too common)."""
    ints: set[int] = set()
    blob = git.file_at(root, base_commit, test_file)
    if blob:
        try:
            ints |= {n.value for n in ast.walk(ast.parse(blob.decode(errors="replace")))
                     if isinstance(n, ast.Constant) and type(n.value) is int}
        except SyntaxError:
            pass
    texts = [git.file_at(root, base_commit, registry)] if registry else []
    if registry and (root / registry).is_file():
        texts.append((root / registry).read_bytes())
    for blob in texts:
        try:
            tree = ast.parse((blob or b"").decode(errors="replace"))
        except SyntaxError:
            continue
        for d in ast.walk(tree):  # {'B': 8, 'T': 1024, ...}
            if isinstance(d, ast.Dict) and d.keys and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, str) and re.fullmatch(r"[A-Z]{1,2}", k.value)
                    for k in d.keys):
                ints |= {v.value for v in d.values if isinstance(v, ast.Constant) and type(v.value) is int}
    for s in shapes:
        ints |= {int(x) for x in re.findall(r"[A-Za-z]+(\d+)", s)}
    ints |= declared_shape_ints(git.file_at(root, base_commit, "flaloop.toml"))
    return frozenset(i for i in ints if i > 1)


def declared_shape_ints(blob: bytes | None) -> set[int]:
    """The sizes of the named shapes ops declare in flaloop.toml (their [ops.NAME.shapes])."""
    try:
        doc = tomllib.loads(blob.decode()) if blob else {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return set()
    ints: set[int] = set()
    for entry in (doc.get("ops") or {}).values():
        shapes = entry.get("shapes") if isinstance(entry, dict) else None
        for dims in (shapes.values() if isinstance(shapes, dict) else ()):
            for v in (dims.values() if isinstance(dims, dict) else ()):
                ints |= {x for x in (v if isinstance(v, list) else [v]) if type(x) is int}
    return ints


def added_hits(base: Source, cand: Source, base_hits: list[Hit], cand_hits: list[Hit]) -> list[Hit]:
    """The candidate's hits beyond the base's, per file and per function both define (see the module doc)."""
    fresh_lines = changed_lines(base.text, cand.text)
    common = base.scopes() & cand.scopes()
    base_file = Counter((h.rule, h.key) for h in base_hits)
    base_scope = Counter((h.rule, h.key, base.qualname(h.node)) for h in base_hits)
    groups: dict[tuple[str, str], list[Hit]] = {}
    for h in cand_hits:
        groups.setdefault((h.rule, h.key), []).append(h)
    out: list[Hit] = []
    for key, hits in groups.items():
        cand_scope = Counter(cand.qualname(h.node) for h in hits)
        excess = max(len(hits) - base_file[key],
                     sum(max(0, n - base_scope[(*key, s)]) for s, n in cand_scope.items() if s in common))
        if excess <= 0:
            continue
        fresh = [h for h in hits if any(ln in fresh_lines for ln in range(h.line, h.end_line + 1))]
        if len(fresh) < excess:  # edited in place on lines difflib matched: report the last ones
            fresh += [h for h in hits if h not in fresh][-(excess - len(fresh)):]
        out.extend(fresh)
    return out


@dataclass
class _Scope:
    """What the rules need to know about the op, computed once per audit."""
    root: Path
    base_commit: str
    package: str
    package_dir: str  # repo-relative: "fla", or "src/fla" in a src layout
    op_dir: str
    registry: str | None
    frozen: dict[str, str]
    shape_literals: frozenset[int]
    tensor_names: frozenset[str]
    resolver: Resolver
    _op_kernels: bool | None = None
    _package_files: list[str] | None = None

    def op_had_kernels(self) -> bool:
        """Whether the op's directory had kernels of its own at the base (in any language the guard knows)."""
        if self._op_kernels is None:
            self._op_kernels = False
            for rel in git.files_at(self.root, self.base_commit, self.op_dir or "."):
                if rel.endswith(".py") and (blob := git.file_at(self.root, self.base_commit, rel)):
                    if has_own_kernels(Source(rel, blob.decode(errors="replace"))):
                        self._op_kernels = True
                        break
        return self._op_kernels

    def role(self, path: str) -> str | None:
        """"op" for code the op runs, "bench" for code only the bench worker imports, None for neither.

        Every file of the target package counts as the op's (FLA's package __init__ imports all of
        it); a repo module outside the package counts when the package (or the registry) imports it.
        """
        if self.in_package(path):
            return "op"
        mod = self.resolver.modname(path)
        if self._package_files is None:
            pkg = self.root / self.package_dir
            self._package_files = [str(p.relative_to(self.root)) for p in pkg.rglob("*.py")] if pkg.is_dir() else []
        if self.resolver.imported_by(mod, self._package_files):
            return "op"
        if self.registry and (path == self.registry or self.resolver.imported_by(mod, [self.registry])):
            return "bench"
        return None

    def in_package(self, path: str) -> bool:
        return path.startswith(self.package_dir + "/")

    def in_op_dir(self, path: str) -> bool:
        return path.startswith(self.op_dir + "/") if self.op_dir else True

    def context(self, path: str, op_code: bool, base: Source | None) -> FileContext:
        return FileContext(
            path=path, op_code=op_code,
            kernel_base=(base is not None and base.tree is not None and has_own_kernels(base))
            or self.op_had_kernels(),
            shape_literals=self.shape_literals, tensor_names=self.tensor_names, package=self.package,
            resolve=self.resolver.resolve, frozen=self.frozen,
            references=self.references())

    def references(self) -> dict[str, str]:
        """Frozen files the test compares the op against: the naive reference, the test machinery, and
        modules of the op's own directory the test imports (FLA's chunk tests use the fused_recurrent
        kernel beside them). Shared helpers the test also imports (`fla.utils`) are not references."""
        out = {}
        for p, r in self.frozen.items():
            if r.startswith(("naive reference", "gate test file", "pytest conftest")) or (
                    r.startswith("imported by the test") and self.in_op_dir(p) and not p.endswith("__init__.py")):
                out[p] = r
        return out


def run_static(root: Path, base_commit: str, contract, changes: list[Change],
               registry: str | None = None) -> StaticResult:
    """Every rule over `changes` (working tree vs `base_commit`), for the op of `contract`."""
    result = StaticResult()
    params = {p["name"] for p in contract.parameters if p.get("default") in (None, "None")}
    entry = PurePosixPath(contract.entry_file)
    op_dir = str(entry.parent)
    package = contract.import_path.split(".")[0]
    # the package's directory is the entry file's outermost ancestor named like the package
    package_dir = next((p for p in reversed(entry.parents) if p.name == package), PurePosixPath(package))
    import_root = "" if str(package_dir.parent) == "." else str(package_dir.parent)
    scope = _Scope(root=root, base_commit=base_commit, package=package, package_dir=str(package_dir),
                   op_dir="" if op_dir == "." else op_dir, registry=registry,
                   frozen={f.path: f.reason for f in contract.frozen},
                   shape_literals=shape_literals(root, base_commit, contract.test_file, registry, contract.shapes),
                   tensor_names=TENSOR_NAMES | params, resolver=Resolver(root, import_root))
    for ch in sorted(changes, key=lambda c: c.path):
        if ch.status == "deleted":
            continue
        frozen = ch.path in scope.frozen
        if frozen:
            result.frozen.append(ch.path)
        base_blob = git.file_at(root, base_commit, ch.base_path or ch.path) if ch.status == "modified" else None
        base_text = base_blob.decode(errors="replace") if base_blob is not None else None
        cand_path = root / ch.path
        try:
            cand_text = cand_path.read_text(errors="replace") if cand_path.is_file() else None
        except OSError:
            cand_text = None
        as_file = file_findings(ch.path, ch.status, base_text, cand_text, lambda rel: (root / rel).is_file(), frozen)
        result.findings += as_file
        if frozen or not ch.path.endswith(".py") or cand_text is None:
            continue
        role = scope.role(ch.path)
        if role is None:
            if not as_file:  # a new conftest.py is judged as a file, not listed as harmless
                result.not_loaded.append(ch.path)
            continue
        result.analysed.append(ch.path)
        if not scope.in_op_dir(ch.path):
            who = "the op" if role == "op" else "the bench's registry"
            result.findings.append(finding("outside-op", f"{ch.path} changes outside the op's directory "
                                                         f"{scope.op_dir}/, and {who} runs it", file=ch.path))
        op_code = role == "op"
        result.findings += analyse_file(ch.path, base_text, cand_text, scope, op_code)
    result.findings = _dedupe(result.findings)
    return result


def analyse_file(path: str, base_text: str | None, cand_text: str, scope: _Scope, op_code: bool) -> list[Finding]:
    modname = scope.resolver.modname(path)
    cand = Source(path, cand_text, modname)
    if cand.tree is None:
        return [finding("not-analysed", f"{path} does not parse ({cand.error}): the static rules cannot read it",
                        file=path)]
    base = Source(path, base_text or "", modname)
    if base.tree is None:
        base = Source(path, "", modname)
    ctx = scope.context(path, op_code, base if base_text is not None else None)
    hits = added_hits(base, cand, run_checks(base, ctx), run_checks(cand, ctx))
    return [finding(h.rule, h.message, file=path, line=h.line, severity=h.severity) for h in hits]


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen: set[tuple] = set()
    out = []
    for f in sorted(findings, key=lambda f: (f.file or "", f.line or 0, f.rule)):
        key = (f.rule, f.file, f.line)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
