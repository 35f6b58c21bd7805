"""Runs inside the TARGET's interpreter, imported by the step scripts beside it (profile_step.py,
sanitize_step.py; a script's own directory is first on sys.path), never by flaloop: the bench
worker's server, loaded by path under the private name it always has (see inside/worker/__init__),
and a WorkerServer for one side whose commands the script calls directly (no protocol loop)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "worker"
PACKAGE = "_flaloop_worker"


def load_worker():
    """The bench worker's server module."""
    spec = importlib.util.spec_from_file_location(PACKAGE, WORKER / "__init__.py",
                                                  submodule_search_locations=[str(WORKER)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{PACKAGE}.server")


def worker_server(args):
    """A WorkerServer for `args.side` of `args.op` in `args.tree`; RuntimeError when the op cannot be imported.
    Arms flaloop's lifeline first: under ncu or compute-sanitizer this process is flaloop's grandchild."""
    import flaloop_lifeline  # beside this file, first on sys.path

    flaloop_lifeline.arm()
    wargs = argparse.Namespace(tree=args.tree, registry=args.registry, op=args.op, side=args.side,
                               device=args.device, workdir=None, backend=None, import_mode="full")
    worker = load_worker().WorkerServer(wargs)
    if worker.init_error:
        raise RuntimeError(f"could not import {args.op}: {worker.init_error[0]}")
    return worker
