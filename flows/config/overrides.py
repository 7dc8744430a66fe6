"""Dotted overrides of a config's data: ``trainer.max_steps=20``, ``env_tasks.0.weight=0.5``.

A key the schema does not have is refused before anything is validated, with the key named
(and its new name when it was renamed); values are parsed as YAML scalars.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from flows.config.fields import RENAMED, ConfigError
from flows.config.schema import TrainConfig


def parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def check_path(model: type[BaseModel], parts: list[str], key: str) -> None:
    """Reject an override whose key the schema does not have."""
    cls: Any = model
    for i, part in enumerate(parts):
        if isinstance(cls, type) and issubclass(cls, BaseModel):
            if part not in cls.model_fields:
                new = RENAMED.get(part)
                hint = ""
                if new in cls.model_fields:
                    segs = key.split(".")
                    segs[len(segs) - 1 - segs[::-1].index(part)] = new
                    hint = f" (renamed {'.'.join(segs)!r})"
                raise ConfigError(f"{key}: unknown config key "
                                  f"{'.'.join(parts[: i + 1])!r}{hint}")
            ann = cls.model_fields[part].annotation
            origin = getattr(ann, "__origin__", None)
            if origin is list:
                (item,) = ann.__args__
                if i + 1 < len(parts):
                    if not parts[i + 1].isdigit():
                        raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} is a list; "
                                          "index it with a number")
                    return check_path(item, parts[i + 2:], key) if i + 2 < len(parts) else None
                return
            cls = ann if isinstance(ann, type) else None
        else:
            return  # free-form dicts (component kwargs) take any key


def apply_override(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    check_path(TrainConfig, parts, key)
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            idx = int(part)
            if idx >= len(node):
                raise ConfigError(f"{key}: index {idx} out of range")
            node = node[idx]
        else:
            if node.get(part) is None:  # a null section (tls: null) takes keys as an absent one
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} is not a section")
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def apply_overrides(data: dict, overrides) -> None:
    """Apply ``key=value`` overrides to a config's data, in order."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item!r}: overrides are written key=value")
        key, _, raw = item.partition("=")
        apply_override(data, key.strip(), parse_value(raw))
