"""Sokoban as a multi-turn text environment: push every box onto a target in a small room.

Each reset seed draws a level deterministically (``random.Random(seed)``): a room of
``width`` x ``height`` cells counting the outer wall, a few interior walls, ``boxes`` boxes, as
many targets, and the player. A draw is kept only if a breadth-first search over (player, boxes)
states finds a solution of at least ``MIN_PUSHES`` push within ``max_turns`` moves; otherwise the
next draw from the same generator is tried, up to a cap, so every level is solvable and unsolved,
and an impossible parameter set raises instead of looping.

The agent answers each turn with a move (``left``, ``down``, ``right``, ``up``): the reply starts
with it (``compact``) or holds it in ``<answer>…</answer>`` (``tagged``). A malformed reply is a
format error: the turn is spent, nothing moves, and the step reward is ``-format_penalty``. A move
into a wall, or against a box with a wall or another box behind it, is a legal no-op. Every valid
move costs ``step_penalty``; placing the last box on a target pays 1 and ends the episode. A step
after the episode ended (solved or ``max_turns`` reached) raises ``RuntimeError``.

Observations use only the words of :data:`VOCAB`, one word per grid cell (``W`` wall, ``F``
floor, ``P`` player, ``B`` box, ``T`` target, ``X`` box on target, ``Q`` player on target), rows
separated by ``/``, so the tiny policy's word-level tokenizer knows every token.

Held-out evaluation: :meth:`Sokoban.eval_seed` maps ``i < eval_seeds`` to
``EVAL_SEED_OFFSET + i``. The trainer draws training seeds below ``10**6``, so evaluation levels
are never trained on.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from tasks.envs.base import EVAL_SEED_OFFSET

Pos = tuple[int, int]  # (row, col)

MOVES: dict[str, Pos] = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
_COMPACT_RE = re.compile(r"^\s*(left|down|right|up)\b", re.IGNORECASE)
_TAGGED_RE = re.compile(r"<answer>\s*(left|down|right|up)\s*</answer>", re.IGNORECASE)
MAX_ACTION_CHARS = 256

MAX_SOLVER_STATES = 200_000
MAX_GENERATION_TRIES = 500
# One push suffices: about a third of one-box draws need exactly one, and those easy levels give
# a policy trained from scratch its first successes.
MIN_PUSHES = 1
MIN_SIDE, MAX_SIDE = 4, 12

INTRO = "sokoban : push every box B onto a target T . move left down right up"
STATUS = {"moved": "moved", "blocked": "blocked", "invalid": "invalid action", "solved": "solved"}
CELL_WORDS = ("W", "F", "P", "B", "T", "X", "Q")
# Every word an observation can contain; each is one whole-word token of tasks.tiny_tokenizer.
VOCAB: tuple[str, ...] = tuple(dict.fromkeys(
    INTRO.split() + " ".join(STATUS.values()).split() + list(CELL_WORDS) + ["/", "."]))


def parse_action(text: str, action_format: Literal["compact", "tagged"] = "compact") -> str | None:
    """The move word (lower case) in ``text``, or None if it is empty, oversized or malformed."""
    if action_format not in ("compact", "tagged"):
        raise ValueError(f"action_format must be 'compact' or 'tagged', not {action_format!r}")
    if not text or len(text) > MAX_ACTION_CHARS:
        return None
    m = _COMPACT_RE.match(text) if action_format == "compact" else _TAGGED_RE.search(text)
    return m.group(1).lower() if m else None


@dataclass(frozen=True)
class Level:
    """A Sokoban position; ``walls`` includes the outer border."""

    walls: frozenset[Pos]
    boxes: frozenset[Pos]
    targets: frozenset[Pos]
    player: Pos
    width: int
    height: int

    @property
    def solved(self) -> bool:
        return self.boxes <= self.targets

    def open(self, pos: Pos) -> bool:
        """Inside the grid and not a wall (a level need not have a full border)."""
        r, c = pos
        return 0 <= r < self.height and 0 <= c < self.width and pos not in self.walls


def _step(level: Level, player: Pos, boxes: frozenset[Pos],
          move: str) -> tuple[Pos, frozenset[Pos]]:
    """Standard Sokoban move; an impossible move returns the state unchanged."""
    dr, dc = MOVES[move]
    nxt = (player[0] + dr, player[1] + dc)
    if not level.open(nxt):
        return player, boxes
    if nxt in boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if not level.open(beyond) or beyond in boxes:
            return player, boxes
        return nxt, (boxes - {nxt}) | {beyond}
    return nxt, boxes


def _dead_cells(level: Level) -> set[Pos]:
    """Open non-target cells in a corner: a box pushed there can never leave, so the solver prunes
    those states without changing which levels it can solve."""
    dead = set()
    for r in range(level.height):
        for c in range(level.width):
            pos = (r, c)
            if not level.open(pos) or pos in level.targets:
                continue
            vertical = not level.open((r - 1, c)) or not level.open((r + 1, c))
            horizontal = not level.open((r, c - 1)) or not level.open((r, c + 1))
            if vertical and horizontal:
                dead.add(pos)
    return dead


def solve(level: Level, max_moves: int | None = None,
          max_states: int = MAX_SOLVER_STATES) -> list[str] | None:
    """A shortest move list (action words) that solves ``level`` by breadth-first search over
    (player, boxes) states; ``[]`` if it is already solved, None if no solution has at most
    ``max_moves`` moves or the search would visit more than ``max_states`` states."""
    if level.solved:
        return []
    w = level.width
    names = list(MOVES)
    # cells as flat indices with a neighbour table (-1: wall or outside): several times faster
    # than tuple arithmetic, which matters for the larger rooms
    adj = [[(r + dr) * w + c + dc if level.open((r + dr, c + dc)) else -1
            for dr, dc in MOVES.values()]
           for r in range(level.height) for c in range(w)]
    dead = {r * w + c for r, c in _dead_cells(level)}
    targets = frozenset(r * w + c for r, c in level.targets)
    start = (level.player[0] * w + level.player[1],
             frozenset(r * w + c for r, c in level.boxes))
    parent: dict[tuple[int, frozenset[int]], tuple[Any, int] | None] = {start: None}
    frontier = [start]
    depth = 0
    while frontier and (max_moves is None or depth < max_moves):
        depth += 1
        nxt_frontier = []
        for state in frontier:
            player, boxes = state
            for m, cell in enumerate(adj[player]):
                if cell < 0:
                    continue
                if cell in boxes:
                    beyond = adj[cell][m]
                    if beyond < 0 or beyond in boxes or beyond in dead:
                        continue
                    new = (cell, (boxes - {cell}) | {beyond})
                else:
                    new = (cell, boxes)
                if new in parent:
                    continue
                parent[new] = (state, m)
                if new[1] <= targets:
                    moves = []
                    while parent[new] is not None:
                        new, m = parent[new]
                        moves.append(names[m])
                    return moves[::-1]
                if len(parent) > max_states:
                    return None
                nxt_frontier.append(new)
        frontier = nxt_frontier
    return None


def count_pushes(level: Level, moves: Iterable[str]) -> int:
    """How many of ``moves`` push a box when played from the start of ``level``."""
    player, boxes, pushes = level.player, level.boxes, 0
    for move in moves:
        player, new_boxes = _step(level, player, boxes, move)
        pushes += new_boxes != boxes
        boxes = new_boxes
    return pushes


def generate_level(seed: int | None, width: int = 6, height: int = 6, boxes: int = 1,
                   max_moves: int | None = 20) -> Level:
    """The level of ``seed``: draws until one is unsolved and solvable in at most ``max_moves``
    moves; raises ValueError if ``MAX_GENERATION_TRIES`` draws all fail (impossible parameters)."""
    rng = random.Random(seed)
    border = {(r, c) for r in range(height) for c in range(width)
              if r in (0, height - 1) or c in (0, width - 1)}
    interior = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
    # a few interior walls give variety while leaving room to move (none in the smallest rooms)
    max_inner = max(0, (len(interior) - (2 * boxes + 1)) // 6)
    for _ in range(MAX_GENERATION_TRIES):
        inner = set(rng.sample(interior, rng.randint(0, max_inner)))
        free = [p for p in interior if p not in inner]
        cells = rng.sample(free, 2 * boxes + 1)
        level = Level(walls=frozenset(border | inner), boxes=frozenset(cells[:boxes]),
                      targets=frozenset(cells[boxes:2 * boxes]), player=cells[-1],
                      width=width, height=height)
        solution = solve(level, max_moves=max_moves)
        if solution and count_pushes(level, solution) >= MIN_PUSHES:
            return level
    raise ValueError(f"no solvable {width}x{height} level with {boxes} box(es) within "
                     f"{max_moves} moves after {MAX_GENERATION_TRIES} draws (seed {seed}); "
                     "use a larger room or more max_turns")


def render(level: Level, player: Pos | None = None, boxes: Iterable[Pos] | None = None) -> str:
    """The grid row by row, one word per cell, rows separated by ``/``."""
    player = level.player if player is None else player
    boxes = level.boxes if boxes is None else frozenset(boxes)
    rows = []
    for r in range(level.height):
        row = []
        for c in range(level.width):
            pos = (r, c)
            on_target = pos in level.targets
            if pos in level.walls:
                row.append("W")
            elif pos in boxes:
                row.append("X" if on_target else "B")
            elif pos == player:
                row.append("Q" if on_target else "P")
            else:
                row.append("T" if on_target else "F")
        rows.append(" ".join(row))
    return " / ".join(rows)


class Sokoban:
    """Sokoban with text observations over generated, verified-solvable levels (see module
    docstring)."""

    quick_step = True  # steps in the worker's own code, waiting for nothing (tasks/envs/base.py)

    @staticmethod
    def check_config(width: int = 6, height: int = 6, boxes: int = 1, max_turns: int = 20,
                     format_penalty: float = 0.1, step_penalty: float = 0.0,
                     action_format: str = "compact", eval_seeds: int = 64, **_) -> None:
        """Argument checks, run by the config loader without building an instance."""
        for name, side in (("width", width), ("height", height)):
            if not MIN_SIDE <= side <= MAX_SIDE:
                raise ValueError(f"{name} must be in [{MIN_SIDE}, {MAX_SIDE}] (outer wall "
                                 f"included), not {side}")
        if boxes not in (1, 2):
            raise ValueError(f"boxes must be 1 or 2, not {boxes}")
        if (width - 2) * (height - 2) < 2 * boxes + 1:
            raise ValueError(f"a {width}x{height} room has no space for {boxes} box(es), "
                             "as many targets and the player")
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        if format_penalty < 0 or step_penalty < 0:
            raise ValueError("format_penalty and step_penalty must be non-negative")
        if action_format not in ("compact", "tagged"):
            raise ValueError(f"action_format must be 'compact' or 'tagged', not {action_format!r}")
        if eval_seeds < 0:
            raise ValueError("eval_seeds must be non-negative")

    def __init__(self, width: int = 6, height: int = 6, boxes: int = 1, max_turns: int = 20,
                 format_penalty: float = 0.1, step_penalty: float = 0.0,
                 action_format: Literal["compact", "tagged"] = "compact", eval_seeds: int = 64):
        self.check_config(width=width, height=height, boxes=boxes, max_turns=max_turns,
                          format_penalty=format_penalty, step_penalty=step_penalty,
                          action_format=action_format, eval_seeds=eval_seeds)
        self.width, self.height, self.boxes = width, height, boxes
        self.max_turns = max_turns
        self.format_penalty, self.step_penalty = format_penalty, step_penalty
        self.action_format = action_format
        self.eval_seeds = eval_seeds
        # one draw up front, so parameters no level can satisfy fail here rather than mid-rollout
        self._level = self._generate(0)
        self._level_seed = 0
        self._player, self._boxes = self._level.player, self._level.boxes
        self._turn = 0
        self._format_errors = 0
        self._done = False

    def eval_seed(self, i: int) -> int:
        """The seed of held-out level ``i`` (``0 <= i < eval_seeds``), above every training seed."""
        if not 0 <= i < self.eval_seeds:
            raise ValueError(f"eval level index must be in [0, {self.eval_seeds}), not {i}")
        return EVAL_SEED_OFFSET + i

    @property
    def level(self) -> Level:
        """The level as generated by the last reset (its start position)."""
        return self._level

    def _generate(self, seed: int | None) -> Level:
        return generate_level(seed, self.width, self.height, self.boxes, max_moves=self.max_turns)

    def _on_target(self) -> int:
        return len(self._boxes & self._level.targets)

    def _info(self, format_error: bool) -> dict[str, Any]:
        return {"success": self._boxes <= self._level.targets, "format_errors": self._format_errors,
                "turns": self._turn, "format_error": format_error,
                "boxes_on_target": self._on_target(), "format_penalty": self.format_penalty,
                "level_seed": self._level_seed,
                # what a verifier needs to rebuild the level and replay the episode
                "env_kwargs": {"width": self.width, "height": self.height, "boxes": self.boxes,
                               "max_turns": self.max_turns, "format_penalty": self.format_penalty,
                               "step_penalty": self.step_penalty,
                               "action_format": self.action_format}}

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        # an unseeded reset still records which level it drew, below the evaluation seeds
        self._level_seed = random.randrange(EVAL_SEED_OFFSET) if seed is None else seed
        self._level = self._generate(self._level_seed)
        self._player, self._boxes = self._level.player, self._level.boxes
        self._turn = 0
        self._format_errors = 0
        self._done = False
        grid = render(self._level, self._player, self._boxes)
        return f"{INTRO} . {grid}", self._info(False)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        # a solved level would otherwise pay its reward again on every later step
        if self._done:
            raise RuntimeError("the episode is over; call reset")
        self._turn += 1
        move = parse_action(action, self.action_format)
        reward, terminated = 0.0, False
        if move is None:
            self._format_errors += 1
            reward = -self.format_penalty
            status = STATUS["invalid"]
        else:
            player, boxes = _step(self._level, self._player, self._boxes, move)
            status = STATUS["moved" if player != self._player else "blocked"]
            self._player, self._boxes = player, boxes
            reward = -self.step_penalty
            if boxes <= self._level.targets:
                reward += 1.0
                terminated = True
                status = STATUS["solved"]
        truncated = not terminated and self._turn >= self.max_turns
        self._done = terminated or truncated
        obs = f"{status} . {render(self._level, self._player, self._boxes)}"
        return obs, reward, terminated, truncated, self._info(move is None)

    def close(self) -> None:
        pass
