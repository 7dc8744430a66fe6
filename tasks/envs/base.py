"""The environment Protocol: the GEM text API (``reset(seed) -> (obs, info)``,
``step(action_text) -> (obs, reward, terminated, truncated, info)``).

An environment parses the policy's raw text itself: an action it cannot parse costs a format
penalty and the turn, and never raises. ``info`` of the final step carries ``success``.

Optionally, a static or class method ``check_config(**kwargs)`` checks constructor arguments
without building an instance: the config loader calls it, so a bad value fails at start-up while
environments are only ever built on the workers.
Optionally, a class attribute ``quick_step = True`` says that a step runs in the worker's own
code, briefly, and waits for nothing (no remote service, no long compute): a stage task then steps
its cohort's members one after another instead of a thread each (``tasks/cohort.py``). It counts
only on the class that declares it: a subclass, whose ``step`` may wait, declares it again.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

# Held-out evaluation seeds start here; training seeds are drawn below env_tasks.N.seed_range
# (at most this), so evaluation never replays a training episode.
EVAL_SEED_OFFSET = 10**9


def eval_seed(i: int) -> int:
    """The i-th held-out evaluation seed."""
    return EVAL_SEED_OFFSET + i


@runtime_checkable
class TextEnv(Protocol):
    max_turns: int

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    def close(self) -> None: ...
