"""Swap components by dotted path: ``{_component_: tasks.rewards.env_return, ...kwargs}``."""

from __future__ import annotations

import importlib
from typing import Any


def resolve(path: str) -> Any:
    """Import ``pkg.module.attr``; a clear error names the path when it does not resolve."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"_component_ {path!r} is not a dotted path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"_component_ {path!r}: cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"_component_ {path!r}: {module_name!r} has no {attr!r}") from None


def instantiate(spec: dict[str, Any], **extra: Any) -> Any:
    """Call the ``_component_`` of ``spec`` with its other keys (and ``extra``) as kwargs."""
    kwargs = {k: v for k, v in spec.items() if k != "_component_"}
    return resolve(spec["_component_"])(**kwargs, **extra)
