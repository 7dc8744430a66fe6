"""FrozenLake (gymnasium, not slippery by default) as a multi-turn text environment.

The agent answers each turn with a move (``left``, ``down``, ``right``, ``up``): the reply starts
with it (``action_format: compact``, what a tiny policy trained from scratch learns) or carries it
as ``<answer>up</answer>`` (``tagged``, the style of pretrained instruction models). Anything
else is a format error: the turn is spent, the agent does not move, and the step reward is
``-format_penalty``. Reaching the goal pays 1 and ends the episode; a hole ends it with 0.

``map_name`` is a gymnasium map (``4x4``, ``8x8``: the same map every episode) or ``random``: a
new map per reset seed (``size`` x ``size``, a share ``p_frozen`` of frozen cells), which
gymnasium's generator guarantees to have a path from S to G; held-out seeds then give unseen maps.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from tasks.components import IMPORT_LOCK

ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}
_ACTION_RE = re.compile(r"^\s*(left|down|right|up)\b", re.IGNORECASE)
_TAGGED_RE = re.compile(r"<answer>\s*(left|down|right|up)\s*</answer>", re.IGNORECASE)
MAX_ACTION_CHARS = 256
ActionFormat = Literal["compact", "tagged"]


def parse_action(text: str, action_format: ActionFormat = "compact") -> int | None:
    """The action of the text (compact: its first word; tagged: inside <answer>…</answer>),
    or None if it is malformed."""
    if not text or len(text) > MAX_ACTION_CHARS:
        return None
    m = (_ACTION_RE.match(text) if action_format == "compact" else _TAGGED_RE.search(text))
    return ACTIONS[m.group(1).lower()] if m else None


class FrozenLakeText:
    """FrozenLake with text observations: ``position`` (row and column), ``cell`` (the cell's
    index, the easiest for a policy trained from scratch) or ``grid`` (the whole map)."""

    quick_step = True  # steps in the worker's own code, waiting for nothing (tasks/envs/base.py)

    def __init__(self, map_name: str = "4x4", is_slippery: bool = False, max_turns: int = 10,
                 format_penalty: float = 0.1,
                 observation: Literal["position", "cell", "grid"] = "position",
                 action_format: ActionFormat = "compact", size: int = 4, p_frozen: float = 0.8):
        self.check_config(map_name=map_name, observation=observation,
                          action_format=action_format, size=size, p_frozen=p_frozen)
        self.map_name, self.is_slippery, self.size, self.p_frozen = map_name, is_slippery, size, p_frozen
        self._make(None if map_name == "random" else map_name, None)
        self.max_turns = max_turns
        self.format_penalty = format_penalty
        self.observation = observation
        self.action_format = action_format
        self._state = 0
        self._turn = 0
        self._format_errors = 0

    @staticmethod
    def check_config(map_name: str = "4x4", observation: str = "position",
                     action_format: str = "compact", size: int = 4, p_frozen: float = 0.8,
                     **_) -> None:
        """Argument checks, run by the config loader without building an instance."""
        if action_format not in ("compact", "tagged"):
            raise ValueError(f"action_format must be compact or tagged, got {action_format!r}")
        if map_name == "random" and not (2 <= size <= 12 and 0 < p_frozen <= 1):
            raise ValueError("a random map needs 2 <= size <= 12 and 0 < p_frozen <= 1")
        if map_name == "random" and observation != "grid":
            raise ValueError("a random map needs observation: grid (the agent must see the map)")

    def _describe(self) -> str:
        row, col = divmod(self._state, self.ncol)
        if self.observation == "cell":
            return f"you are at cell {self._state}"
        if self.observation == "grid":
            cells = [["P" if r * self.ncol + c == self._state else ch for c, ch in enumerate(line)]
                     for r, line in enumerate(self._desc)]
            return " / ".join(" ".join(line) for line in cells)
        return f"you are at row {row} col {col}"

    def _make(self, map_name: str | None, seed: int | None) -> None:
        # imported here, so the reward verifier can import parse_action without gymnasium
        with IMPORT_LOCK:
            import gymnasium as gym
            from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        if map_name is None:
            desc = generate_random_map(size=self.size, p=self.p_frozen, seed=seed)
            self._env = gym.make("FrozenLake-v1", desc=desc, is_slippery=self.is_slippery)
        else:
            self._env = gym.make("FrozenLake-v1", map_name=map_name, is_slippery=self.is_slippery)
        self._desc = [[c.decode() for c in row] for row in self._env.unwrapped.desc]
        self.ncol = len(self._desc[0])

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if self.map_name == "random":  # a new map per seed
            self._env.close()
            self._make(None, seed)
        self._state, _ = self._env.reset(seed=seed)
        self._turn = 0
        self._format_errors = 0
        intro = "frozen lake : reach the goal G without falling into a hole H . move left down right up"
        return f"{intro} . {self._describe()}", {"success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._turn += 1
        a = parse_action(action, self.action_format)
        reward, terminated = 0.0, False
        if a is None:
            self._format_errors += 1
            reward = -self.format_penalty
            obs = f"invalid action . {self._describe()}"
        else:
            self._state, r, terminated, _, _ = self._env.step(a)
            reward = float(r)
            row, col = divmod(self._state, self.ncol)
            cell = self._desc[row][col]
            obs = ("reached the goal" if cell == "G" else "fell in a hole" if cell == "H"
                   else self._describe())
        success = terminated and reward > 0
        truncated = not terminated and self._turn >= self.max_turns
        # map and penalty let a rule-based verifier replay the episode (tasks.rewards)
        info = {"success": success, "format_errors": self._format_errors, "turns": self._turn,
                "format_error": a is None, "map": ["".join(r) for r in self._desc],
                "format_penalty": self.format_penalty, "action_format": self.action_format}
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        self._env.close()
