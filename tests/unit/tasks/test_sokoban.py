"""Sokoban: deterministic solvable levels, parsing, push rules, rewards, vocabulary."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tasks.envs.base import TextEnv
from tasks.envs.sokoban import (
    EVAL_SEED_OFFSET,
    VOCAB,
    Level,
    Sokoban,
    generate_level,
    parse_action,
    solve,
)


def _corridor(player: int = 1, box: int = 2, target: int = 4, length: int = 5) -> Level:
    """A one-row corridor of ``length`` floor cells (columns 1..length) inside a wall border."""
    width, height = length + 2, 3
    walls = frozenset((r, c) for r in range(height) for c in range(width)
                      if r != 1 or c in (0, width - 1))
    return Level(walls=walls, boxes=frozenset({(1, box)}), targets=frozenset({(1, target)}),
                 player=(1, player), width=width, height=height)


def _env_on(level: Level, **kwargs) -> Sokoban:
    """An env reset, then put on a hand-made level (tests of the move rules)."""
    env = Sokoban(**kwargs)
    env.reset(seed=0)
    env._level, env._player, env._boxes = level, level.player, level.boxes
    return env


def _words(obs: str) -> list[str]:
    return obs.split()


def test_follows_protocol():
    env = Sokoban()
    assert isinstance(env, TextEnv)
    obs, info = env.reset(seed=1)
    assert obs.startswith("sokoban : push every box B onto a target T . move left down right up")
    assert info["success"] is False and info["level_seed"] == 1 and info["turns"] == 0
    env.close()
    env.close()


def test_reset_is_deterministic_per_seed():
    env = Sokoban(boxes=2)
    assert env.reset(seed=7) == Sokoban(boxes=2).reset(seed=7)
    assert env.reset(seed=7) == env.reset(seed=7)
    grids = {env.reset(seed=s)[0] for s in range(50)}
    assert len(grids) >= 45


@pytest.mark.parametrize("boxes", [1, 2])
def test_every_level_is_solvable_and_solution_replays(boxes):
    env = Sokoban(boxes=boxes, step_penalty=0.01)
    for seed in range(200):
        obs, _ = env.reset(seed=seed)
        level = env.level
        assert len(level.boxes) == len(level.targets) == boxes
        assert not level.solved and level.player not in level.boxes
        assert level == generate_level(seed, boxes=boxes, max_moves=env.max_turns)
        moves = solve(level)
        assert moves and len(moves) <= env.max_turns, seed
        for i, move in enumerate(moves):
            obs, reward, term, trunc, info = env.step(move)
            assert term is (i == len(moves) - 1) and not trunc and not info["format_error"]
        assert info["success"] and info["boxes_on_target"] == boxes
        assert reward == pytest.approx(1.0 - 0.01) and obs.startswith("solved . ")


@pytest.mark.parametrize("text,fmt,expected", [
    ("up", "compact", "up"), ("  Left now", "compact", "left"), ("DOWN", "compact", "down"),
    ("right.", "compact", "right"), ("jump", "compact", None), ("", "compact", None),
    ("upward", "compact", None), ("go up", "compact", None), ("up" + " " * 300, "compact", None),
    ("<answer>up</answer>", "tagged", "up"),
    ("I push it <answer> Left </answer>", "tagged", "left"),
    ("up", "tagged", None), ("<answer>jump</answer>", "tagged", None),
    ("<answer>up left</answer>", "tagged", None), ("<answer>up", "tagged", None),
    ("", "tagged", None), ("x" * 300 + "<answer>up</answer>", "tagged", None),
])
def test_parser(text, fmt, expected):
    assert parse_action(text, fmt) == expected


def test_tagged_env_rejects_bare_word():
    env = Sokoban(action_format="tagged")
    env.reset(seed=3)
    move = solve(env.level)[0]
    _, r, _, _, info = env.step(move)
    assert info["format_error"] and r == -0.1
    obs, r, _, _, info = env.step(f"<answer>{move}</answer>")
    assert not info["format_error"] and info["format_errors"] == 1 and r == 0.0


def test_push_rules():
    env = _env_on(_corridor(player=1, box=2, target=5))
    obs, r, term, trunc, info = env.step("right")  # pushes the box one cell
    assert env._player == (1, 2) and env._boxes == {(1, 3)} and obs.startswith("moved . ")
    assert obs.endswith("W F P B F T W / W W W W W W W") and r == 0.0 and not term
    env.step("right")
    obs, r, term, trunc, info = env.step("right")
    assert env._boxes == {(1, 5)} and term and not trunc and r == 1.0 and info["success"]
    assert obs == "solved . W W W W W W W / W F F F P X W / W W W W W W W"
    with pytest.raises(RuntimeError):  # no second reward for a solved level
        env.step("left")


def test_walking_off_and_back():
    env = _env_on(_corridor(player=2, box=3, target=5))
    obs, *_ = env.step("left")
    assert env._player == (1, 1) and env._boxes == {(1, 3)} and obs.startswith("moved . ")
    obs, *_ = env.step("left")
    assert obs.startswith("blocked . ") and env._player == (1, 1)


def test_push_into_wall_is_a_legal_noop():
    env = _env_on(_corridor(player=3, box=4, target=1, length=4), format_penalty=0.5)
    obs, r, term, trunc, info = env.step("right")  # wall behind the box
    assert obs.startswith("blocked . ") and r == 0.0 and not term and not trunc
    assert not info["format_error"] and info["format_errors"] == 0 and info["turns"] == 1
    assert env._player == (1, 3) and env._boxes == {(1, 4)}
    obs, *_ = env.step("up")  # straight into the wall
    assert obs.startswith("blocked . ") and env._player == (1, 3)


def test_box_blocked_by_box():
    level = _corridor(player=1, box=2, target=4)
    level = Level(walls=level.walls, boxes=frozenset({(1, 2), (1, 3)}),
                  targets=frozenset({(1, 4), (1, 5)}), player=(1, 1), width=level.width,
                  height=level.height)
    env = _env_on(level, boxes=2)
    obs, *_, info = env.step("right")
    assert obs.startswith("blocked . ") and env._boxes == {(1, 2), (1, 3)}
    assert not info["format_error"]


def test_format_penalty_counting_and_truncation():
    env = Sokoban(max_turns=4, format_penalty=0.25)
    env.reset(seed=5)
    obs, r, term, trunc, info = env.step("jump")
    assert r == -0.25 and not term and not trunc and obs.startswith("invalid action . ")
    assert info["format_error"] and info["format_errors"] == 1
    start = (env._player, env._boxes)
    _, r, _, _, info = env.step("")
    assert r == -0.25 and info["format_errors"] == 2 and (env._player, env._boxes) == start
    _, _, term, trunc, info = env.step("x" * 1000)
    assert not trunc and info["turns"] == 3 and info["format_errors"] == 3
    _, _, term, trunc, info = env.step("nope")
    assert trunc and not term and info["turns"] == 4 and not info["success"]
    with pytest.raises(RuntimeError):
        env.step("up")
    env.reset(seed=5)  # a reset starts a fresh episode
    _, _, term, trunc, info = env.step("nope")
    assert not trunc and info["turns"] == 1 and info["format_errors"] == 1


def test_truncation_with_valid_moves_at_max_turns():
    env = _env_on(_corridor(player=1, box=2, target=5, length=5), max_turns=3, step_penalty=0.05)
    results = [env.step("left") for _ in range(3)]  # into the wall every time
    assert [t for *_, t, _ in results] == [False, False, True]
    assert all(r == pytest.approx(-0.05) and not term for _, r, term, _, _ in results)


def test_every_observation_word_is_in_vocab():
    vocab, seen = set(VOCAB), set()
    for boxes in (1, 2):
        for fmt in ("compact", "tagged"):
            env = Sokoban(boxes=boxes, width=7, height=6, action_format=fmt, max_turns=30)
            for seed in range(20):
                obs, _ = env.reset(seed=seed)
                seen |= set(_words(obs))
                script = ["jump", "up", "left", "down", "right"]
                while script:
                    a = script.pop(0)
                    obs, _, term, trunc, _ = env.step(
                        f"<answer>{a}</answer>" if fmt == "tagged" else a)
                    seen |= set(_words(obs))
                    if term or trunc:
                        break
                    if not script:  # then solve from wherever the moves left things
                        here = replace(env.level, player=env._player, boxes=env._boxes)
                        script = solve(here) or []  # [] if they cornered a box
    assert seen <= vocab, seen - vocab
    # every status and cell kind was rendered, so the check above covered them
    assert {"moved", "blocked", "invalid", "solved", "W", "F", "P", "B", "T", "X", "Q"} <= seen


def test_eval_seeds_are_held_out():
    env = Sokoban(eval_seeds=8)
    assert [env.eval_seed(i) for i in (0, 7)] == [EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + 7]
    assert EVAL_SEED_OFFSET > 10**6
    with pytest.raises(ValueError):
        env.eval_seed(8)
    obs, info = env.reset(seed=env.eval_seed(3))
    assert info["level_seed"] == EVAL_SEED_OFFSET + 3 and solve(env.level)


def test_unseeded_reset_records_its_seed():
    env = Sokoban()
    obs, info = env.reset()
    assert 0 <= info["level_seed"] < EVAL_SEED_OFFSET
    assert env.reset(seed=info["level_seed"])[0] == obs


@pytest.mark.parametrize("kwargs", [
    dict(boxes=3), dict(boxes=0), dict(width=3), dict(height=20), dict(max_turns=0),
    dict(format_penalty=-1), dict(step_penalty=-0.1), dict(action_format="json"),
    dict(eval_seeds=-1),
    dict(width=4, height=4),  # every box in a 2x2 room sits in a corner: no level exists
    dict(boxes=2, max_turns=1),  # two boxes cannot be placed in one move
])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        Sokoban(**kwargs)


def test_solver_on_hand_made_levels():
    assert solve(_corridor(player=1, box=2, target=4)) == ["right", "right"]
    assert solve(_corridor(player=1, box=2, target=4), max_moves=1) is None
    assert solve(_corridor(player=3, box=4, target=1, length=4)) is None  # box stuck by the wall
    solved = _corridor(box=4, target=4)
    assert solved.solved and solve(solved) == []


def test_sokoban_verifier_replays_the_episode():
    import random as _random

    from tasks.rewards import sokoban_verifier
    from tests.episodes import play

    rng = _random.Random(0)
    for seed in range(60):
        env = Sokoban(boxes=1 + seed % 2, max_turns=12)
        _, _ = env.reset(seed=seed)
        plan = solve(env.level) if seed % 3 == 0 else None
        moves = plan or [rng.choice(["left", "down", "right", "up", "jump", ""])
                         for _ in range(12)]
        item = play(env, moves)
        score, details = sokoban_verifier(item)
        assert score == pytest.approx(sum(item["env_rewards"])) and details["agrees_with_env"]
        assert details["success"] == item["info"]["success"]
        assert plan is None or details["success"]  # the solver's plan always solves
