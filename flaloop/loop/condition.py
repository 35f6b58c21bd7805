"""Shape conditions for dispatch buckets: a tiny expression language, parsed, never eval'd.

    T<=512        T>=1024 and D==128        H < 16 or (T > 2048 and D >= 64)
    64 <= T <= 512 (chained, as in Python)    not D == 256

Names are the shape's keys (B, T, H, D for FLA's registry); values are integers; comparisons
are < <= > >= == !=; they combine with and, or, not and parentheses. Anything else is a
UsageError that says where the text went wrong.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from flaloop.core.errors import UsageError

_TOKEN = re.compile(r"\s*(?:(?P<num>\d+)|(?P<name>[A-Za-z_]\w*)|(?P<op><=|>=|==|!=|<|>)|(?P<paren>[()]))")
_CMP = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "!=": operator.ne}
KEYWORDS = ("and", "or", "not")
EXAMPLE = 'e.g. --when "T<=512" or --when "T>=1024 and D==128"'


@dataclass(frozen=True)
class Condition:
    text: str
    tree: tuple

    @classmethod
    def parse(cls, text: str) -> Condition:
        tokens = _tokenize(text)
        parser = _Parser(text, tokens)
        tree = parser.expr()
        if parser.pos != len(tokens):
            parser.fail(f"unexpected {tokens[parser.pos][1]!r}")
        return cls(text.strip(), tree)

    @property
    def names(self) -> set[str]:
        return _names(self.tree)

    def matches(self, shape: dict) -> bool:
        missing = sorted(self.names - set(shape))
        if missing:
            raise UsageError(f"--when {self.text!r} names {', '.join(missing)}, not a key of the shapes",
                             f"the shapes have {', '.join(sorted(shape))}")
        return bool(_eval(self.tree, shape))


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text or ""
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise UsageError(f"--when {text!r}: cannot read {text[pos:].strip()[:20]!r} (at character {pos + 1})",
                             EXAMPLE)
        kind = m.lastgroup
        value = m.group(kind)
        if kind == "name" and value in KEYWORDS:
            kind = value
        tokens.append((kind, value))
        pos = m.end()
    if not tokens:
        raise UsageError("--when is empty", EXAMPLE)
    return tokens


class _Parser:
    """Recursive descent: expr := and ('or' and)*; and := not ('and' not)*; not := 'not' not | atom;
    atom := '(' expr ')' | operand (cmp operand)+; operand := name | number."""

    def __init__(self, text: str, tokens: list[tuple[str, str]]):
        self.text, self.tokens, self.pos = text, tokens, 0

    def fail(self, what: str) -> None:
        raise UsageError(f"--when {self.text!r}: {what}", EXAMPLE)

    def peek(self) -> str | None:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.pos >= len(self.tokens):
            self.fail("ends too early")
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def expr(self) -> tuple:
        node = self.conj()
        while self.peek() == "or":
            self.take()
            node = ("or", node, self.conj())
        return node

    def conj(self) -> tuple:
        node = self.neg()
        while self.peek() == "and":
            self.take()
            node = ("and", node, self.neg())
        return node

    def neg(self) -> tuple:
        if self.peek() == "not":
            self.take()
            return ("not", self.neg())
        return self.atom()

    def atom(self) -> tuple:
        if self.peek() == "paren" and self.tokens[self.pos][1] == "(":
            self.take()
            node = self.expr()
            kind, value = self.take()
            if (kind, value) != ("paren", ")"):
                self.fail(f"expected ')' but found {value!r}")
            return node
        operands, ops = [self.operand()], []
        while self.peek() == "op":
            ops.append(self.take()[1])
            operands.append(self.operand())
        if not ops:
            self.fail("a comparison needs an operator: < <= > >= == !=")
        return ("cmp", operands, ops)

    def operand(self) -> tuple:
        kind, value = self.take()
        if kind == "num":
            return ("num", int(value))
        if kind == "name":
            return ("name", value)
        self.fail(f"expected a name or a number but found {value!r}")
        raise AssertionError  # unreachable: fail() raises


def _names(node: tuple) -> set[str]:
    kind = node[0]
    if kind == "name":
        return {node[1]}
    if kind == "num":
        return set()
    children = node[1] if kind == "cmp" else node[1:]
    return set().union(*(_names(c) for c in children))


def _eval(node: tuple, shape: dict):
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "name":
        return shape[node[1]]
    if kind == "not":
        return not _eval(node[1], shape)
    if kind == "and":
        return _eval(node[1], shape) and _eval(node[2], shape)
    if kind == "or":
        return _eval(node[1], shape) or _eval(node[2], shape)
    operands, ops = node[1], node[2]
    values = [_eval(o, shape) for o in operands]
    return all(_CMP[op](a, b) for op, a, b in zip(ops, values, values[1:], strict=False))


def bucket(condition: Condition, shape_configs: dict[str, dict]) -> list[str]:
    """The names of the shapes the condition selects, in the registry's order."""
    return [name for name, shape in shape_configs.items() if condition.matches(shape)]
