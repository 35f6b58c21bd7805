"""The repo under optimization: where it is, which interpreter runs it, which ops it has.

Layout follows FLA by default: an op registry at `benchmarks/ops/registry.py` with
OpConfig entries, tests at `tests/ops/test_<last segment of import_path>.py` unless the
entry names `test_file`. A repo without such a registry describes its ops in `flaloop.toml`:

    [target]
    registry = "bench/registry.py"      # optional: another place for an FLA-style registry

    [ops.my_op]
    import_path = "mypkg.ops.my_op"     # module that exports the op
    func_name = "my_op"                 # default: the op's name
    test_file = "tests/test_my_op.py"   # default: tests/ops/test_<last segment>.py
    # and its bench inputs, shapes and keyword arguments: task/opdecl.py (docs/COMMANDS.md has the schema)

    [gate]
    strip_env = ["MY_LENIENT_MODE"]     # more variables that weaken the tests

Ops from flaloop.toml override registry entries of the same name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package
    import tomli as tomllib

from flaloop import inside
from flaloop.bench import forkservers
from flaloop.core import fsutil, git, procs
from flaloop.core.errors import StorageError, UsageError
from flaloop.core.workspace import Workspace
from flaloop.task import opcalls, opdecl, pytest_run

SCRIPT = inside.script("target_query.py")
DEFAULT_REGISTRY = "benchmarks/ops/registry.py"
CONFIG_FILE = "flaloop.toml"


@dataclass(frozen=True)
class OpSpec:
    """One op of the target: how to import it and which test file gates it."""

    name: str
    import_path: str
    func_name: str
    test_file: str
    test_file_explicit: bool
    source: str  # "registry" or "flaloop.toml"
    registry: dict = field(default_factory=dict, compare=False, hash=False)
    # the worker's declaration of its inputs (opdecl.normalize, or opcalls.declaration), when the
    # bench builds them from flaloop.toml or from recorded calls rather than from the registry
    declared: dict | None = field(default=None, compare=False, hash=False)
    declare_error: UsageError | None = field(default=None, compare=False, hash=False)

    @property
    def package(self) -> str:
        """Top-level package of the target, e.g. `fla`."""
        return self.import_path.split(".")[0]

    def to_dict(self) -> dict:
        return {
            "name": self.name, "import_path": self.import_path, "func_name": self.func_name,
            "test_file": self.test_file, "test_file_explicit": self.test_file_explicit,
            "source": self.source,
        }


def argument_names(parameters: list[dict]) -> list[str]:
    """The names a call's positional arguments bind to, in order (the op query's `parameters`):
    not *args, **kwargs, nor the keyword-only ones."""
    return [p["name"] for p in parameters
            if str(p.get("kind", "POSITIONAL_OR_KEYWORD")) in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]


def derived_test_file(import_path: str) -> str:
    return f"tests/ops/test_{import_path.rsplit('.', 1)[-1]}.py"


def run_query(python: str, root: Path, args: list[str], timeout: float = 600, *,
              preload: list[str] | None = None, package: str | None = None) -> dict:
    """Run the target query (inside/scripts/target_query.py) in the target's interpreter; return its JSON answer.

    With `preload` (a fork server's module list) and `package` (the target's, which the server must
    not hold), the query is forked from a server of that list that is warm for this interpreter and
    environment, as the gate's test process is (pytest_run.warm_server), and run fresh otherwise: it
    imports torch and the target's libraries, seconds that a bench's warm server has paid already.
    None is started for it. The answer then says which server forked it (`_forked_by`); a forked
    query that died without an answer is asked again in a fresh interpreter."""
    with tempfile.TemporaryDirectory(prefix="flaloop-query-") as tmp:
        out = Path(tmp) / "out.json"
        qargs = [*args, "--tree", str(root), "--out", str(out)]
        cmd = [python, str(SCRIPT), *qargs]
        forked = _forked_query(python, root, qargs, Path(tmp), timeout, preload, package) \
            if preload is not None and package else None
        if forked is not None and not out.exists():
            forked = None  # the script answers even when the target fails: a forked one that died is asked fresh
        if forked is not None:
            code, stdout, stderr = forked[0], "", (Path(tmp) / "log").read_text(errors="replace")
        else:
            try:
                proc = procs.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                raise UsageError(f"probing the target with {python} took longer than {timeout:.0f}s") from exc
            except OSError as exc:  # missing, not executable, not a program
                raise UsageError(f"the target interpreter {python!r} cannot be run: {exc.strerror or exc}",
                                 "pass --python PATH to the Python that has the target's torch") from exc
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        try:
            answer = json.loads(out.read_text())
        except (OSError, ValueError):
            tail = (stderr or stdout)[-2000:]
            raise UsageError(f"the target query died (exit {code}) under {python}:\n{tail}",
                             "check that --python is the interpreter of the target (it must import torch)") from None
        if forked is not None and isinstance(answer, dict):
            answer["_forked_by"] = forked[1]
        return answer


def _forked_query(python: str, root: Path, qargs: list[str], tmp: Path, timeout: float,
                  preload: list[str], package: str) -> tuple[int, int] | None:
    """The query forked from a warm server: its exit code and the server's pid, or None where none
    is warm or it would not run as a fresh interpreter would (then the caller runs it fresh)."""
    env = dict(os.environ)
    server, _why = pytest_run.warm_server(python, env, preload, package, [SCRIPT.parent, root], start=False)
    if server is None:
        return None
    try:
        with open(tmp / "log", "w") as log:
            try:
                pid, stdin, stdout = server.spawn(["--script", str(SCRIPT), *qargs], root, env, log)
            except RuntimeError:  # the server refused or is gone: a fresh interpreter
                return None
            for end in (stdin, stdout):  # the script speaks no protocol
                end.close()
            proc = forkservers.ForkedProc(server, pid, None, None)
            try:
                code = proc.wait(timeout)
            finally:  # a timeout, Ctrl-C or any error takes the query along (it is the server's child, not ours)
                if proc.poll() is None:
                    proc.kill()
            if code is None:
                raise UsageError(f"probing the target with {python} took longer than {timeout:.0f}s")
            return code, server.pid
    finally:
        server.close()


# Types of the flaloop.toml keys flaloop reads. Tables and keys it does not know are left alone
# (other tools, and later versions, may add theirs).
_CONFIG_KEYS = {"target": {"registry": str}, "gate": {"strip_env": list}}
_OP_KEYS = {"import_path": str, "func_name": str, "test_file": str}
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def check_config(config: dict) -> None:
    """Refuse a flaloop.toml whose values have the wrong shape, naming the key and the fix."""
    def bad(where: str, what: str) -> UsageError:
        return UsageError(f"{CONFIG_FILE}: {where} {what}", f"fix {CONFIG_FILE} (its format is in `flaloop list --help`)")

    for table, keys in _CONFIG_KEYS.items():
        if table not in config:
            continue
        if not isinstance(config[table], dict):
            raise bad(table, f"must be a table ([{table}]), not {type(config[table]).__name__}")
        for key, typ in keys.items():
            value = config[table].get(key)
            if value is not None and not isinstance(value, typ):
                raise bad(f"[{table}] {key}", f"must be a {typ.__name__}, not {type(value).__name__} ({value!r})")
    strip = config.get("gate", {}).get("strip_env", [])
    if not all(isinstance(v, str) and v for v in strip):
        raise bad("[gate] strip_env", f"must list variable names as strings, got {strip!r}")
    ops = config.get("ops", {})
    if not isinstance(ops, dict):
        raise bad("ops", f"must be tables [ops.NAME], not {type(ops).__name__}")
    for name, entry in ops.items():
        if not isinstance(entry, dict):
            raise bad(f"ops.{name}", f"must be a table [ops.{name}], not {type(entry).__name__} ({entry!r})")
        if "import_path" not in entry:
            raise UsageError(f"{CONFIG_FILE}: [ops.{name}] has no import_path",
                             f'add import_path = "pkg.module" (the module that exports {name}) under [ops.{name}]')
        for key, typ in _OP_KEYS.items():
            if key in entry and not isinstance(entry[key], typ):
                raise bad(f"[ops.{name}] {key}", f"must be a {typ.__name__}, not {type(entry[key]).__name__} "
                                                 f"({entry[key]!r})")
        if not _DOTTED.fullmatch(entry["import_path"]):
            raise bad(f"[ops.{name}] import_path", f"{entry['import_path']!r} is not a dotted module name")


@dataclass
class Target:
    root: Path
    python: str
    config: dict

    @classmethod
    def discover(cls, repo: str | Path | None = None, python: str | None = None) -> Target:
        root = git.repo_root(Path(repo) if repo else Path.cwd())
        config: dict = {}
        cfg_path = root / CONFIG_FILE
        if cfg_path.exists():
            try:
                config = tomllib.loads(cfg_path.read_text())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise UsageError(f"{cfg_path} is not valid TOML: {exc}",
                                 "fix the file (see `flaloop list --help` for its tables)") from exc
            check_config(config)
        return cls(root=root, python=python or sys.executable, config=config)

    # -- layout -----------------------------------------------------------------------------

    @property
    def registry_file(self) -> Path:
        return self.root / self.config.get("target", {}).get("registry", DEFAULT_REGISTRY)

    def checkout(self) -> Path:
        """The checkout whose workspaces this target writes to (and whose fork servers it starts)."""
        return self.root

    def workspace(self, op: str) -> Workspace:
        return Workspace.at(self.checkout(), op)

    def tree(self, root: Path, home: Path | None = None) -> TreeTarget:
        """Another checkout of this target (a worktree of the base, a sweep's candidate) whose
        workspace stays in this checkout (or in `home`, where the measurement runs elsewhere)."""
        return TreeTarget(root=Path(root), python=self.python, config=self.config, home=home or self.root)

    def extra_strip_env(self) -> list[str]:
        return list(self.config.get("gate", {}).get("strip_env", []))

    # -- ops --------------------------------------------------------------------------------

    def registry(self) -> dict:
        """The registry's JSON description (ops and shape configs), read in the target's Python."""
        if not hasattr(self, "_registry"):
            if not self.registry_file.exists():
                self._registry = {"ops": [], "shape_configs": {}}
            else:
                cache = self._registry_cache()
                ans = self._cached_registry(cache)
                if ans is None:
                    ans = run_query(self.python, self.root, ["registry", "--registry", str(self.registry_file)])
                    if ans.get("ok"):
                        self._keep_registry(cache, ans)
                if not ans.get("ok"):
                    rel = self._registry_name()
                    error = str(ans.get("error"))
                    missing = error.startswith(("ModuleNotFoundError", "ImportError"))
                    raise UsageError(
                        f"could not import the registry {rel} with {self.python}: {error}",
                        "check that this interpreter has the target's dependencies (torch), or pass --python"
                        if missing else f"fix {rel} where the error points",
                    )
                self._registry = ans
        return self._registry

    # Reading the registry means importing it (and torch) in the target's Python: seconds on every
    # command. The answer is kept outside the repo, valid while the interpreter and every file of
    # the tree that the registry's import loaded are byte for byte the same. It holds no path, so
    # it is found by content, not by where the tree lies: a clone, a copy or a worktree of the same
    # files reuses it. A few answers are kept per registry file (trees that differ in a module the
    # registry imports take turns without recomputing).

    REGISTRY_ANSWERS_KEPT = 4

    def _registry_name(self) -> str:
        """The registry's path in the tree, or its absolute path when flaloop.toml names one outside."""
        where, root = self.registry_file.resolve(), self.root.resolve()
        return where.relative_to(root).as_posix() if where.is_relative_to(root) else str(where)

    def _registry_cache(self) -> Path | None:
        try:
            content = hashlib.sha256(self.registry_file.read_bytes()).hexdigest()
        except OSError:
            return None
        key = hashlib.sha256(json.dumps([self._registry_name(), content, self.python]).encode()).hexdigest()[:20]
        return fsutil.user_cache_dir() / "registry" / f"{key}.json"

    def _registry_stamp(self, files: list[str]) -> dict | None:
        try:
            st = os.stat(self.python)
            return {"python": [st.st_mtime_ns, st.st_size],
                    "files": {f: hashlib.sha256((self.root / f).read_bytes()).hexdigest() for f in files}}
        except OSError:
            return None

    @staticmethod
    def _registry_entries(path: Path | None) -> list[dict]:
        """The well-formed answers kept at `path` (a damaged cache has none)."""
        doc = fsutil.read_json_cache(path) if path else None
        entries = doc.get("entries") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            return []
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("answer"), dict)
                and isinstance(e["answer"].get("files"), list) and e["answer"]["files"]]

    def _cached_registry(self, path: Path | None) -> dict | None:
        for entry in self._registry_entries(path):
            if self._registry_stamp(entry["answer"]["files"]) == entry.get("stamp"):
                return entry["answer"]
        return None

    def _keep_registry(self, path: Path | None, ans: dict) -> None:
        stamp = self._registry_stamp(ans.get("files") or [])
        if path and stamp and ans.get("files"):
            others = [e for e in self._registry_entries(path) if e.get("stamp") != stamp]
            entries = [{"stamp": stamp, "answer": ans}, *others][: self.REGISTRY_ANSWERS_KEPT]
            with contextlib.suppress(OSError, StorageError):  # a cache that cannot be kept is recomputed
                fsutil.atomic_write_json(path, {"entries": entries})

    def ops(self) -> list[OpSpec]:
        specs: dict[str, OpSpec] = {}
        for entry in self.registry()["ops"]:
            explicit = bool(entry.get("test_file"))
            specs[entry["name"]] = OpSpec(
                name=entry["name"], import_path=entry["import_path"], func_name=entry["func_name"],
                test_file=entry.get("test_file") or derived_test_file(entry["import_path"]),
                test_file_explicit=explicit, source="registry", registry=entry,
            )
        for name, entry in self.config.get("ops", {}).items():
            explicit = "test_file" in entry
            declared, error, registry = None, None, specs[name].registry if name in specs else {}
            if any(k in entry for k in opdecl.OP_KEYS):  # its bench inputs are declared here
                try:
                    declared = opdecl.normalize(name, entry, self.registry().get("shape_configs"))
                    registry = opdecl.registry_view(declared)
                except UsageError as exc:  # said when the op is used, not when another one is listed
                    error = exc
            specs[name] = OpSpec(
                name=name, import_path=entry["import_path"], func_name=entry.get("func_name", name),
                test_file=entry.get("test_file") or derived_test_file(entry["import_path"]),
                test_file_explicit=explicit, source=CONFIG_FILE, registry=registry, declared=declared,
                declare_error=error,
            )
        if not specs:
            raise UsageError(
                f"no op registry found in {self.root}: looked for {self.registry_file.relative_to(self.root)} "
                f"and [ops.*] in {CONFIG_FILE}",
                f"add an FLA-style registry, or describe your ops in {CONFIG_FILE} (see `flaloop list --help`)",
            )
        return sorted(specs.values(), key=lambda s: s.name)

    def op(self, name: str) -> OpSpec:
        ops = {s.name: s for s in self.ops()}
        if name in ops:
            if ops[name].declare_error is not None:
                raise ops[name].declare_error
            return ops[name]
        close = difflib.get_close_matches(name, list(ops), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "run `flaloop list` to see the ops"
        raise UsageError(f"unknown op {name!r} in {self.root}", hint)

    def test_path(self, spec: OpSpec) -> Path:
        return self.require_test_file(spec.name, spec.test_file)

    def require_test_file(self, op: str, test_file: str) -> Path:
        path = self.root / test_file
        if not path.is_file():
            how = (f"set test_file='tests/ops/test_<name>.py' on the OpConfig of {op} in "
                   f"{DEFAULT_REGISTRY}, or `test_file = \"...\"` under [ops.{op}] in {CONFIG_FILE}")
            raise UsageError(f"the gate test file {test_file} of {op} does not exist", how)
        return path

    def shape_configs(self, spec: OpSpec) -> dict[str, dict]:
        return spec.registry.get("default_shapes") or self.registry().get("shape_configs", {})

    def declared_at(self, spec: OpSpec, commit: str) -> OpSpec:
        """`spec` with its flaloop.toml declaration as the file stands at `commit`: the bench builds
        both sides' inputs from the base's, as it reads the base's registry, so that no edit of the
        candidate's changes what is measured."""
        if spec.declared is None or spec.declared.get("recorded"):
            return spec
        raw = git.file_at(self.root, commit, CONFIG_FILE)
        try:
            entry = tomllib.loads(raw.decode())["ops"][spec.name] if raw is not None else None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, KeyError, TypeError):
            entry = None
        if not isinstance(entry, dict) or not isinstance(entry.get("import_path"), str):
            raise UsageError(f"the base {commit[:12]} declares no op {spec.name} in {CONFIG_FILE}",
                             f"commit the [ops.{spec.name}] declaration, or choose a base that has it (--base)")
        decl = opdecl.normalize(spec.name, entry, self.registry().get("shape_configs"))
        return dataclasses.replace(spec, declared=decl, registry=opdecl.registry_view(decl))

    def contract_spec(self, contract) -> OpSpec:
        """The contract's op as the bench builds it (bench_spec, with the signature the contract holds)."""
        return self.bench_spec(self.op(contract.op), argument_names(getattr(contract, "parameters", None) or []))

    def worker_registry(self, contract, base_tree: Path, scratch: Path) -> Path:
        """What a worker reads the op's inputs from: the base's registry (both sides read it, as the
        bench does), or the op's declaration written into `scratch` (inside/worker/declared.py)."""
        spec = self.declared_at(self.contract_spec(contract), contract.base_commit)
        if spec.declared is not None:
            return fsutil.atomic_write_json(Path(scratch) / "op-declared.json", spec.declared)
        if not self.registry_file.is_file():
            raise UsageError(f"{contract.op} has no registry entry to build inputs from",
                             f"the bench reads TensorSpecs from {self.registry_file.relative_to(self.root)}")
        return Path(base_tree) / self.registry_file.relative_to(self.root)

    def bench_spec(self, spec: OpSpec, parameters: list[str] | None) -> OpSpec:
        """`spec` with what the bench builds its inputs from: its registry entry, its declaration in
        flaloop.toml, else the calls its frozen test made at the base (opcalls), which need the op's
        parameter names (`parameters`, in signature order). A UsageError says what to declare."""
        if spec.declared is not None or spec.registry.get("inputs"):
            return spec
        path = self.workspace(spec.name).gate_calls
        doc = opcalls.read(path)
        where = (f"the registry {self._registry_name()} has no entry {spec.name!r}" if self.registry_file.exists()
                 else "the repo has no registry")
        hint = (f"declare its inputs under [ops.{spec.name}.inputs] in {CONFIG_FILE}, e.g.\n"
                + opdecl.EXAMPLE.format(op=spec.name) + "\n(the op schema is in docs/COMMANDS.md, under `flaloop list` and `flaloop init OP`)")
        if doc is None:
            raise UsageError(f"{spec.name} declares no bench inputs, {where}, and no calls of its test are recorded "
                             f"at {path.relative_to(self.root)} (the base gate records them there)", hint)
        if parameters is None:
            raise UsageError(f"{spec.name}: the recorded calls need the op's signature", "run `flaloop init` first")
        try:
            decl = opcalls.declaration(doc, name=spec.name, import_path=spec.import_path, func_name=spec.func_name,
                                       parameters=parameters, test_file=spec.test_file)
        except ValueError as exc:
            raise UsageError(f"{spec.name} declares no bench inputs, {where}, and its recorded calls "
                             f"({path.relative_to(self.root)}) give none: {exc}", hint) from None
        return dataclasses.replace(spec, declared=decl, registry=opdecl.registry_view(decl))


@dataclass
class TreeTarget(Target):
    """A checkout of the target other than the user's: its files are `root`'s, its workspace `home`'s."""

    home: Path | None = None

    def checkout(self) -> Path:
        return self.home or self.root
