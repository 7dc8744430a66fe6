"""Guess the number: information arrives over turns as higher/lower replies.

The secret is drawn from ``[low, high]`` by the reset seed. The agent answers with a number; a
reply that is not a number in range is a format error (``-format_penalty``, turn spent).
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal

_NUM_RE = re.compile(r"^\s*(-?\d{1,6})\b")
_TAGGED_RE = re.compile(r"<answer>\s*(-?\d{1,6})\s*</answer>", re.IGNORECASE)


def parse_guess(text: str, action_format: Literal["compact", "tagged"] = "compact") -> int | None:
    """The guess (compact: the number the text starts with; tagged: inside <answer>…</answer>),
    or None if it is malformed."""
    if not text or len(text) > 256:
        return None
    m = _NUM_RE.match(text) if action_format == "compact" else _TAGGED_RE.search(text)
    return int(m.group(1)) if m else None


class GuessNumber:
    quick_step = True  # steps in the worker's own code, waiting for nothing (tasks/envs/base.py)

    def __init__(self, low: int = 1, high: int = 8, max_turns: int = 4, format_penalty: float = 0.1,
                 action_format: Literal["compact", "tagged"] = "compact"):
        self.check_config(low=low, high=high, action_format=action_format)
        self.action_format = action_format
        self.low, self.high = low, high
        self.max_turns = max_turns
        self.format_penalty = format_penalty
        self._secret = low
        self._turn = 0
        self._format_errors = 0

    @staticmethod
    def check_config(low: int = 1, high: int = 8, action_format: str = "compact", **_) -> None:
        """Argument checks, run by the config loader without building an instance."""
        if low >= high:
            raise ValueError("low must be below high")
        if action_format not in ("compact", "tagged"):
            raise ValueError(f"action_format must be compact or tagged, got {action_format!r}")

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._secret = random.Random(seed).randint(self.low, self.high)
        self._turn = 0
        self._format_errors = 0
        return f"guess number between {self.low} and {self.high}", {"success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._turn += 1
        guess = parse_guess(action, self.action_format)
        reward, terminated = 0.0, False
        if guess is None or not self.low <= guess <= self.high:
            self._format_errors += 1
            reward = -self.format_penalty
            obs = f"invalid action . guess number between {self.low} and {self.high}"
        elif guess == self._secret:
            reward, terminated, obs = 1.0, True, "correct"
        else:
            obs = "higher" if self._secret > guess else "lower"
        truncated = not terminated and self._turn >= self.max_turns
        # secret, range and penalty let a rule-based verifier check the answer (tasks.rewards)
        info = {"success": terminated, "format_errors": self._format_errors, "turns": self._turn,
                "format_error": guess is None, "secret": self._secret, "low": self.low,
                "high": self.high, "format_penalty": self.format_penalty,
                "action_format": self.action_format}
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        pass
