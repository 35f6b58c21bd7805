"""Test-wide fixtures.

NaN poisoning: while a test under ``tests/ops/`` runs, ``torch.empty``,
``torch.empty_like`` and ``torch.Tensor.new_empty`` hand back NaN-filled tensors
(floating and complex dtypes) whenever the allocation comes from the ``minifla``
package.  A kernel that forgets to write part of its output (a tail chunk, a
masked-off block, a gradient it never stores) then leaves NaN behind, and the
comparison in the test fails instead of passing on whatever the allocator
happened to return.

Who is allocating is decided by walking up the Python stack from the call:
the first frame that belongs to a test file (``test_*.py`` or anything under
this repo's ``tests/``) means the test itself asked for the memory, so it is
left alone; the first frame whose module is ``minifla`` or ``minifla.*`` means
library code asked, so it is poisoned.  Like FLA's conftest, a frame counts as test
code when its file path contains ``tests/`` or ``test_`` anywhere, so a checkout
living under such a directory is never poisoned: flaloop's gate runs the tree
through a neutral path for exactly that reason.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_FILE = os.path.abspath(__file__)
PACKAGE = 'minifla'

_real_empty = torch.empty
_real_empty_like = torch.empty_like
_real_new_empty = torch.Tensor.new_empty


def _is_test_file(filename: str) -> bool:
    # Deliberately FLA's rule, blind spot included: any path containing `tests/` or `test_`
    # counts as test code. A checkout that lives under such a directory (pytest's tmp_path,
    # `~/tests/fla`) therefore switches poisoning off; flaloop's gate must run the tree from
    # a neutral path, and this example keeps the hazard so that flaloop's tests can see it.
    return 'tests/' in filename or 'test_' in filename


def _allocated_by_package() -> bool:
    """True when the nearest decisive caller is minifla code rather than a test."""
    frame = sys._getframe(1)
    try:
        while frame is not None:
            filename = frame.f_code.co_filename
            if os.path.abspath(filename) != THIS_FILE:
                if _is_test_file(filename):
                    return False
                module = frame.f_globals.get('__name__') or ''
                if module == PACKAGE or module.startswith(PACKAGE + '.'):
                    return True
            frame = frame.f_back
        return False
    finally:
        del frame


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        with torch.no_grad():
            t.fill_(float('nan'))
    return t


def _poisoned_empty(*args, **kwargs):
    out = _real_empty(*args, **kwargs)
    return _poison(out) if _allocated_by_package() else out


def _poisoned_empty_like(input, *args, **kwargs):
    out = _real_empty_like(input, *args, **kwargs)
    return _poison(out) if _allocated_by_package() else out


def _poisoned_new_empty(self, *args, **kwargs):
    out = _real_new_empty(self, *args, **kwargs)
    return _poison(out) if _allocated_by_package() else out


def _under(request: pytest.FixtureRequest, subdir: str) -> bool:
    rel = os.path.relpath(str(request.node.path), os.path.join(REPO_ROOT, 'tests'))
    return rel.split(os.sep)[0] == subdir


@pytest.fixture(autouse=True)
def poison_uninitialized_memory(request, monkeypatch):
    if not _under(request, 'ops'):
        yield
        return
    monkeypatch.setattr(torch, 'empty', _poisoned_empty)
    monkeypatch.setattr(torch, 'empty_like', _poisoned_empty_like)
    monkeypatch.setattr(torch.Tensor, 'new_empty', _poisoned_new_empty)
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
