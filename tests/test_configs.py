"""Every YAML under config/ loads and every _component_ resolves; bad config names the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flows.config import ConfigError, load_config
from tasks.components import instantiate, resolve

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "config").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_components_resolve(path):
    cfg = load_config(path)
    for task in cfg.env_tasks:
        env = instantiate(task.env)
        obs, info = env.reset(seed=1)
        assert isinstance(obs, str) and obs
        assert callable(resolve(task.reward))
        assert task.reward.startswith(("tasks.rewards.", "tasks.reward_models."))
    assert cfg.effective_pools()


@pytest.mark.parametrize("override,key", [
    ("trainer.max_steps=-1", "trainer.max_steps"),
    ("no.such.key=1", "no"),
    ("mode=bogus", "mode"),
    ("placement=everywhere", "placement"),
    ("rollout.max_staleness=-2", "rollout.max_staleness"),
    ("env_tasks.0.weight=0", "env_tasks.0.weight"),
    ("trainer.hparams.lrr=1", "trainer.hparams.lrr"),
    ("cluster.pools.0.slots=0", "cluster.pools.0.slots"),
    ("env_tasks.1.env.low=9", "env_tasks.1.env"),
    ("env_tasks.0.env.bogus_kwarg=1", "env_tasks.0.env"),
    ("env_tasks.0.env._component_=tasks.envs.nope.Env", "env_tasks.0.env"),
    ("env_tasks.0.reward=tasks.rewards.missing", "env_tasks.0.reward"),
    ("cluster.pools.1.profile=B300", "cluster.pools.1.profile"),
    ("rollout.max_in_flight=4", "rollout.max_in_flight"),
    ("rollout.sampling.temperature=0.7", "trainer.hparams.temperature"),
    # an event must not reach code outside the reward modules, and the config says so at start
    ("env_tasks.0.reward=os.system", "env_tasks.0.reward"),
    ("reward.backend=aws", "reward.backend"),
    ("reward.function_name=nope", "reward.function_name"),
    ("env_tasks.0.reward_function=nope", "reward_function"),
    ("reward.read_timeout_s=60", "reward.read_timeout_s"),
    ("reward.max_payload_bytes=7000000", "reward.max_payload_bytes"),
    ("reward.endpoint_url=http://127.0.0.1:1", "reward.endpoint_url"),
    ("cluster.pools.4.role=env", "serverless"),
])
def test_bad_override_names_key(override, key):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[override])
    assert key in str(exc.value)


def test_overrides_apply():
    cfg = load_config(overrides=["trainer.max_steps=7", "mode=sync", "placement=monolithic",
                                 "rollout.max_staleness=1", "seed=3", "env_tasks.1.weight=0.5"])
    assert (cfg.trainer.max_steps, cfg.mode, cfg.placement) == (7, "sync", "monolithic")
    assert cfg.rollout.max_staleness == 1 and cfg.seed == 3 and cfg.env_tasks[1].weight == 0.5


def test_missing_config_file():
    with pytest.raises(ConfigError, match="--config"):
        load_config("/nonexistent.yaml")


@pytest.mark.parametrize("arg,key", [("trainer.max_steps=-1", "trainer.max_steps"),
                                     ("no.such.key=1", "no.such.key")])
def test_cli_bad_config_exits_2_with_one_line(arg, key, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "flows" / "train.py"), arg,
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert key in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
