"""The environment Protocol: the GEM text API (``reset(seed) -> (obs, info)``,
``step(action_text) -> (obs, reward, terminated, truncated, info)``).

An environment parses the policy's raw text itself: an action it cannot parse costs a format
penalty and the turn, and never raises. ``info`` of the final step carries ``success``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TextEnv(Protocol):
    max_turns: int

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    def close(self) -> None: ...
