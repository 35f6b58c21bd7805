"""flaloop: make GPU kernels faster without ever breaking or gaming correctness."""

import os as _os

__version__ = "0.1.0"

# The BLAS variables numpy's libraries read once, when they load.
_BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _import_numpy_without_blas_threads() -> None:
    """Import numpy with its BLAS held to one thread, leaving the environment as it was.

    flaloop's numpy does statistics, never linear algebra big enough for threads, but OpenBLAS
    starts a thread per core as it loads, and they spin before they sleep: about 0.1 CPU-s in
    every flaloop command on a 2-core machine (docs/lab/2026-12-04-cpu.md R31), and on a GPU host
    with a hundred cores, that many threads beside the workers being timed. The variables are set
    only for the load and then restored, so that no process flaloop starts (the target's tests,
    its workers) inherits them: the target runs with the environment its user gave it. A value
    the user set is left alone."""
    unset = [k for k in _BLAS_THREADS if k not in _os.environ]
    for k in unset:
        _os.environ[k] = "1"
    try:
        import numpy  # noqa: F401
    except ImportError:  # flaloop's dependency; a broken install is reported where numpy is used
        pass
    finally:
        for k in unset:
            _os.environ.pop(k, None)


_import_numpy_without_blas_threads()
