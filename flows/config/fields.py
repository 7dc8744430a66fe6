"""The base model every config section derives from, and the field types sections share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator

from tasks.components import COMPONENT


class ConfigError(ValueError):
    """A bad config; the message names the key."""


# Keys renamed so that a reward's Python path and its Lambda function cannot be confused.
RENAMED = {"reward": "reward_fn", "reward_function": "lambda_function",
           "function_name": "lambda_function"}


class Section(BaseModel):
    """A config section: unknown keys are refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              arbitrary_types_allowed=True)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in RENAMED.items():
                if old in data and old not in cls.model_fields and new in cls.model_fields:
                    raise ValueError(f"{old!r} was renamed {new!r}")
        return data


def component_spec(v: Any) -> Any:
    """``{_component_: path or object, **kwargs}``; a bare Python object becomes its spec."""
    if callable(v) and not isinstance(v, dict):
        return {COMPONENT: v}
    if not isinstance(v, dict):
        raise ValueError("must be a mapping with a _component_ key")
    if COMPONENT not in v:
        raise ValueError("needs a _component_ key")
    if not isinstance(v[COMPONENT], str) and not callable(v[COMPONENT]):
        raise ValueError("_component_ must be a dotted path or a Python callable")
    return v


ComponentSpec = Annotated[dict[str, Any], BeforeValidator(component_spec)]


def _reward_fn(v: Any) -> Any:
    if isinstance(v, str) or callable(v):
        return v
    raise ValueError("must be a dotted path or a Python callable")


RewardFn = Annotated[str | Callable[..., Any], BeforeValidator(_reward_fn)]
