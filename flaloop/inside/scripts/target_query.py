"""Runs inside the TARGET's interpreter, as a script: never imports flaloop.

    python target_query.py registry --tree ROOT --registry FILE --out OUT.json
    python target_query.py op --tree ROOT --import-path MOD --func NAME \
        --resolve '[["pkg.mod", "name"], ...]' --out OUT.json

`registry` imports the target's own op registry (FLA's interface: OpConfig, TensorSpec,
SHAPE_CONFIGS, get_op, list_ops) and writes a JSON description of every op.
`op` imports the op from the tree, reports its public signature and defining file, and
resolves each imported (module, name) to the file that defines it: the frozen set is built
from those answers. The result goes to --out (stdout is left to whatever the target prints).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
import traceback


def _name_of(obj) -> str | None:
    if obj is None:
        return None
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


def _load_registry(path: str):
    spec = importlib.util.spec_from_file_location("flaloop_target_registry", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _describe_op(cfg) -> dict:
    inputs = {}
    for name, spec in (getattr(cfg, "inputs", None) or {}).items():
        inputs[name] = {
            "shape_fn": _name_of(getattr(spec, "shape_fn", None)),
            "dtype": str(getattr(spec, "dtype", "default")),
            "requires_grad": bool(getattr(spec, "requires_grad", True)),
            "transform": _name_of(getattr(spec, "transform", None)),
        }
    return {
        "name": cfg.name,
        "import_path": cfg.import_path,
        "func_name": getattr(cfg, "func_name", None) or cfg.name,
        "test_file": getattr(cfg, "test_file", None),
        "category": getattr(cfg, "category", ""),
        "inputs": inputs,
        "extra_kwargs": {k: repr(v) for k, v in (getattr(cfg, "extra_kwargs", None) or {}).items()},
        "output_is_tuple": bool(getattr(cfg, "output_is_tuple", True)),
        "skip_backward": bool(getattr(cfg, "skip_backward", False)),
        "post_init": _name_of(getattr(cfg, "post_init", None)),
        "dim_constraints": getattr(cfg, "dim_constraints", None),
        "default_shapes": getattr(cfg, "default_shapes", None),
        "backend_env": getattr(cfg, "backend_env", None),
    }


def cmd_registry(args) -> dict:
    module = _load_registry(args.registry)
    names = list(module.list_ops()) if hasattr(module, "list_ops") else []
    ops = [_describe_op(module.get_op(n)) for n in names]
    shapes = getattr(module, "SHAPE_CONFIGS", {}) or {}
    return {"ops": ops, "shape_configs": {k: dict(v) for k, v in shapes.items()},
            "files": _tree_files(args.tree, args.registry)}


def _tree_files(tree: str, registry: str) -> list[str]:
    """Every file of the tree this process loaded (the registry and what it imported): the answer
    depends on them alone, so flaloop may reuse it while they are unchanged."""
    root = os.path.realpath(tree) + os.sep
    files = {os.path.realpath(registry)}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and os.path.isabs(f):  # torch._classes says "_classes.py"
            files.add(os.path.realpath(f))
    return sorted(os.path.relpath(f, root) for f in files if f.startswith(root))


def _defining_file(obj, fallback_module) -> tuple[str | None, str]:
    """File that defines `obj` (functions, classes, modules); else the importing module's file."""
    if inspect.ismodule(obj):
        return getattr(obj, "__file__", None), "module"
    modname = getattr(obj, "__module__", None)
    if isinstance(modname, str) and modname in sys.modules:
        f = getattr(sys.modules[modname], "__file__", None)
        if f:
            return f, "defined"
    try:
        return inspect.getsourcefile(inspect.unwrap(obj)), "source"
    except (TypeError, ValueError):
        return getattr(fallback_module, "__file__", None), "attribute"


def _param_doc(doc: str, name: str) -> str | None:
    """The docstring's entry for parameter `name` (its line and the more indented lines after it),
    where the docstring has one (Google or NumPy style: the line starts with the name)."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith(name) and text[len(name):len(name) + 1] in (" ", ":", "("):
            indent = len(line) - len(line.lstrip())
            out = [text]
            for more in lines[i + 1:]:
                if more.strip() and len(more) - len(more.lstrip()) <= indent:
                    break
                out.append(more.strip())
            return " ".join(x for x in out if x)[:500]
    return None


def cmd_op(args) -> dict:
    module = importlib.import_module(args.import_path)
    fn = getattr(module, args.func)
    fn_file, _ = _defining_file(fn, module)
    try:
        sig = inspect.signature(fn)
        doc = inspect.getdoc(fn) or ""
        params = [
            {"name": p.name, "kind": str(p.kind), "default": None if p.default is p.empty else repr(p.default),
             "annotation": None if p.annotation is p.empty else
             (p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)),
             "doc": _param_doc(doc, p.name)}
            for p in sig.parameters.values()
        ]
        signature = f"{args.func}{sig}"
    except (TypeError, ValueError):
        params, signature = [], f"{args.func}(...)"
    resolved = []
    for modname, attr in json.loads(args.resolve or "[]"):
        entry = {"module": modname, "name": attr, "file": None, "how": None, "error": None}
        try:
            mod = importlib.import_module(modname)
            if attr is None:
                entry["file"], entry["how"] = getattr(mod, "__file__", None), "module"
            elif hasattr(mod, attr):
                entry["file"], entry["how"] = _defining_file(getattr(mod, attr), mod)
            else:  # `from pkg import submodule`
                sub = importlib.import_module(f"{modname}.{attr}")
                entry["file"], entry["how"] = getattr(sub, "__file__", None), "module"
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            entry["error"] = f"{type(exc).__name__}: {exc}"
        if entry["file"]:
            entry["file"] = os.path.realpath(entry["file"])
        resolved.append(entry)
    return {
        "module_file": os.path.realpath(module.__file__),
        "func_file": os.path.realpath(fn_file) if fn_file else None,
        "signature": signature,
        "parameters": params,
        "resolved": resolved,
    }


def _where(exc: BaseException, tree: str) -> str:
    """' (at path:line)' of the innermost frame inside the tree, so the message names the culprit."""
    root = os.path.realpath(tree) + os.sep
    if isinstance(exc, SyntaxError) and exc.filename:
        return ""  # its message names file and line already
    spots = [f for f in traceback.extract_tb(exc.__traceback__)
             if os.path.realpath(f.filename).startswith(root)]
    if not spots:
        return ""
    return f" (at {os.path.relpath(os.path.realpath(spots[-1].filename), root)}:{spots[-1].lineno})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["registry", "op"])
    parser.add_argument("--tree", required=True)
    parser.add_argument("--registry")
    parser.add_argument("--import-path")
    parser.add_argument("--func")
    parser.add_argument("--resolve")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    try:
        result = {"ok": True, **(cmd_registry(args) if args.what == "registry" else cmd_op(args))}
    except BaseException as exc:  # noqa: BLE001 - the orchestrator shows it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}{_where(exc, args.tree)}",
                  "traceback": traceback.format_exc()}
    with open(args.out, "w") as fh:
        json.dump(result, fh, default=repr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
