"""Swap components by dotted path or by Python object.

A component spec is ``{_component_: <dotted path or object>, **kwargs}``. From YAML the
``_component_`` is a dotted path (``tasks.envs.frozenlake.FrozenLakeText``); through the Python
API it may also be the object itself (a class, a function, a ``functools.partial``), e.g. one
defined in a notebook cell. Dask ships such an object to the workers with cloudpickle, so it
needs no importable module there.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from typing import Any

COMPONENT = "_component_"
# First imports from many threads at once (an env worker creating a cohort's environments in
# parallel) can deadlock in CPython's import locks (on 3.11: every cohort thread waiting inside
# `import gymnasium`, the run stuck for good). The imports a worker does on demand (a component's
# module, an environment's library) hold this lock, so they happen one at a time.
IMPORT_LOCK = threading.RLock()


def resolve(target: Any) -> Any:
    """The object a ``_component_`` names: import ``pkg.module.attr``, or return a Python object
    as it is. A path that does not resolve raises ImportError naming it."""
    if not isinstance(target, str):
        if not callable(target):
            raise ImportError(f"_component_ {target!r} is neither a dotted path nor callable")
        return target
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ImportError(f"_component_ {target!r} is not a dotted path")
    try:
        with IMPORT_LOCK:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"_component_ {target!r}: cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"_component_ {target!r}: {module_name!r} has no {attr!r}") from None


def kwargs_of(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != COMPONENT}


def instantiate(spec: dict[str, Any], **extra: Any) -> Any:
    """Call the ``_component_`` of ``spec`` with its other keys (and ``extra``) as kwargs."""
    return resolve(spec[COMPONENT])(**kwargs_of(spec), **extra)


def bind(spec: dict[str, Any]) -> Any:
    """The ``_component_`` with its kwargs bound but not called (a loss function, say)."""
    fn, kwargs = resolve(spec[COMPONENT]), kwargs_of(spec)
    return functools.partial(fn, **kwargs) if kwargs else fn


def check_signature(spec: dict[str, Any], *args: Any, **extra: Any) -> Any:
    """Resolve ``spec`` and check that it can be called with ``args``, its kwargs and ``extra``,
    without calling it. Returns the resolved object; raises ImportError or TypeError."""
    obj = resolve(spec[COMPONENT])
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return obj
    try:
        sig.bind(*args, **kwargs_of(spec), **extra)
    except TypeError as exc:
        raise TypeError(f"{describe(obj)}: {exc}") from None
    return obj


def check_component(spec: dict[str, Any]) -> Any:
    """Check a component's arguments without building it: they fit its signature, and its
    optional ``check_config(**kwargs)`` (a static or class method, or a factory function's
    attribute) accepts their values."""
    return check_values(spec, check_signature(spec))


def check_values(spec: dict[str, Any], obj: Any) -> Any:
    """``obj`` (``spec`` resolved), once its optional ``check_config(**kwargs)`` accepted the
    values of ``spec``'s arguments."""
    check = getattr(obj, "check_config", None)
    if callable(check):
        check(**kwargs_of(spec))
    return obj


def accepts(obj: Any, name: str) -> bool:
    """Whether calling ``obj`` takes a keyword argument ``name``."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def describe(obj: Any) -> str:
    """A stable, readable name of a component (a dotted path stays as it is)."""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, functools.partial):
        return f"partial({describe(obj.func)})"
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}"
