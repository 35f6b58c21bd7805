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

    [gate]
    strip_env = ["MY_LENIENT_MODE"]     # more variables that weaken the tests

Ops from flaloop.toml override registry entries of the same name.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from flaloop import git
from flaloop.errors import UsageError

PROBE = Path(__file__).parent / "probes" / "target_probe.py"
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


def derived_test_file(import_path: str) -> str:
    return f"tests/ops/test_{import_path.rsplit('.', 1)[-1]}.py"


def run_probe(python: str, root: Path, args: list[str], timeout: float = 600) -> dict:
    """Run the target probe in the target's interpreter; return its JSON answer."""
    with tempfile.TemporaryDirectory(prefix="flaloop-probe-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [python, str(PROBE), *args, "--tree", str(root), "--out", str(out)]
        try:
            proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError as exc:
            raise UsageError(f"the target interpreter {python!r} was not found",
                             "pass --python PATH to the Python that has the target's torch") from exc
        except subprocess.TimeoutExpired as exc:
            raise UsageError(f"probing the target with {python} took longer than {timeout:.0f}s") from exc
        if not out.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            raise UsageError(f"the target probe died (exit {proc.returncode}) under {python}:\n{tail}")
        return json.loads(out.read_text())


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
            except tomllib.TOMLDecodeError as exc:
                raise UsageError(f"{cfg_path} is not valid TOML: {exc}") from exc
        return cls(root=root, python=python or sys.executable, config=config)

    # -- layout -----------------------------------------------------------------------------

    @property
    def registry_file(self) -> Path:
        return self.root / self.config.get("target", {}).get("registry", DEFAULT_REGISTRY)

    def workspace(self, op: str) -> Path:
        return self.root / "profile" / f"{op}-opt"

    def extra_strip_env(self) -> list[str]:
        return list(self.config.get("gate", {}).get("strip_env", []))

    # -- ops --------------------------------------------------------------------------------

    def registry(self) -> dict:
        """The registry's JSON description (ops and shape configs), read in the target's Python."""
        if not hasattr(self, "_registry"):
            if not self.registry_file.exists():
                self._registry = {"ops": [], "shape_configs": {}}
            else:
                ans = run_probe(self.python, self.root, ["registry", "--registry", str(self.registry_file)])
                if not ans.get("ok"):
                    raise UsageError(
                        f"could not import the registry {self.registry_file.relative_to(self.root)} "
                        f"with {self.python}: {ans.get('error')}",
                        "check that this interpreter has the target's dependencies (torch), or pass --python",
                    )
                self._registry = ans
        return self._registry

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
            if "import_path" not in entry:
                raise UsageError(f"{CONFIG_FILE}: [ops.{name}] has no import_path")
            explicit = "test_file" in entry
            specs[name] = OpSpec(
                name=name, import_path=entry["import_path"], func_name=entry.get("func_name", name),
                test_file=entry.get("test_file") or derived_test_file(entry["import_path"]),
                test_file_explicit=explicit, source=CONFIG_FILE,
                registry=specs[name].registry if name in specs else {},
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
