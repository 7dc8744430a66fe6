"""Hostile input, property-based (hypothesis): every environment takes any text the model may
write (arbitrary unicode, arbitrary bytes, empty, huge) and answers; the reward service's core
takes any JSON and answers with an error or per-item results; config loading takes any file
and any override and either validates or raises ConfigError (the CLI's one line, exit 2) —
never an unexplained crash."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flows.config import ConfigError, TrainConfig, load_config
from tasks.envs.frozenlake import FrozenLakeText
from tasks.envs.guess_number import GuessNumber
from tasks.envs.hc_pinn import HCPinnDesign
from tasks.envs.sokoban import Sokoban
from tasks.envs.tool_use import ToolUse
from tasks.envs.word_answer import WordAnswer
from tasks.reward_service import handle

# hc_pinn on one problem and network: its spectral reference is computed once, not 12 times
ENVS = [FrozenLakeText, GuessNumber, Sokoban, ToolUse, WordAnswer,
        functools.partial(HCPinnDesign, problems=["poisson1d"], init_seeds=1)]
# what a model may emit: any unicode, raw bytes read as text, nothing, far too much
ACTIONS = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.binary(max_size=200).map(lambda b: b.decode("utf-8", errors="surrogateescape")),
    st.just(""),
    st.integers(1_000, 200_000).map(lambda n: "9(" * (n // 2)),
    st.sampled_from(["up", "<answer>up</answer>", "4", "calc: 1/0", "answer: " + "9" * 5000,
                     "sine 999", "poly 0", "exp 32"]),
)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("env_cls", ENVS, ids=lambda c: getattr(c, "func", c).__name__)
@SETTINGS
@given(seed=st.integers(0, 10**6), actions=st.lists(ACTIONS, min_size=1, max_size=4))
def test_every_environment_answers_any_text(env_cls, seed, actions):
    env = env_cls()
    obs, info = env.reset(seed=seed)
    assert isinstance(obs, str) and isinstance(info, dict)
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert isinstance(obs, str) and isinstance(info, dict)
        assert isinstance(reward, float | int) and reward == reward  # not NaN
        assert isinstance(terminated, bool) and isinstance(truncated, bool)
        if terminated or truncated:
            break
    env.close()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                  max_size=4),
    max_leaves=20)
ITEM = st.fixed_dictionaries({"id": JSON, "reward_fn": st.sampled_from(
    ["tasks.rewards.env_return", "tasks.rewards.frozenlake_verifier", "os.system", "nope"])},
    optional={"env_rewards": JSON, "responses": JSON, "info": JSON, "env_name": JSON,
              "idempotency_key": JSON})


@SETTINGS
@example(event={"schema_version": 1, "items": [{"id": 1, "reward_fn": "os.system"}]})
@given(event=st.one_of(JSON, st.fixed_dictionaries(
    {"items": st.lists(ITEM, max_size=4)},
    optional={"schema_version": st.sampled_from([1, 1, 2, "1", None])})))
def test_reward_service_answers_any_json_event(event):
    response = handle(event)
    json.dumps(response)  # the answer crosses the Lambda boundary as JSON
    if "error" in response:  # the batch is malformed: one error naming the field, no results
        assert response["results"] == []
        assert response["error"]["type"] and response["error"]["message"]
    else:
        items = event["items"]
        assert len(response["results"]) == len(items)
        for r in response["results"]:
            assert r["score"] is not None or r.get("error")


KEYS = st.sampled_from(["seed", "mode", "trainer.max_steps", "rollout.max_staleness",
                        "env_tasks.0.group_size", "env_tasks.0.env._component_", "metrics.sinks",
                        "cluster.pools", "reward.backend", "no.such.key", "env_tasks.9.weight",
                        "trainer", ""])
VALUES = st.one_of(st.text(max_size=30), st.integers().map(str), st.sampled_from(
    ["[1, 2", "{a: 1}", "null", "-1", "1e400", "tasks.nope.Missing", "os.system", "[]"]))


@SETTINGS
@given(overrides=st.lists(st.one_of(st.tuples(KEYS, VALUES).map("=".join), st.text(max_size=30)),
                          max_size=3))
def test_any_override_validates_or_is_a_config_error(overrides):
    try:
        assert isinstance(load_config(None, overrides), TrainConfig)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc).strip()


@SETTINGS
@given(text=st.one_of(st.text(max_size=300), JSON.map(json.dumps),
                      st.binary(max_size=300).map(lambda b: b.decode("latin-1"))))
def test_any_config_file_validates_or_is_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "config.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc).strip()
