"""Environments: GEM-style API, parsing with format penalty, success, max_turns."""

from __future__ import annotations

import pytest

from tasks.env_steps import EnvRegistry, ReplayedEnvWork
from tasks.envs.base import TextEnv
from tasks.envs.frozenlake import FrozenLakeText, parse_action
from tasks.envs.guess_number import GuessNumber

OPTIMAL = ["right", "right", "down", "down", "down", "right"]


def test_frozenlake_follows_protocol_and_solves():
    env = FrozenLakeText()
    assert isinstance(env, TextEnv)
    obs, info = env.reset(seed=0)
    assert "row 0 col 0" in obs and info["success"] is False
    for i, a in enumerate(OPTIMAL):
        obs, r, term, trunc, info = env.step(a)
        assert trunc is False
        assert term is (i == len(OPTIMAL) - 1)
    assert r == 1.0 and info["success"] and obs == "reached the goal"


def test_frozenlake_hole_ends_without_reward():
    env = FrozenLakeText()
    env.reset(seed=0)
    env.step("down")
    obs, r, term, _, info = env.step("right")  # (1,1) is a hole on the 4x4 map
    assert term and r == 0.0 and not info["success"] and "hole" in obs


@pytest.mark.parametrize("text,expected", [
    ("left", 0), ("Down", 1), ("  right please", 2), ("up", 3),
    ("", None), ("lefty", None), ("go left", None), ("x" * 1000, None), ("<unk>", None),
])
def test_frozenlake_parser(text, expected):
    assert parse_action(text) == expected


def test_frozenlake_format_penalty_and_max_turns():
    env = FrozenLakeText(max_turns=3, format_penalty=0.25)
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step("jump")
    assert r == -0.25 and not term and not trunc and "invalid" in obs and info["format_errors"] == 1
    env.step("left")
    _, _, term, trunc, info = env.step("up")
    assert trunc and not term and info["turns"] == 3 and not info["success"]


def test_frozenlake_grid_observation():
    env = FrozenLakeText(observation="grid")
    obs, _ = env.reset(seed=0)
    assert "P F F F / F H F H" in obs


def test_guess_number_deterministic_and_feedback():
    env = GuessNumber(low=1, high=8, max_turns=4)
    assert env.reset(seed=5) == GuessNumber(low=1, high=8).reset(seed=5)
    secret = env._secret
    if secret < 8:
        obs, r, term, _, _ = env.step(str(secret + 1))
        assert obs == "lower" and r == 0 and not term
    obs, r, term, _, info = env.step(str(secret))
    assert term and r == 1.0 and info["success"]


def test_guess_number_malformed():
    env = GuessNumber(low=1, high=8, max_turns=2, format_penalty=0.1)
    env.reset(seed=1)
    _, r, term, trunc, info = env.step("banana")
    assert r == -0.1 and info["format_errors"] == 1 and not term
    _, r, term, trunc, info = env.step("99")  # out of range is malformed too
    assert trunc and info["format_errors"] == 2


def test_word_answer_reset_is_deterministic_and_reference_travels_in_info():
    from tasks.envs.word_answer import QUESTIONS, WordAnswer

    env = WordAnswer()
    assert isinstance(env, TextEnv)
    assert env.reset(seed=5) == env.reset(seed=5)
    obs, _ = env.reset(seed=5)
    question, reference = next(q for q in QUESTIONS if obs.startswith(q[0]))
    _, reward, term, trunc, info = env.step(f" {reference} ")
    assert (reward, term, trunc) == (0.0, True, False)  # scored by the reward model, not here
    assert info["success"] and info["reference"] == reference and info["answer"] == reference


@pytest.mark.parametrize("style,text,answer", [
    ("compact", "blue", "blue"), ("compact", "  light   blue ", "light blue"),
    ("compact", "", None), ("compact", "x" * 300, None),
    ("tagged", "so <answer>blue</answer>", "blue"), ("tagged", "blue", None),
    ("tagged", "<answer> </answer>", None),
])
def test_word_answer_parser(style, text, answer):
    from tasks.envs.word_answer import parse_answer

    assert parse_answer(text, style) == answer


def test_word_answer_format_error_then_max_turns():
    from tasks.envs.word_answer import WordAnswer

    env = WordAnswer(max_turns=2, answer_style="tagged", format_penalty=0.1)
    env.reset(seed=0)
    _, r, term, trunc, info = env.step("blue")
    assert (r, term, trunc, info["format_errors"]) == (-0.1, False, False, 1)
    _, r, term, trunc, info = env.step("")
    assert (term, trunc, info["format_errors"]) == (False, True, 2)


@pytest.mark.parametrize("text,expected", [
    ("3", 3), (" 7 is my guess", 7), ("", None), ("x" * 300, None), ("three", None),
    ("-2", -2),
])
def test_guess_number_parser(text, expected):
    from tasks.envs.guess_number import parse_guess

    assert parse_guess(text) == expected


def test_reset_is_deterministic_per_seed():
    env = FrozenLakeText(map_name="random", observation="grid")
    assert env.reset(seed=11) == env.reset(seed=11)
    assert len({env.reset(seed=s)[0] for s in range(20)}) > 1
    guess = GuessNumber(high=32)

    def secret(seed):  # the secret shows in the info of the first step
        guess.reset(seed=seed)
        return guess.step("16")[4]["secret"]

    assert secret(11) == secret(11) and len({secret(s) for s in range(20)}) > 1
    with pytest.raises(ValueError, match="observation: grid"):
        FrozenLakeText(map_name="random")


def test_the_registry_refuses_a_reset_or_step_run_twice():
    """Dask may run an env task again (recomputing a lost result's lineage): an instance id is
    created once, closed ones included, and each step must be the next one."""
    registry = EnvRegistry("w")
    spec = {"_component_": GuessNumber}
    registry.create(spec, "r.1.0")
    registry.step("r.1.0", 0)
    with pytest.raises(ReplayedEnvWork, match="past step 0"):
        registry.step("r.1.0", 0)
    assert registry.close("r.1.0")
    with pytest.raises(ReplayedEnvWork, match="created on w before"):
        registry.create(spec, "r.1.0")
    assert (registry.live, registry.created, registry.replays_refused) == (0, 1, 2)


def test_a_components_module_is_imported_one_thread_at_a_time(tmp_path, monkeypatch):
    """Many cohort threads creating environments at once import on demand; those imports hold
    tasks.components.IMPORT_LOCK (concurrent first imports can deadlock in CPython 3.11)."""
    import threading

    from tasks.components import IMPORT_LOCK, resolve

    (tmp_path / "rollarc_lock_probe.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = []
    with IMPORT_LOCK:
        t = threading.Thread(target=lambda: got.append(resolve("rollarc_lock_probe.VALUE")))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not got  # waiting for the lock, not importing
    t.join(30)
    assert got == [7]
