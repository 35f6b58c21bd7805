"""What a static check is: a function of one parsed file (`Source`) and what it may know beyond
it (`FileContext`) that yields `Hit`s. The rule modules beside this one import it; the package
(`run_checks`) imports the rule modules.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from flaloop.guard.source import Source


@dataclass
class Hit:
    rule: str
    key: str                    # what counts as the same occurrence in base and candidate
    node: ast.AST
    message: str
    severity: str | None = None  # None: the rule's default

    @property
    def line(self) -> int:
        return getattr(self.node, "lineno", 1)

    @property
    def end_line(self) -> int:
        return getattr(self.node, "end_lineno", None) or self.line


@dataclass
class FileContext:
    """What a check may know beyond the file itself."""
    path: str
    op_code: bool = True             # part of the op's package or of what the op imports
    kernel_base: bool = False        # the op (this file or its op directory) had kernels of its own at the base
                                     # (Triton, Gluon, CuTe DSL or TileLang: delegation.KERNEL_DECORATORS)
    shape_literals: frozenset[int] = frozenset()
    tensor_names: frozenset[str] = frozenset()
    package: str = ""
    # module (+ name) -> repo-relative file that defines it, or None (see static.Resolver)
    resolve: Callable[[str, str | None], str | None] = lambda mod, name: None
    frozen: dict[str, str] = field(default_factory=dict)      # repo-relative path -> why the gate freezes it
    references: dict[str, str] = field(default_factory=dict)  # the frozen files the test compares against


Check = Callable[[Source, FileContext], Iterator[Hit]]
