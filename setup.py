"""Only what pyproject.toml cannot say: files from outside the package that the wheel carries inside
it, so that a plain `pip install` has them. examples/minifla goes to flaloop/_example/minifla (for
`flaloop demo`) and SKILL.md to flaloop/SKILL.md (for `flaloop skill install`). An editable install
and a checkout read both where they are (flaloop/loop/demo.py and flaloop/cli/agent.py look in both places)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithData(build_py):
    def run(self):
        super().run()
        pkg = Path(self.build_lib) / "flaloop"
        shutil.copy2(ROOT / "SKILL.md", pkg / "SKILL.md")
        dst = pkg / "_example" / "minifla"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(ROOT / "examples" / "minifla", dst,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "profile", ".git", ".ruff_cache"))


setup(cmdclass={"build_py": BuildWithData})
