"""Reviewed code replaced by code nobody reviews: the tree under test is first on `sys.path`, and
Python prefers a package directory or a compiled extension to a `.py` module of the same name
(flaloop's own analysis of how the gate and the bench import the tree). The audit lists every file
Python would import, git-ignored ones included."""

import pytest
from corpus import assert_static, new_file

STATIC = {
    "root-time-module": [new_file("time.py", "def perf_counter():\n    return 0.0\n")],
    "package-beside-the-module": [new_file("minifla/ops/linear_attn/chunk/__init__.py", "from ..naive import *  # noqa\n")],
    "sitecustomize": [new_file("sitecustomize.py", "import torch\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_shadowing_module_is_blocked_by_the_audit(name):
    assert_static(STATIC[name], "shadow-module")
