"""GEM environments (``gem-llm``, "a Gym for agentic LLMs") as :class:`tasks.envs.base.TextEnv`.

Optional: ``pip install -e ".[gem]"``. ``gem`` is imported when a :class:`GemEnv` is built, never
when this module is imported. Config::

    _component_: tasks.envs.gem_adapter.GemEnv
    env_id: game:GuessTheNumber-v0-hard   # any id gem.make knows; extra keys go to gem.make

What GEM (0.1.x) does, and what the adapter makes of it:

* ``gem.make(env_id, **kwargs)`` builds an env; ids carry a level (``game:Sudoku-v0-easy``,
  ``-hard``, ``-random``; there is no bare ``-v0``). ``reset(seed)`` returns ``(text, info)`` and
  ``step(text)`` the gymnasium 5-tuple. Games read the answer from the last ``\\boxed{...}`` of the
  reply (``\\boxed{25}``, ``\\boxed{up}``); single-turn reasoning tasks (``rg:*``) grade the last
  ``\\boxed{...}``.
* Offline: the ``game:`` ids GuessTheNumber, Mastermind, Minesweeper, Sudoku, TowerofHanoi,
  FifteenPuzzle (not ``-random``), Game2048 and Sokoban, and the procedural ``rg:*`` tasks. Wordle,
  Hangman and WordSearch download an NLTK corpus when built, Crosswords needs pandas, and the
  ``math:``/``code:``/``qa:``/``logic:``/``eval:`` ids need ``datasets`` and the Hugging Face hub.
  A GEM env that cannot be built raises from ``GemEnv(...)``.
* Observations: GEM puts the part a player needs every turn (the board, "Enter your next guess.")
  in ``info["suffix"]`` (and sometimes ``info["prefix"]``), and its own observation wrapper appends
  them; so does the adapter, on reset and on every step that does not end the episode
  (``include_suffix=False`` turns it off). Anything that is not a string is passed through ``str``.
* Format errors: GEM has no flag for them. A reply a game cannot parse ends the episode with
  reward ``LanguageGameReward.format_error_reward`` (-0.1; ``gem.utils.constants``); the adapter
  counts a GEM-terminated step with exactly that reward as a format error. A GEM env that raises
  on an action counts as one too: the adapter returns a text saying so, GEM's format penalty and
  ``terminated=True``, and never raises from :meth:`GemEnv.step`. A parsable but illegal move
  (out of range, repeated, into a wall) is GEM's "invalid action": reward 0, the game goes on.
* Success: GEM's info has no success flag for games. The rule, in order:

  1. a bool ``success`` or ``correct`` in GEM's info (the dataset envs set ``correct``) decides;
  2. otherwise only a step that GEM ends (its ``terminated``), and that is not a format error, can
     succeed: with ``success_reward`` given, when its reward is at least ``success_reward``; with
     ``success_reward=None`` (the default), when its text has GEM's win message
     ("Congratulations!", which every GEM game sends only on a win) or its reward is at least
     ``LanguageGameReward.success_reward`` (1.0; what ``rg:*`` pays for a right answer). Games
     with shaped rewards (Wordle, Minesweeper, Sudoku...) pay less than 1 on the winning step and
     GuessTheNumber pays partial credit when its turns run out, so a threshold alone would
     misjudge them; ``success_reward`` is for counting such partial credit as success on purpose.

* Turn limits: GEM ends an episode at its own limit with ``terminated=True, truncated=True``; the
  adapter reports that as ``terminated=False, truncated=True`` (a time limit, as the project's
  envs do) unless the step succeeded or was a format error. Single-turn tasks, which GEM also ends
  with both flags, are ``terminated=True, truncated=False``. ``max_turns`` (default: the GEM env's
  own limit, re-read at every reset since ``-random`` ids draw it per episode; 20 if it has none)
  truncates an episode GEM has not ended; it can shorten an episode, never lengthen one past GEM's
  limit, and GEM's instructions still quote GEM's limit.
* Randomness: GEM seeds and draws from the process-wide ``random`` and ``numpy.random``. The
  adapter gives each instance its own copy of that state, swapped in around every GEM call under a
  module lock, so a reset does not reseed the worker's other code and interleaved instances stay
  reproducible per seed. Seeds are taken modulo 2**32 (numpy's range).
* ``info`` always has ``success`` (bool), ``format_errors`` (count in this episode),
  ``format_error`` (this step), ``turns``, and ``gem``: GEM's own info keys whose values are
  JSON-serialisable (others are dropped). A step after the episode ended, or before any reset,
  calls nothing in GEM: it returns a notice, reward 0 and ``terminated=True``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks.components import IMPORT_LOCK

logger = logging.getLogger(__name__)

EXTRA_HINT = 'pip install -e ".[gem]"'
DEFAULT_MAX_TURNS = 20
WIN_MESSAGE = "Congratulations!"
SUCCESS_FLAGS = ("success", "correct")
ENDED_TEXT = "The episode is over: call reset() to start a new one."

# GEM's games draw from the global RNGs: one instance at a time swaps its own state in.
_GEM_LOCK = threading.RLock()


def _import_gem() -> Any:
    """``import gem`` (gem-llm), without its ``logging.basicConfig(level=INFO)`` taking over a
    root logger that has no handler yet."""
    with IMPORT_LOCK:  # an env worker creates a cohort's environments from many threads
        root = logging.getLogger()
        guard = None
        if not root.handlers:
            guard = logging.NullHandler()
            root.addHandler(guard)
        try:
            import gem
        except ImportError as exc:
            raise ImportError(
                f"GemEnv needs the optional extra 'gem' (gem-llm): {EXTRA_HINT} ({exc})") from exc
        finally:
            if guard is not None:
                root.removeHandler(guard)
    if not callable(getattr(gem, "make", None)):
        raise ImportError(
            f"the installed 'gem' module is not gem-llm (it has no gem.make): {EXTRA_HINT}")
    return gem


def _json_safe(info: Any) -> dict[str, Any]:
    """GEM's info keys whose values survive ``json.dumps``; the others are dropped."""
    if not isinstance(info, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in info.items():
        if not isinstance(key, str):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError, OverflowError, RecursionError):
            continue
        out[key] = value
    return out


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:  # an observation must never make the adapter raise
        return f"<unprintable {type(value).__name__}>"


def _as_reward(value: Any) -> float:
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return 0.0
    return reward if math.isfinite(reward) else 0.0


def _explicit_success(info: Any) -> bool | None:
    """GEM's own verdict: a bool (or numpy bool) ``success``/``correct`` in its info."""
    import numpy as np

    if isinstance(info, dict):
        for key in SUCCESS_FLAGS:
            value = info.get(key)
            if isinstance(value, (bool, np.bool_)):
                return bool(value)
    return None


class GemEnv:
    """One GEM environment as a :class:`~tasks.envs.base.TextEnv` (see the module docstring).

    ``env_id`` and ``env_kwargs`` go to ``gem.make``. ``max_turns``: our turn limit (default: the
    GEM env's own, else 20). ``success_reward``: count a GEM-ended step with at least this reward
    as a success (default: GEM's win message or a reward of 1.0). ``include_suffix``: append
    GEM's per-turn ``info["prefix"]``/``info["suffix"]`` to observations, as GEM's wrappers do.
    """

    @staticmethod
    def check_config(env_id: str = "", max_turns: int | None = None, **_) -> None:
        """Argument checks, run by the config loader without building an instance."""
        if max_turns is not None and max_turns < 1:
            raise ValueError("max_turns must be at least 1")

    def __init__(self, env_id: str, max_turns: int | None = None,
                 success_reward: float | None = None, include_suffix: bool = True,
                 **env_kwargs: Any):
        gem = _import_gem()
        import numpy as np  # a dependency of gem-llm (and of this project)

        self._np = np
        try:
            with IMPORT_LOCK:
                from gem.utils.constants import LanguageGameReward
            self.format_error_reward = float(LanguageGameReward.format_error_reward)
            self.win_reward = float(LanguageGameReward.success_reward)
        except (ImportError, AttributeError, TypeError, ValueError):
            self.format_error_reward, self.win_reward = -0.1, 1.0
        if max_turns is not None and max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.env_id = env_id
        self.success_reward = success_reward
        self.include_suffix = include_suffix
        self._fixed_max_turns = max_turns
        self._rng: tuple[Any, Any] | None = None  # this instance's (random, numpy) state
        self._turns = 0
        self._format_errors = 0
        self._done = True  # until reset
        self._closed = False
        with self._own_rng():
            self._env = gem.make(env_id, **env_kwargs)
        self.max_turns = self._resolve_max_turns()

    @property
    def gem_env(self) -> Any:
        """The GEM env itself (unwrapped)."""
        return getattr(self._env, "unwrapped", self._env)

    def _gem_max_turns(self) -> int | None:
        limit = getattr(self.gem_env, "max_turns", None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit
        return None

    def _resolve_max_turns(self) -> int:
        if self._fixed_max_turns is not None:
            return int(self._fixed_max_turns)
        return self._gem_max_turns() or DEFAULT_MAX_TURNS

    @contextmanager
    def _own_rng(self) -> Iterator[None]:
        np_random = self._np.random
        with _GEM_LOCK:
            outer = (random.getstate(), np_random.get_state())
            try:
                if self._rng is None:  # a fresh instance: fresh entropy, not the caller's stream
                    random.seed()
                    np_random.seed()
                else:
                    random.setstate(self._rng[0])
                    np_random.set_state(self._rng[1])
                yield
            finally:
                self._rng = (random.getstate(), np_random.get_state())
                random.setstate(outer[0])
                np_random.set_state(outer[1])

    def _observation(self, obs: Any, gem_info: Any, done: bool) -> str:
        text = _as_text(obs)
        if self.include_suffix and not done and isinstance(gem_info, dict):
            prefix, suffix = gem_info.get("prefix"), gem_info.get("suffix")
            if isinstance(suffix, str) and suffix:
                if text and not text.endswith("\n"):
                    text += "\n"
                text += suffix
            if isinstance(prefix, str):
                text = prefix + text
        return text

    def _info(self, success: bool, format_error: bool, gem_info: Any) -> dict[str, Any]:
        return {"success": success, "format_errors": self._format_errors, "turns": self._turns,
                "format_error": format_error, "gem": _json_safe(gem_info)}

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if seed is not None:
            seed = int(seed) % 2**32
        with self._own_rng():
            obs, gem_info = self._env.reset(seed=seed)
        self._turns = 0
        self._format_errors = 0
        self._done = False
        self.max_turns = self._resolve_max_turns()
        return self._observation(obs, gem_info, done=False), self._info(False, False, gem_info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            return ENDED_TEXT, 0.0, True, False, self._info(False, False, {})
        if not isinstance(action, str):
            action = "" if action is None else _as_text(action)
        self._turns += 1
        try:
            with self._own_rng():
                obs, reward, g_term, g_trunc, gem_info = self._env.step(action)
            reward = _as_reward(reward)
            g_term, g_trunc = bool(g_term), bool(g_trunc)
            format_error = g_term and math.isclose(reward, self.format_error_reward)
        except Exception as exc:  # the env must never raise on a reply
            logger.debug("GEM env %s raised on an action", self.env_id, exc_info=True)
            obs = f"The environment could not process this action ({type(exc).__name__})."
            reward, g_term, g_trunc, gem_info = self.format_error_reward, True, False, {}
            format_error = True
        if format_error:
            self._format_errors += 1

        explicit = _explicit_success(gem_info)
        if explicit is not None:
            success = explicit and not format_error
        elif not g_term or format_error:
            success = False
        elif self.success_reward is not None:
            success = reward >= self.success_reward
        else:
            success = WIN_MESSAGE in _as_text(obs) or reward >= self.win_reward

        gem_limit = self._gem_max_turns()
        at_gem_limit = gem_limit is not None and self._turns >= gem_limit
        ended_by_gem_limit = (g_term and g_trunc and at_gem_limit and not success
                              and not format_error)
        terminated = g_term and not ended_by_gem_limit
        truncated = (not terminated) and (g_trunc or ended_by_gem_limit
                                          or self._turns >= self.max_turns)
        self._done = terminated or truncated
        info = self._info(bool(success), format_error, gem_info)
        return self._observation(obs, gem_info, self._done), reward, terminated, truncated, info

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._done = True
        close = getattr(self._env, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # closing is best effort
                logger.warning("closing GEM env %s failed", self.env_id, exc_info=True)
