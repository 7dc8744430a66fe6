"""Word answers: a one-turn question whose answer is scored by meaning, not by exact match.

Each seed draws a question from a small bank (``what animal barks ?`` → ``dog``). The environment
returns no reward of its own: the reference answer travels in ``info.reference`` and a
model-based reward (:func:`tasks.reward_models.answer_similarity`, sentence embeddings) scores the
answer against it, so ``puppy`` earns partial credit where ``seven`` earns little. ``success`` is
an exact match. The answer is the whole reply (``compact``) or the text inside
``<answer>…</answer>`` (``tagged``, the style of pretrained instruction models); a reply without
an answer is a format error.
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal

QUESTIONS: tuple[tuple[str, str], ...] = (
    ("what color is the sky ?", "blue"),
    ("what color is grass ?", "green"),
    ("what color is snow ?", "white"),
    ("what animal barks ?", "dog"),
    ("what animal says meow ?", "cat"),
    ("what is frozen water ?", "ice"),
    ("what shines in the day ?", "sun"),
    ("what is the opposite of hot ?", "cold"),
    ("what is the opposite of up ?", "down"),
    ("what fruit is red ?", "apple"),
)
# The words of questions, answers and near misses (puppy for dog), for the tiny policy's tokenizer.
VOCAB: tuple[str, ...] = tuple(dict.fromkeys(
    "what color is sky grass snow animal barks says meow frozen water shines day opposite of "
    "hot blue green white dog cat ice sun cold apple fruit red puppy kitten yellow black night "
    "moon warm fish bird tree banana".split()))

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
MAX_ANSWER_CHARS = 256


def parse_answer(text: str, style: Literal["compact", "tagged"] = "compact") -> str | None:
    """The answer in ``text``, or None if there is none (empty, oversized, untagged)."""
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    if style == "tagged":
        m = _ANSWER_RE.search(text)
        text = m.group(1) if m else ""
    answer = " ".join(text.split())
    return answer or None


class WordAnswer:
    """One-turn question answering scored by a reward model (see module docstring)."""

    @staticmethod
    def check_config(max_turns: int = 1, **_) -> None:
        """Argument checks, run by the config loader without building an instance."""
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")

    def __init__(self, max_turns: int = 1, answer_style: Literal["compact", "tagged"] = "compact",
                 format_penalty: float = 0.0):
        self.check_config(max_turns=max_turns)
        self.max_turns, self.answer_style, self.format_penalty = max_turns, answer_style, format_penalty
        self._question, self._reference = QUESTIONS[0]
        self._turn = 0
        self._format_errors = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._question, self._reference = random.Random(seed).choice(QUESTIONS)
        self._turn = 0
        self._format_errors = 0
        hint = "reply with one word" if self.answer_style == "compact" else \
            "reply as <answer>word</answer>"
        return f"{self._question} {hint}", {"success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._turn += 1
        answer = parse_answer(action, self.answer_style)
        reward = 0.0
        if answer is None:
            self._format_errors += 1
            reward = -self.format_penalty
        terminated = answer is not None
        truncated = not terminated and self._turn >= self.max_turns
        info = {"success": answer is not None and answer.lower() == self._reference,
                "format_errors": self._format_errors, "turns": self._turn,
                "format_error": answer is None, "reference": self._reference,
                "answer": answer}
        obs = "thanks" if terminated else f"invalid answer . {self._question}"
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        pass
