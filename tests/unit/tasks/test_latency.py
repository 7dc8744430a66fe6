"""The remote-sandbox latency wrapper, FrozenLake's random maps and the tagged action formats."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from tasks.envs.base import TextEnv, eval_seed
from tasks.envs.frozenlake import FrozenLakeText, parse_action
from tasks.envs.guess_number import GuessNumber, parse_guess
from tasks.envs.latency import Latency, RemoteEnvError, RemoteLatency, spend
from tests.episodes import play

GUESS = {"_component_": "tasks.envs.guess_number.GuessNumber", "low": 1, "high": 8}


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def test_latency_distributions_have_the_asked_shape():
    rng = random.Random(0)
    assert Latency.of(0.3).sample(rng) == 0.3
    logn = [Latency.of({"kind": "lognormal", "median_s": 0.2, "sigma": 0.5}).sample(rng)
            for _ in range(20000)]
    assert statistics.median(logn) == pytest.approx(0.2, rel=0.05)
    heavy = Latency.of({"kind": "heavy_tail", "p50_s": 0.01, "p99_over_p50": 50})
    xs = [heavy.sample(rng) for _ in range(50000)]
    assert _quantile(xs, 0.5) == pytest.approx(0.01, rel=0.05)
    assert _quantile(xs, 0.99) / _quantile(xs, 0.5) == pytest.approx(50, rel=0.15)
    with pytest.raises(ValueError, match="kind"):
        Latency.of({"kind": "uniform"})
    with pytest.raises(ValueError):
        Latency.of({"kind": "heavy_tail", "p50_s": 0.1, "p99_over_p50": 0.5})


def test_waiting_burns_no_core_but_cpu_work_does():
    for cpu_work, busy in ((False, False), (True, True)):
        wall, cpu = time.perf_counter(), time.process_time()
        spend(0.2, cpu_work)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert wall >= 0.2
        assert (cpu > 0.1) is busy


def test_wrapper_delays_deterministically_and_keeps_the_protocol():
    env = RemoteLatency(GUESS, step_latency={"kind": "lognormal", "median_s": 0.01, "sigma": 1},
                        reset_latency=0.02, seed=3)
    assert isinstance(env, TextEnv) and env.max_turns == 4
    obs, info = env.reset(seed=7)
    assert info["remote_latency_s"] == 0.02
    delays = [env.step("4")[4]["remote_latency_s"] for _ in range(3)]
    env.reset(seed=7)
    assert [env.step("4")[4]["remote_latency_s"] for _ in range(3)] == delays
    assert GuessNumber().reset(seed=7)[0] == obs  # the inner environment is untouched


def test_injected_failures_raise_at_the_asked_rate():
    env = RemoteLatency(GUESS, failure_rate=0.3, seed=1)
    failures = 0
    for seed in range(400):
        try:
            env.reset(seed=seed)
            env.step("4")
        except RemoteEnvError:
            failures += 1
    assert 0.35 < failures / 400 < 0.65  # two draws per episode: 1 - 0.7**2 = 0.51
    with pytest.raises(ValueError):
        RemoteLatency(GUESS, failure_rate=1.0)


def test_frozenlake_random_maps_differ_by_seed_and_are_solvable():
    from tasks.rewards import frozenlake_verifier

    env = FrozenLakeText(map_name="random", size=5, observation="grid", max_turns=30)
    maps = set()
    for i in range(30):
        obs, _ = env.reset(seed=eval_seed(i))
        _, _, _, _, info = env.step("jump")
        maps.add(tuple(info["map"]))
        # breadth-first search over the map: gymnasium guarantees a path from S to G
        grid = info["map"]
        n = len(grid)
        seen, frontier = {(0, 0)}, [(0, 0)]
        while frontier:
            r, c = frontier.pop()
            for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
                rr, cc = r + dr, c + dc
                if 0 <= rr < n and 0 <= cc < n and grid[rr][cc] != "H" and (rr, cc) not in seen:
                    seen.add((rr, cc))
                    frontier.append((rr, cc))
        assert (n - 1, n - 1) in seen
    assert len(maps) > 20
    assert env.reset(seed=5) == env.reset(seed=5)
    item = {"responses": ["jump"], "env_rewards": [-0.1], "info": info}
    assert frozenlake_verifier(item)[0] == pytest.approx(-0.1)


@pytest.mark.parametrize("text,compact,tagged", [
    ("up", 3, None), ("<answer>up</answer>", None, 3), ("I go <answer> Left </answer>", None, 0),
    ("", None, None), ("<answer>jump</answer>", None, None),
])
def test_frozenlake_action_formats(text, compact, tagged):
    assert parse_action(text, "compact") == compact
    assert parse_action(text, "tagged") == tagged


def test_tagged_guess_number_and_its_verifier():
    from tasks.rewards import guess_number_verifier

    assert parse_guess("<answer>5</answer>", "tagged") == 5 and parse_guess("5", "tagged") is None
    env = GuessNumber(action_format="tagged")
    env.reset(seed=2)
    item = play(env, ["5", "<answer>1</answer>", "<answer>2</answer>", "<answer>3</answer>"])
    score, details = guess_number_verifier(item)
    assert score == pytest.approx(sum(item["env_rewards"])) and details["agrees_with_env"]
    with pytest.raises(ValueError, match="action_format"):
        GuessNumber(action_format="json")
