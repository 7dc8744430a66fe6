"""The training flow's configuration: YAML holds values, one typed schema holds shape.

``load_config(path, overrides)`` reads YAML, applies dotted overrides (``trainer.max_steps=20``,
``env_tasks.0.weight=0.5``) and validates. Any problem raises :class:`ConfigError` whose message
names the key; the entry point prints that one line and exits with status 2.

Through the Python API a component (``_component_``) or a reward function may be a Python object
instead of a dotted path (a class or function defined in a notebook cell, a
``functools.partial``)::

    cfg = load_config()
    cfg.env_tasks[0].env = {"_component_": MyEnv, "size": 4}
    cfg.env_tasks[0].reward_fn = my_reward          # run by reward.backend=local
    cfg = validate(cfg)                              # re-checks the whole config

An entry of ``env_tasks`` (an environment, its weight in the mix, its reward) is an *env task*.

Where each part lives: :mod:`~flows.config.schema` (:class:`TrainConfig`, from the sections of
:mod:`~flows.config.sections` and :mod:`~flows.config.cluster`), :mod:`~flows.config.rules`
(checks across sections, one function per rule), :mod:`~flows.config.overrides` (dotted
overrides), :mod:`~flows.config.loading` (load, validate, resolve components) and
:mod:`~flows.config.derived` (what a config implies). Importing this package imports neither
torch nor transformers.
"""

from flows.config.choices import Mode, Placement, RewardBackend
from flows.config.cluster import AdaptiveEnvConfig, ClusterConfig, TLSConfig
from flows.config.fields import ConfigError
from flows.config.loading import (
    DEFAULT_CONFIG,
    load_config,
    read_config_file,
    resolved_yaml,
    reward_callables,
    validate,
    validated,
    with_overrides,
)
from flows.config.schema import TrainConfig
from flows.config.sections import EnvTaskConfig, SinkKind

__all__ = [
    "DEFAULT_CONFIG", "AdaptiveEnvConfig", "ClusterConfig", "ConfigError", "EnvTaskConfig",
    "Mode", "Placement", "RewardBackend", "SinkKind", "TLSConfig", "TrainConfig", "load_config",
    "read_config_file", "resolved_yaml", "reward_callables", "validate", "validated",
    "with_overrides",
]
