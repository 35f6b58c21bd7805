"""The task contract: `profile/<op>-opt/docs/draft.md` for people, `contract.json` for tools.

The frozen set is what the gate trusts and the candidate may not touch: the test file, every
conftest.py above it, the op's naive.py, the pytest configuration, and every module of the
target package that the test (or its conftest) imports, except the file that defines the op
under optimization. That last rule is what freezes FLA's `fused_recurrent_*` kernels when a
chunk test uses them as its reference, and the module that defines `assert_close`.
Hashes are taken of the files *at the base commit*.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flaloop import __version__, inside
from flaloop.bench import forkservers
from flaloop.bench.model import L2_MODES, L2_WORDS, MODES
from flaloop.core import clock, fsutil, git
from flaloop.core.errors import FlaloopError, UsageError
from flaloop.core.workspace import Workspace
from flaloop.task import opcalls
from flaloop.task.target import CONFIG_FILE, OpSpec, Target, argument_names, run_query

SCHEMA = 1
LANGS = ("triton", "gluon", "tilelang", "cute", "cuda", "torch")
PYTEST_CONFIGS = (("pytest.ini", None), ("pyproject.toml", "[tool.pytest"), ("tox.ini", "[pytest]"),
                  ("setup.cfg", "[tool:pytest]"))


@dataclass(frozen=True)
class FrozenFile:
    path: str  # relative to the repo root
    sha256: str
    reason: str


@dataclass
class Contract:
    op: str
    import_path: str
    func_name: str
    entry_file: str
    signature: str
    parameters: list[dict]
    base_ref: str
    base_commit: str
    test_file: str
    frozen: list[FrozenFile]
    target_speedup: float = 1.0
    shapes: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=lambda: list(MODES))
    langs: list[str] = field(default_factory=lambda: ["triton"])
    input_overrides: dict[str, str] = field(default_factory=dict)
    varlen: bool = False
    l2: str = "rotate"  # bench/model.L2_MODES: what the L2 holds as each timed call starts
    # justified exceptions to guard rules, each {"rule", "why", "added"}: `flaloop audit OP --allow RULE --why ...`
    allowed: list[dict] = field(default_factory=list)
    # The loop's iteration cap (flaloop iter refuses past it; `flaloop stop` decides then).
    max_iters: int = 20
    # The model the op is checked in (`flaloop model`): fields of modelcheck/spec.ModelSpec over the
    # mapping's entry for the op; {"off": true}: none. None: the mapping's entry, if any.
    model: dict | None = None
    created: str = ""
    flaloop_version: str = __version__
    schema: int = SCHEMA

    # -- persistence ------------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["model"] is None:  # a contract without a model check reads as it did before the field
            del d["model"]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> Contract:
        """A contract from its JSON; ValueError naming the first key that is missing or wrong."""
        check_contract(data)
        data = dict(data)
        data["frozen"] = [FrozenFile(**{k: f[k] for k in ("path", "sha256", "reason")}) for f in data["frozen"]]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @staticmethod
    def path(target: Target, op: str) -> Path:
        return target.workspace(op).contract

    @classmethod
    def load(cls, target: Target, op: str) -> Contract:
        path = cls.path(target, op)
        rel = path.relative_to(target.root)
        if not path.exists():
            raise no_contract(target, op)
        redo = (f"restore it, or write a new one with `flaloop init {op} --force --keep-base` (the loop goes on at its "
                f"base; `--new-loop --base REF` starts a new loop at another base)")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"{rel} is damaged (not readable JSON: {exc})", redo) from exc
        if isinstance(data, dict) and data.get("schema", SCHEMA) != SCHEMA:
            raise UsageError(f"{rel} has contract schema {data['schema']!r}; this flaloop "
                             f"({__version__}) reads schema {SCHEMA}",
                             f"use the flaloop that wrote it ({data.get('flaloop_version', '?')}), or {redo}")
        try:
            c = cls.from_dict(data)
        except ValueError as exc:
            raise UsageError(f"{rel} is damaged: {exc}", redo) from exc
        if c.op != op:
            raise UsageError(f"{rel} is the contract of {c.op!r}, not {op!r}", redo)
        git.require_commit(target.root, c.base_commit, f"the base commit of {rel} ({c.base_ref})")
        return c

    def allow(self, rule: str, why: str) -> dict:
        """Record a justified exception to a guard rule (replacing an earlier one for the same rule)."""
        entry = {"rule": rule, "why": why, "added": clock.now_iso()}
        self.allowed = [a for a in self.allowed if a.get("rule") != rule] + [entry]
        return entry

    def save(self, target: Target) -> Path:
        return fsutil.atomic_write_text(self.path(target, self.op), json.dumps(self.to_dict(), indent=2) + "\n")


_REQUIRED = ("op", "import_path", "func_name", "entry_file", "signature", "parameters", "base_ref", "base_commit",
             "test_file", "frozen")
# key -> (type(s) it must have, words for the message)
_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "op": (str, "a string"), "import_path": (str, "a string"), "func_name": (str, "a string"),
    "entry_file": (str, "a string"), "signature": (str, "a string"), "parameters": (list, "a list"),
    "base_ref": (str, "a string"), "base_commit": (str, "a string"), "test_file": (str, "a string"),
    "frozen": (list, "a list"), "target_speedup": ((int, float), "a number"), "shapes": (list, "a list"),
    "modes": (list, "a list"), "langs": (list, "a list"), "input_overrides": (dict, "an object"),
    "varlen": (bool, "true or false"), "l2": (str, "a string"), "created": (str, "a string"), "flaloop_version": (str, "a string"),
    "schema": (int, "an integer"), "model": (dict, "an object"),
}


def check_contract(data) -> None:
    """ValueError naming what is wrong with a contract's JSON (hand edits, truncation, old files)."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, found {type(data).__name__}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"it lacks {', '.join(missing)}")
    for key, (typ, words) in _TYPES.items():
        value = data.get(key)
        if key in data and (not isinstance(value, typ) or (typ is not bool and isinstance(value, bool))):
            raise ValueError(f"{key} must be {words}, not {type(value).__name__} ({value!r:.60})")
    if not re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", data["base_commit"]):
        raise ValueError(f"base_commit {data['base_commit']!r:.60} is not a full commit sha")
    for i, f in enumerate(data["frozen"]):
        name = f.get("path") if isinstance(f, dict) else None
        what = f"frozen[{i}]" + (f" ({name})" if isinstance(name, str) else "")
        if not isinstance(f, dict):
            raise ValueError(f"{what} must be an object with path, sha256 and reason")
        for k in ("path", "sha256", "reason"):
            if not isinstance(f.get(k), str):
                raise ValueError(f"{what} has no {k}" if k not in f else f"{what}: {k} must be a string")
        if not re.fullmatch(r"[0-9a-f]{64}", f["sha256"]):
            raise ValueError(f"{what}: sha256 {f['sha256']!r:.70} is not a sha256 hex digest")
    for key, allowed in (("modes", MODES), ("langs", LANGS)):
        bad = [m for m in data.get(key, []) if m not in allowed]
        if bad:
            raise ValueError(f"{key}: {', '.join(map(repr, bad))} not among {', '.join(allowed)}")
    if data.get("l2", "rotate") not in L2_MODES:
        raise ValueError(f"l2: {data['l2']!r:.40} not among {', '.join(L2_MODES)}")
    if not all(isinstance(x, str) for x in data.get("shapes", [])):
        raise ValueError("shapes must be a list of shape names (strings)")
    if "target_speedup" in data and not data["target_speedup"] > 0:
        raise ValueError(f"target_speedup must be positive, not {data['target_speedup']!r}")


# -- the frozen set -----------------------------------------------------------------------------

def imported_names(source: str, package: str) -> list[tuple[str, str | None]]:
    """(module, name) pairs the source imports from `package`; name None for `import mod`."""
    pairs: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == package or node.module.startswith(package + "."):
                pairs.extend((node.module, a.name) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Import):
            pairs.extend((a.name, None) for a in node.names
                         if a.name == package or a.name.startswith(package + "."))
    return pairs


def conftests_above(root: Path, test_path: Path) -> list[Path]:
    found, d = [], test_path.parent
    while True:
        if (d / "conftest.py").is_file():
            found.append(d / "conftest.py")
        if d == root or root not in d.parents:
            break
        d = d.parent
    return sorted(found)


def pytest_config_file(root: Path) -> Path | None:
    for name, marker in PYTEST_CONFIGS:
        p = root / name
        if p.is_file() and (marker is None or marker in p.read_text(errors="replace")):
            return p
    return None


def compute_frozen(target: Target, spec: OpSpec, base_commit: str) -> tuple[list[FrozenFile], dict]:
    """The frozen set (hashed at the base commit) and the op query's answer."""
    root = target.root
    real_root = os.path.realpath(root)
    test_path = target.test_path(spec)
    reasons: dict[str, str] = {}

    def add(path: Path | str, reason: str) -> None:
        rel = os.path.relpath(os.path.realpath(path), real_root)
        if not rel.startswith(".."):
            reasons.setdefault(rel, reason)

    add(test_path, "gate test file")
    conftests = conftests_above(root, test_path)
    for c in conftests:
        add(c, "pytest conftest")
    cfg = pytest_config_file(root)
    if cfg:
        add(cfg, "pytest configuration")

    wanted: list[tuple[str, str | None]] = []
    for src in [test_path, *conftests]:
        for pair in imported_names(src.read_text(), spec.package):
            if pair not in wanted:
                wanted.append(pair)
    answer = run_query(target.python, root, [
        "op", "--import-path", spec.import_path, "--func", spec.func_name, "--resolve", json.dumps(wanted)],
        preload=forkservers.op_preload(target.python, spec.name), package=spec.package)
    if not answer.get("ok"):
        hint = ("fix the import, or pass --python" if spec.source != CONFIG_FILE else
                f"fix import_path (the module) or func_name (the function in it) under [ops.{spec.name}] "
                f"in {CONFIG_FILE}, e.g. import_path = \"pkg.ops.mod\", func_name = \"{spec.func_name}\"; "
                "or pass --python")
        raise UsageError(f"could not import {spec.import_path}.{spec.func_name} with {target.python}: "
                         f"{answer.get('error')}", hint)
    entry = answer["func_file"]
    op_dir = Path(answer["module_file"]).parent
    if (op_dir / "naive.py").is_file():
        add(op_dir / "naive.py", "naive reference of the op")
    for item in answer["resolved"]:
        if item["error"]:
            raise UsageError(f"{spec.test_file} imports {item['module']}.{item['name'] or ''} but it fails "
                             f"to import: {item['error']}")
        if not item["file"] or item["file"] == entry:
            continue  # the kernel under optimization
        what = f"{item['module']}.{item['name']}" if item["name"] else item["module"]
        reason = "defines assert_close" if item["name"] == "assert_close" else f"imported by the test: {what}"
        add(item["file"], reason)

    frozen = []
    for rel, reason in sorted(reasons.items()):
        blob = git.file_at(root, base_commit, rel)
        if blob is None:
            raise UsageError(f"frozen file {rel} does not exist at the base commit {base_commit[:12]}",
                             "commit it first, or choose a base that has it (--base)")
        frozen.append(FrozenFile(rel, hashlib.sha256(blob).hexdigest(), reason))
    return frozen, answer


def changed_frozen(target: Target, contract: Contract) -> list[tuple[FrozenFile, str]]:
    """Frozen files whose working-tree content differs from the contract, with their diff."""
    out = []
    for f in contract.frozen:
        p = target.root / f.path
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<missing>"
        if digest != f.sha256:
            out.append((f, git.diff_against(target.root, contract.base_commit, f.path)))
    return out


# -- init ---------------------------------------------------------------------------------------

def parse_speedup(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*[xX]?\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--target {text!r} is not a speedup", "write it like 1.2x")
    return float(m.group(1))


def parse_overrides(items: list[str], flag: str = "--input", shape: str = "NAME=TRANSFORM",
                    example: str = "k=l2norm") -> dict[str, str]:
    """NAME=VALUE items (of --input, --cand-env) as a dict; a UsageError naming the flag otherwise."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise UsageError(f"{flag} {item!r} is not {shape}", f"e.g. {flag} {example}")
        out[name.strip()] = value.strip()
    return out


def _worker_transforms() -> tuple[str, ...]:
    """The transforms a bench worker knows: VALID_OVERRIDES of inside/worker/inputs.py, read from its
    source (the worker runs in the target's interpreter and imports torch: it is not imported here)."""
    tree = ast.parse((inside.WORKER / "inputs.py").read_text())
    found = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if getattr(t, "id", None) in ("VALID_OVERRIDES", "NEG")}
    if set(found) != {"VALID_OVERRIDES", "NEG"}:
        raise RuntimeError("inside/worker/inputs.py lost VALID_OVERRIDES or NEG")
    return tuple(found["VALID_OVERRIDES"]), found["NEG"]


TRANSFORMS, NEG = _worker_transforms()


def check_overrides(spec: OpSpec, overrides: dict[str, str]) -> None:
    """Every --input names an input of the op and a transform the bench knows: said before any
    worker starts (a typo is a usage error, exit 2, never a measurement failure)."""
    inputs = (spec.registry or {}).get("inputs", {})
    unknown = [n for n in overrides if spec.registry and n not in inputs]
    if unknown:
        raise UsageError(f"--input names {', '.join(unknown)}, not inputs of {spec.name}",
                         f"its inputs: {', '.join(inputs)}")
    order = list(inputs)

    def known(name: str, transform: str) -> bool:
        if not transform.startswith(NEG):
            return transform in TRANSFORMS
        other = transform[len(NEG):]  # minus an input built before this one (the worker builds in order)
        return not spec.registry or (other in order and order.index(other) < order.index(name))

    bad = [f"{n}={t}" for n, t in overrides.items() if not known(n, t)]
    if bad:
        raise UsageError(f"--input {', '.join(bad)}: unknown transform",
                         f"known: {', '.join(TRANSFORMS)}, or {NEG}OTHER (minus an input built before it"
                         + (f"; in order: {', '.join(order)})" if order else ")"))


def create(target: Target, spec: OpSpec, *, base_ref: str, speedup: float, shapes: list[str] | None,
           langs: list[str], modes: list[str], overrides: dict[str, str], varlen: bool = False,
           max_iters: int = 20, frozen_may_differ: bool = False, l2: str = "rotate") -> Contract:
    """The contract of `spec` against `base_ref`. `frozen_may_differ`: a contract for a check of
    someone's change (a sweep's `--ops`), whose gate then says that a frozen file changed, instead
    of a refusal to write the contract."""
    base_commit = git.resolve_ref(target.root, base_ref)
    if max_iters < 1:
        raise UsageError(f"--max-iters {max_iters}: need at least 1", "e.g. --max-iters 20")
    bad = [lang for lang in langs if lang not in LANGS]
    if bad:
        raise UsageError(f"unknown language(s) {', '.join(bad)}", f"choose from {', '.join(LANGS)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UsageError(f"unknown mode(s) {', '.join(bad)}", f"choose from {', '.join(MODES)}")
    if l2 not in L2_MODES:
        raise UsageError(f"--l2 {l2}: not one of {', '.join(L2_MODES)}", "e.g. --l2 both: a hot and a cold cell each")
    # the bench builds a declared op's inputs from the declaration the base commit has: refused
    # now where the base has none (flaloop.toml not committed), not at the first bench
    spec = target.declared_at(spec, base_commit)
    answer = None
    if spec.declared is None and not spec.registry.get("inputs"):
        # inputs from the calls its test recorded: refused now where there are none, else they
        # need the op's parameter names, which the op query answers
        if opcalls.read(target.workspace(spec.name).gate_calls) is None:
            target.bench_spec(spec, [])
        frozen, answer = compute_frozen(target, spec, base_commit)
        spec = target.bench_spec(spec, argument_names(answer["parameters"]))
    known_shapes = target.shape_configs(spec)
    if not known_shapes:
        raise UsageError(f"{spec.name} has no shapes to bench",
                         f"name them under [ops.{spec.name}.shapes] in {CONFIG_FILE}, e.g. "
                         f"B2_T64_H2_D16 = {{ B = 2, T = 64, H = 2, D = 16 }}")
    if shapes:
        unknown = [s for s in shapes if s not in known_shapes]
        if unknown:
            raise UsageError(f"unknown shape(s) {', '.join(unknown)} for {spec.name}",
                             f"known: {', '.join(known_shapes) or '(none)'}")
    check_overrides(spec, overrides)
    if answer is None:
        frozen, answer = compute_frozen(target, spec, base_commit)
    entry_rel = os.path.relpath(answer["func_file"], os.path.realpath(target.root))
    contract = Contract(
        op=spec.name, import_path=spec.import_path, func_name=spec.func_name, entry_file=entry_rel,
        signature=answer["signature"], parameters=answer["parameters"], base_ref=base_ref,
        base_commit=base_commit, test_file=spec.test_file, frozen=frozen, target_speedup=speedup,
        shapes=list(shapes or known_shapes), modes=list(modes), langs=list(langs),
        input_overrides=overrides, varlen=varlen, l2=l2, max_iters=max_iters,
        created=clock.now_iso(),
    )
    dirty = [] if frozen_may_differ else changed_frozen(target, contract)
    if dirty:
        names = ", ".join(f.path for f, _ in dirty)
        raise UsageError(f"frozen file(s) already differ from the base {base_commit[:12]}: {names}",
                         "the contract freezes the base's versions: commit or revert these edits first")
    return contract


def render_draft(c: Contract) -> str:
    frozen = "\n".join(f"| `{f.path}` | {f.reason} | `{f.sha256[:16]}` |" for f in c.frozen)
    overrides = ", ".join(f"`{k}: {v}`" for k, v in c.input_overrides.items()) or "none"
    return f"""# Task contract: `{c.op}`

Written by `flaloop init` on {c.created}. `contract.json` beside `docs/` is what the tools
read; this page is for people. Edit the prose freely; change the contract with
`flaloop init {c.op} --force`.

## Op and entry point
- Op: `{c.op}`, imported as `from {c.import_path} import {c.func_name}`
- Defined in: `{c.entry_file}`
- Public signature (must not change): `{c.signature}`

## Target
- Speedup: **{c.target_speedup:g}x** (equal-weight geometric mean over the target shapes)
- Shapes: {", ".join(f"`{s}`" for s in c.shapes) or "(none)"}
- Modes: {", ".join(c.modes)}
- Variable-length (packed `cu_seqlens`) cells: {"yes, one per shape" if c.varlen else "no"}
- L2 as each timed call starts: {L2_WORDS[c.l2]}
- Input transforms overridden for the bench: {overrides}
- Iteration cap: {c.max_iters} iterations of `flaloop iter`

## Allowed languages
{", ".join(c.langs)}

## Validation command
`flaloop gate {c.op}` runs `{c.test_file}` unmodified with pytest. A `-k` subset is a signal only.

## Benchmark command
`flaloop verify {c.op} --base {c.base_commit[:12]}` (gate first, then the paired benchmark).

## Promotion criteria
- The full gate is green: every frozen file matches its hash, the collected test ids equal the
  base's, no more skips than the base, every selected case ran, pytest exited 0.
- Base and candidate agree on every bench cell (outputs and gradients, relative RMS error).
- The speedup CI of the geometric mean lies above 1, no cell regresses (verdict SLOWER), and the
  target above is reached.

## Frozen scope (base `{c.base_ref}` = `{c.base_commit}`)
| file | why | sha256 |
| --- | --- | --- |
{frozen}

{render_allowed(c)}"""


ALLOWED_HEADING = "## Allowed guard exceptions"


def render_allowed(c: Contract) -> str:
    """The draft's section on guard rules this task may break, and why (docs/GUARD.md has the rules)."""
    if not c.allowed:
        body = ("None. Every guard rule applies (docs/GUARD.md). An exception is recorded with\n"
                f"`flaloop audit {c.op} --allow RULE --why \"...\"` and listed here.")
    else:
        rows = "\n".join(f"| `{a.get('rule')}` | {_cell(a.get('why', ''))} | {a.get('added', '')} |"
                         for a in c.allowed)
        body = ("Findings of these rules are shown as allowed, not blocking. Each was recorded with\n"
                f"`flaloop audit {c.op} --allow RULE --why ...`.\n\n| rule | why | added |\n| --- | --- | --- |\n{rows}")
    return f"{ALLOWED_HEADING}\n{body}\n"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def update_draft_allowed(target: Target, c: Contract) -> Path | None:
    """Rewrite only the allowances section of docs/draft.md, keeping any prose the user edited."""
    path = target.workspace(c.op).draft
    if not path.is_file():
        return None
    text = path.read_text()
    section = render_allowed(c)
    start = text.find(ALLOWED_HEADING)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(ALLOWED_HEADING))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    return fsutil.atomic_write_text(path, text)


def write(target: Target, contract: Contract, force: bool) -> tuple[Path, Path]:
    ws = target.workspace(contract.op)
    cpath, dpath = ws.contract, ws.draft
    if cpath.exists() and not force:
        raise UsageError(f"a contract for {contract.op} already exists at {cpath.relative_to(target.root)}",
                         "pass --force to replace it (docs/draft.md is rewritten too)")
    rel_ws = str(ws.path.relative_to(target.root))
    git.ensure_ignored(target.root, rel_ws)
    fsutil.atomic_write_text(dpath, render_draft(contract))
    contract.save(target)
    return cpath, dpath


def no_contract(target: Target, op: str) -> UsageError:
    """The error for an op without a contract. A name that is no op of the target (a typo) gets the
    close names among its ops and contracts, never the advice to write a contract for the typo."""
    contracts = sorted(w.op for w in Workspace.every(target.workspace(op).home) if w.contract.is_file())
    try:
        ops = [s.name for s in target.ops()]
    except FlaloopError:  # a registry that cannot be read: the contracts are all there is to go by
        ops = []
    if op not in ops and (ops or contracts):
        close = difflib.get_close_matches(op, list(dict.fromkeys(ops + contracts)), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}?" if close else "`flaloop list` names the ops"
        if contracts:
            hint += f" (ops with a contract: {', '.join(contracts)})"
        return UsageError(f"unknown op {op!r} in {target.root}: no op and no task contract by that name", hint)
    return UsageError(f"no task contract for {op!r} in {target.root}",
                      f"run `flaloop init {op}` first: every command needs the contract")
