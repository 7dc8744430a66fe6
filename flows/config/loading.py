"""Loading a training config: YAML read, dotted overrides applied, the schema and its rules
checked, then every component resolved and its arguments checked.

Any problem raises :class:`ConfigError` whose message names the key; the entry point prints that
one line and exits with status 2. The schema and its rules import neither torch nor
transformers, so a bad key or value is reported at once; resolving the components then imports
what they need (the ``hf`` backend: torch).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import ValidationError

from flows.config.derived import emulation, reward_name
from flows.config.fields import ConfigError
from flows.config.overrides import apply_overrides
from flows.config.rules import check_rules
from flows.config.schema import TrainConfig
from resources.catalog import CATALOG
from tasks.components import (
    COMPONENT,
    check_component,
    check_signature,
    check_values,
    describe,
    resolve,
)
from tasks.reward_service import resolve_reward

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent.parent / "config" / "default.yaml"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    data = read_config_file(Path(path) if path else DEFAULT_CONFIG)
    apply_overrides(data, overrides or [])
    return validated(data)


def read_config_file(path: Path) -> dict:
    """A config YAML's data, or a ConfigError naming ``--config`` and why it cannot be read."""
    try:
        return yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {str(path)!r}") from None
    except IsADirectoryError:
        raise ConfigError(f"--config: {str(path)!r} is a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"--config: {str(path)!r} cannot be read: {reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config: {path} is not valid YAML: {exc}".splitlines()[0]) from None


def with_overrides(cfg: TrainConfig, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """``cfg`` (Python objects in it kept) with dotted overrides applied, validated."""
    data = cfg.model_dump()
    apply_overrides(data, overrides)
    return validated(data)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check a config built or edited in Python (with component objects) as a file is checked."""
    return validated(cfg.model_dump())


def validated(data: dict) -> TrainConfig:
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        loc = ".".join(str(p) for p in err["loc"])
        if not loc:  # a cross-field check: its message names the keys itself
            raise ConfigError(msg) from None
        got = (f" (got {err['input']!r})"
               if isinstance(err.get("input"), str | int | float | bool | None) else "")
        raise ConfigError(f"{loc}: {msg}{got}") from None
    try:
        check_rules(cfg)  # the cross-field checks: each message names the keys itself
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_components(cfg)
    return cfg


def check_components(cfg: TrainConfig) -> None:
    """Resolve every component and check its arguments fit, without constructing anything
    (environments are built on the workers, per trajectory); an environment class checks
    argument values itself with a ``check_config(**kwargs)`` static method. This imports each
    component's module, and so torch for the model-based ones."""
    from resources.engine import backend_context  # torch: the backends' module

    loss_kwargs = set(cfg.trainer.loss) & {"clip_eps", "tis_cap"}
    if loss_kwargs:
        raise ConfigError(f"trainer.loss.{sorted(loss_kwargs)[0]}: set it in trainer.hparams "
                          "(the trainer passes it to the loss)")
    tensors = [None] * 5  # logp, prox_logp, behaviour_logp, advantages, mask
    checks = [(f"env_tasks.{i}.env", check_component, t.env) for i, t in enumerate(cfg.env_tasks)]
    checks += [
        ("engine.backend", lambda spec: check_values(spec, check_signature(
            spec, policy=None, max_batch=1, **backend_context(
                resolve(spec[COMPONENT]), CATALOG["H800"], 1, emulation(cfg.engine) or {}))),
         cfg.engine.backend),
        ("trainer.backend", lambda spec: check_signature(spec, policy=None, hparams=None, seed=0,
                                                         loss=None), cfg.trainer.backend),
        ("trainer.loss", lambda spec: check_signature(spec, *tensors, clip_eps=0.2, tis_cap=2.0),
         cfg.trainer.loss)]
    for key, check, spec in checks:
        try:
            check(spec)
        except Exception as exc:
            raise ConfigError(f"{key}: {type(exc).__name__}: {exc}") from None
    for i, t in enumerate(cfg.env_tasks):
        if isinstance(t.reward_fn, str):
            try:
                resolve_reward(t.reward_fn)
            except (ImportError, PermissionError) as exc:
                raise ConfigError(f"env_tasks.{i}.reward_fn: {exc}") from None


def reward_callables(cfg: TrainConfig) -> dict[str, Callable]:
    """The env tasks' Python reward functions by the name their score requests carry."""
    return {reward_name(t): t.reward_fn for t in cfg.env_tasks
            if not isinstance(t.reward_fn, str)}


def resolved_yaml(cfg: TrainConfig) -> str:
    """The config as YAML; a component given as a Python object is named, as far as it can
    be (it cannot be loaded back from the file)."""
    data = cfg.model_dump(mode="json", fallback=lambda v: f"<python: {describe(v)}>")
    return yaml.safe_dump(data, sort_keys=False)
