"""The registry and the op, imported from the tree under test."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types

REGISTRY_MODULE_NAME = '_flaloop_target_registry'


def dotted_name(path: str, tree: str) -> str | None:
    rel = os.path.relpath(path, tree)
    if rel.startswith('..') or not rel.endswith('.py'):
        return None
    return rel[:-3].replace(os.sep, '.')


def load_registry(path: str, tree: str):
    """Import the registry file under a private module name (fallback: as a package module of TREE).
    A `.json` file is an op declared in flaloop.toml, as flaloop/task/opdecl.py wrote it (declared.py)."""
    if path.endswith('.json'):
        from .declared import load
        return load(path)
    spec = importlib.util.spec_from_file_location(REGISTRY_MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f'cannot load registry from {path}')
    mod = importlib.util.module_from_spec(spec)
    sys.modules[REGISTRY_MODULE_NAME] = mod  # dataclasses look their module up in sys.modules
    try:
        spec.loader.exec_module(mod)
        return mod
    except ImportError:
        sys.modules.pop(REGISTRY_MODULE_NAME, None)
        dotted = dotted_name(path, tree)
        if dotted is None:
            raise
        return importlib.import_module(dotted)  # e.g. relative imports inside the registry


def apply_backend_env(cfg, backend: str | None) -> str | None:
    """Mirror FLA's run.py: 'triton' turns every backend env off, another name turns its env on."""
    if not backend:
        return None
    envs = getattr(cfg, 'backend_env', None) or {}
    if backend == 'triton':
        for env in envs.values():
            os.environ[env] = '0'
        return 'triton (default path)'
    env = envs.get(backend)
    if env is None:
        raise ValueError(f"op {cfg.name!r} has no backend {backend!r}; known: {sorted(envs) + ['triton']}")
    os.environ[env] = '1'
    return f'{backend} ({env}=1)'


class LazyPackage(types.ModuleType):
    """A package of the tree whose `__init__.py` runs only when something asks it for a name that is
    not one of its submodules (PEP 562): `--import lean` skips what FLA's `fla/__init__.py` pulls in
    (fla.layers, fla.models, transformers), `fla/ops/__init__.py` (every op) and
    `fla/modules/__init__.py` (einops) when the op only needs some of their submodules. The
    `__init__`'s top-level literal constants (`__version__ = "0.5.2"`) are there from the start:
    reading them runs nothing in the real package either (FLA's fla/utils does
    `from fla import __version__`)."""

    def __getattr__(self, name: str):
        if name in _PROBED or self.__dict__.get('_flaloop_ran'):
            raise AttributeError(name)
        self.__dict__['_flaloop_ran'] = True
        LAZY_RAN.append(self.__name__)
        self.__dict__['_flaloop_loader'].exec_module(self)
        return getattr(self, name)


# Looked up by the import system and by tools on any object (inspect, copy, typing): asking for them
# is not using the package.
_PROBED = frozenset({'__wrapped__', '__signature__', '__class_getitem__', '__mro_entries__', '__fspath__',
                     '__length_hint__', '__len__', '__iter__', '__reduce__', '__reduce_ex__', '__getstate__',
                     '__copy__', '__deepcopy__', '__set_name__', '__dataclass_fields__', '__origin__',
                     '__file__', '__path__', '__spec__', '__loader__', '__package__', '__builtins__',
                     '__cached__'})
LAZY_RAN: list[str] = []


def _literal_constants(init: str) -> dict:
    """`NAME = <literal>` at the top level of a package's __init__, in source order."""
    try:
        with open(init, encoding='utf-8') as fh:
            tree = ast.parse(fh.read(), init)
    except (OSError, SyntaxError, ValueError):
        return {}
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
    return out


class _LazyLoader:
    """Creates the LazyPackage; the package's own loader runs its __init__ when it is asked to."""

    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return LazyPackage(spec.name)

    def exec_module(self, module) -> None:
        module.__dict__.update(_literal_constants(module.__spec__.origin))
        module.__dict__['_flaloop_loader'] = self.real


class LeanFinder:
    """On sys.meta_path: every package whose __init__.py lies in the tree imports lazily, except the
    op's own module (that one runs: it is what is measured)."""

    def __init__(self, tree: str, keep: str):
        self.root, self.keep = os.path.realpath(tree) + os.sep, keep

    def find_spec(self, fullname, path, target=None):
        if fullname == self.keep:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        origin = getattr(spec, 'origin', None) or ''
        if (spec is None or spec.submodule_search_locations is None or os.path.basename(origin) != '__init__.py'
                or not os.path.realpath(origin).startswith(self.root)):
            return None
        spec.loader = _LazyLoader(spec.loader)
        return spec


def import_op(cfg, lean: bool = False, tree: str | None = None):
    """(module, function) of the registry entry `cfg`; `lean` defers the __init__ of the tree's packages."""
    if lean and tree:
        sys.meta_path.insert(0, LeanFinder(tree, cfg.import_path))
    mod = importlib.import_module(cfg.import_path)
    attr = cfg.func_name or cfg.name
    fn = getattr(mod, attr, None)
    if fn is None:
        public = [x for x in dir(mod) if not x.startswith('_')]
        raise ImportError(f'{attr!r} not in module {cfg.import_path!r}; available: {public}')
    return mod, fn


def source_file(obj) -> str | None:
    """Real path of the file defining obj, looking through decorators (functools.wraps, torch.compiler.disable)."""
    candidates = []
    try:
        candidates.append(inspect.unwrap(obj))
    except Exception:
        pass
    orig = getattr(obj, '_torchdynamo_orig_callable', None)
    if orig is not None:
        candidates.append(orig)
    candidates.append(obj)
    for c in candidates:
        try:
            f = inspect.getsourcefile(c) or inspect.getfile(c)
        except TypeError:
            continue
        if f:
            return os.path.realpath(f)
    return None


def signature(fn):
    try:
        return inspect.signature(fn)  # follows __wrapped__
    except (TypeError, ValueError):
        return None


def loaded_outside(tree: str, skip: frozenset = frozenset()) -> list[str]:
    """Modules loaded now whose files live outside `tree` (third-party libraries), in the order they
    were first imported: what a fork server may import ahead of the next run, in that same order
    (alone and out of order, some of torch._inductor's modules fail on circular imports), without
    running any of the tree's code. `skip`: names not to look at (a fork server has them already)."""
    tree = os.path.realpath(tree) + os.sep
    names = []
    for name, mod in list(sys.modules.items()):
        top = name.split('.')[0]
        if not top or top.startswith('_flaloop') or top == '__main__' or mod is None or name in skip:
            continue
        f = getattr(mod, '__file__', None)
        if f and os.path.realpath(f).startswith(tree):
            continue
        names.append(name)
    return names
