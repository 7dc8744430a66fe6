"""Tool use: answer an arithmetic question, optionally after asking a calculator.

Each seed draws a question (``what is 7 times 8 ?``) with ``random.Random(seed)``. A turn is either
a calculator call, whose result (or error) comes back as the next observation, or a final answer,
which ends the episode: 1 if it equals the reference numerically, 0 otherwise. A reply that is
neither is a format error (``-format_penalty``, turn spent); each calculator call costs
``tool_cost``; the episode is truncated at ``max_turns``.

Two action formats: ``compact`` (``calc 7 times 8`` / ``answer 56``, the reply starts with the
keyword; learnable by a tiny word-level policy) and ``tagged`` (``<tool>calc(7*8)</tool>`` /
``<answer>56</answer>`` anywhere in the reply, the style of pretrained instruction models).

The calculator (:func:`calculate`) is a small recursive-descent parser over numbers, ``+ - * /``,
unary minus, parentheses and the words ``plus minus times divided by``; it never evaluates code,
and bounds the length, token count, nesting and magnitudes it accepts. A calculator error is a
legal turn reported as ``tool error : <reason>``.

Observations use only the words of :data:`VOCAB`, numbers and the punctuation ``. , : ? /`` (the
tagged format's first observation also shows the tag syntax, :data:`TAGGED_HINT`).
:func:`verify` replays the replies as a rule-based reward; this module imports only the standard
library, so the verifier ships in the zip-packaged Lambda function.
"""

from __future__ import annotations

import math
import random
import re
from fractions import Fraction
from typing import Any, Literal

from tasks.envs.base import EVAL_SEED_OFFSET, eval_seed  # noqa: F401  (re-exported)

ActionFormat = Literal["compact", "tagged"]

MAX_ACTION_CHARS = 256
MAX_EXPR_CHARS = 64
MAX_EXPR_TOKENS = 16
MAX_PAREN_DEPTH = 3
MAX_NUMBER = 10**6
MAX_RESULT = 10**12

OPS: dict[str, str] = {"plus": "+", "minus": "-", "times": "*", "divided by": "/"}

INTRO = "tool use : answer the question ."
COMPACT_HINT = "call the calculator with calc then reply answer ."
TAGGED_HINT = ("call the calculator as <tool>calc(expression)</tool> "
               "then reply <answer>number</answer> .")

# Every word an observation can hold besides numbers and punctuation; the tiny policy's tokenizer
# (tasks.tiny_tokenizer) has each as one whole-word token, which is quick to learn.
VOCAB: tuple[str, ...] = tuple(dict.fromkeys((
    "tool use answer the question call calculator with calc then reply as "
    "what is plus minus times divided by "
    "result error invalid action correct wrong "
    "division zero expression too long many tokens deep number large unknown symbol bad"
).split()))
PUNCTUATION: tuple[str, ...] = (".", ",", ":", "?", "/")


class CalculatorError(ValueError):
    """An expression the calculator refuses; ``reason`` is a short text of :data:`VOCAB` words."""

    def __init__(self, message: str, reason: str = "bad expression"):
        super().__init__(message)
        self.reason = reason


# Words first, so "divided by" is one operator; "\s+" inside it tolerates extra spaces.
_TOKEN_RE = re.compile(r"\s*(?:(plus|minus|times|divided\s+by)\b|(\d+(?:\.\d+)?)|([-+*/()]))",
                       re.IGNORECASE)


def _tokenize(expr: str) -> list[str | Fraction]:
    tokens: list[str | Fraction] = []
    pos, end = 0, len(expr.rstrip())
    while pos < end:
        m = _TOKEN_RE.match(expr, pos)
        if not m or m.end() == pos:
            raise CalculatorError(f"unknown symbol at position {pos}: {expr[pos:pos + 8]!r}",
                                  "unknown symbol")
        word, number, symbol = m.groups()
        if word:
            tokens.append(OPS[" ".join(word.lower().split())])
        elif number:
            value = Fraction(number)
            if value > MAX_NUMBER:
                raise CalculatorError(f"number {number} exceeds {MAX_NUMBER}", "number too large")
            tokens.append(value)
        else:
            tokens.append(symbol)
        if len(tokens) > MAX_EXPR_TOKENS:
            raise CalculatorError(f"more than {MAX_EXPR_TOKENS} tokens", "too many tokens")
        pos = m.end()
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    unary := '-' unary | primary ; primary := number | '(' expr ')'"""

    def __init__(self, tokens: list[str | Fraction]):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> str | Fraction | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str | Fraction | None:
        tok = self.peek()
        self.pos += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = _checked(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.unary()
            if op == "/" and rhs == 0:
                raise CalculatorError("division by zero", "division by zero")
            value = _checked(value * rhs if op == "*" else value / rhs)
        return value

    def unary(self) -> Fraction:
        if self.peek() == "-":
            self.take()
            return -self.unary()
        return self.primary()

    def primary(self) -> Fraction:
        tok = self.take()
        if isinstance(tok, Fraction):
            return tok
        if tok == "(":
            self.depth += 1
            if self.depth > MAX_PAREN_DEPTH:
                raise CalculatorError(f"more than {MAX_PAREN_DEPTH} levels of parentheses",
                                      "too deep")
            value = self.expr()
            if self.take() != ")":
                raise CalculatorError("unbalanced parentheses", "bad expression")
            self.depth -= 1
            return value
        where = "end of expression" if tok is None else f"{tok!r}"
        raise CalculatorError(f"expected a number or '(' at {where}", "bad expression")


def _checked(value: Fraction) -> Fraction:
    # Bounding every intermediate keeps exact arithmetic cheap whatever the expression.
    if abs(value) > MAX_RESULT:
        raise CalculatorError(f"result exceeds {MAX_RESULT}", "result too large")
    return value


def calculate(expr: str) -> int | float:
    """Evaluate an arithmetic expression exactly (int when whole, else float); raise
    :class:`CalculatorError` on anything else."""
    if not expr or not expr.strip():
        raise CalculatorError("empty expression", "bad expression")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPR_CHARS} characters",
                              "expression too long")
    parser = _Parser(_tokenize(expr))
    value = parser.expr()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after the expression",
                              "bad expression")
    return int(value) if value.denominator == 1 else float(value)


def format_number(value: int | float) -> str:
    """A number as an observation shows it: integers as integers, others to 6 decimals."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


_COMPACT_RE = re.compile(r"^\s*(calc|answer)\b(.*)$", re.IGNORECASE | re.DOTALL)
_TOOL_RE = re.compile(r"<tool>\s*calc\s*\(((?:(?!</tool>).)*)\)\s*</tool>",
                      re.IGNORECASE | re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>((?:(?!</answer>).)*)</answer>", re.IGNORECASE | re.DOTALL)
_NUMBER_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")


def parse_number(text: str) -> float | None:
    """A plain decimal number (``391``, `` 391.0 ``, ``-4``), or None."""
    text = text.strip()
    return float(text) if _NUMBER_RE.match(text) else None


def parse_action(text: str, action_format: ActionFormat = "compact") -> tuple[str, str] | None:
    """``("calc", expression)`` or ``("answer", value)`` from a reply, or None if it is empty,
    oversized, has neither, or has an answer that is not a number."""
    if not text or len(text) > MAX_ACTION_CHARS:
        return None
    if action_format == "compact":
        m = _COMPACT_RE.match(text)
        kind, arg = (m.group(1).lower(), m.group(2).strip()) if m else ("", "")
    elif action_format == "tagged":
        tool, ans = _TOOL_RE.search(text), _ANSWER_RE.search(text)
        if tool and (ans is None or tool.start() < ans.start()):
            kind, arg = "calc", tool.group(1).strip()
        elif ans:
            kind, arg = "answer", ans.group(1).strip()
        else:
            kind, arg = "", ""
    else:
        raise ValueError(f"unknown action_format {action_format!r}")
    if not arg or (kind == "answer" and parse_number(arg) is None):
        return None
    return kind, arg


def is_correct(value: str, reference: float) -> bool:
    """Whether an answer value equals the reference numerically."""
    number = parse_number(value)
    return number is not None and math.isclose(number, float(reference), rel_tol=1e-9,
                                               abs_tol=1e-9)


class ToolUse:
    """Arithmetic questions answered with an optional calculator tool (see module docstring)."""

    quick_step = True  # steps in the worker's own code, waiting for nothing (tasks/envs/base.py)

    @staticmethod
    def check_config(max_turns: int = 4, max_operand: int = 10,
                     ops: tuple[str, ...] = ("plus", "minus", "times"),
                     action_format: str = "compact", **_) -> None:
        """Argument checks, run by the config loader without building an instance."""
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        if not 1 <= max_operand <= MAX_NUMBER:
            raise ValueError(f"max_operand must be in [1, {MAX_NUMBER}]")
        if not ops or any(op not in OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {tuple(OPS)}")
        if action_format not in ("compact", "tagged"):
            raise ValueError(f"unknown action_format {action_format!r}")

    def __init__(self, max_turns: int = 4, max_operand: int = 10,
                 ops: tuple[str, ...] = ("plus", "minus", "times"),
                 action_format: ActionFormat = "compact", format_penalty: float = 0.1,
                 tool_cost: float = 0.0):
        self.check_config(max_turns=max_turns, max_operand=max_operand, ops=ops,
                          action_format=action_format)
        self.max_turns, self.max_operand, self.ops = max_turns, max_operand, tuple(ops)
        self.action_format: ActionFormat = action_format
        self.format_penalty, self.tool_cost = format_penalty, tool_cost
        self._question, self._answer = "what is 0 plus 0 ?", 0
        self._turn = 0
        self._format_errors = 0
        self._tool_calls = 0

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        op = rng.choice(self.ops)
        if op == "divided by":
            # quotient drawn first so the answer is whole and both operands stay in range
            b = rng.randint(1, self.max_operand)
            a = b * rng.randint(0, self.max_operand // b)
            answer = a // b
        else:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            if op == "minus" and a < b:
                a, b = b, a  # non-negative answers: the tiny policy has no token for "-"
            answer = a + b if op == "plus" else a - b if op == "minus" else a * b
        return f"what is {a} {op} {b} ?", answer

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._question, self._answer = self._draw(random.Random(seed))
        self._turn = 0
        self._format_errors = 0
        self._tool_calls = 0
        hint = COMPACT_HINT if self.action_format == "compact" else TAGGED_HINT
        return f"{INTRO} {hint} {self._question}", {"success": False, "question": self._question}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._turn += 1
        parsed = parse_action(action, self.action_format)
        reward, terminated, success = 0.0, False, False
        if parsed is None:
            self._format_errors += 1
            reward = -self.format_penalty
            obs = f"invalid action . {self._question}"
        elif parsed[0] == "calc":
            self._tool_calls += 1
            reward = 0.0 - self.tool_cost  # not -0.0 when calls are free
            try:
                obs = f"tool result : {format_number(calculate(parsed[1]))}"
            except CalculatorError as e:
                obs = f"tool error : {e.reason}"
        else:
            terminated = True
            success = is_correct(parsed[1], self._answer)
            reward = 1.0 if success else 0.0
            obs = "correct" if success else "wrong answer"
        truncated = not terminated and self._turn >= self.max_turns
        # answer, format, penalty and cost let a rule-based verifier re-score the replies (verify)
        info = {"success": success, "format_errors": self._format_errors, "turns": self._turn,
                "format_error": parsed is None, "tool_calls": self._tool_calls,
                "format_penalty": self.format_penalty, "tool_cost": self.tool_cost,
                "answer": self._answer, "question": self._question,
                "action_format": self.action_format, "max_turns": self.max_turns}
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        pass


def verify(item: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Re-score a tool-use trajectory from its replies: 1 if the first answer equals
    ``info.answer``, minus ``format_penalty`` per malformed reply and ``tool_cost`` per calculator
    call before it. Needs ``info.answer``; reads ``action_format``, ``format_penalty``,
    ``tool_cost`` and ``max_turns`` from ``info`` when present."""
    info = item["info"]
    reference = float(info["answer"])
    action_format = info.get("action_format", "compact")
    penalty = float(info.get("format_penalty", 0.0))
    cost = float(info.get("tool_cost", 0.0))
    responses = list(item["responses"])
    if info.get("max_turns") is not None:
        responses = responses[:int(info["max_turns"])]  # the env never reads past its last turn
    success, format_errors, tool_calls = False, 0, 0
    for text in responses:
        parsed = parse_action(text, action_format)
        if parsed is None:
            format_errors += 1
        elif parsed[0] == "calc":
            tool_calls += 1
        else:
            success = is_correct(parsed[1], reference)
            break
    return float(success) - penalty * format_errors - cost * tool_calls, {
        "success": success, "format_errors": format_errors,
        "agrees_with_env": success == bool(info.get("success", False))}
