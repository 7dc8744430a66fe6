"""The SAM template that deploys the reward functions (``resources/lambda/template.yaml``), read
outside CloudFormation.

:func:`load_sam_template` parses the template despite its CloudFormation short tags (``!Ref``,
``!Sub``, ...), :func:`function_specs` gives each function's handler, limits and environment
with ``Globals`` applied, as the local Lambda emulator (:mod:`resources.lambda_emulator`) needs
them, and :func:`check_template_functions` checks a run's functions against them before it
starts. The build of the deployable artefact is :mod:`resources.lambda_build`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

DEFAULT_TEMPLATE = Path(__file__).parent / "lambda" / "template.yaml"

# Lambda's defaults for a function that sets neither.
_DEFAULT_TIMEOUT_S = 3.0
_DEFAULT_MEMORY_MB = 128


class _CloudFormationLoader(yaml.SafeLoader):
    """SafeLoader that reads CloudFormation short tags as their long (JSON) form."""


def _construct_short_tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    # `!Ref X` -> {"Ref": X}, `!Condition X` -> {"Condition": X} (CloudFormation's long forms);
    # any other `!Tag V` -> {"Fn::Tag": V}.
    key = suffix if suffix in ("Ref", "Condition") else f"Fn::{suffix}"
    value: Any
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
        if suffix == "GetAtt" and isinstance(value, str):
            # The short form "Resource.Attribute" is the long form's two-item list.
            value = value.split(".", 1)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    return {key: value}


# On the subclass only: plain yaml.safe_load keeps rejecting these tags.
_CloudFormationLoader.add_multi_constructor("!", _construct_short_tag)


def parse_sam_template(text: str) -> dict[str, Any]:
    """Parses SAM/CloudFormation YAML text, short tags included."""
    data = yaml.load(text, Loader=_CloudFormationLoader)  # a SafeLoader: no arbitrary objects
    if not isinstance(data, dict):
        raise ValueError(f"a SAM template must be a mapping, got {type(data).__name__}")
    return data


def load_sam_template(path: str | os.PathLike[str] = DEFAULT_TEMPLATE) -> dict[str, Any]:
    """Reads a SAM template; ``!Ref X`` becomes ``{"Ref": X}``, ``!Sub S`` ``{"Fn::Sub": S}``."""
    return parse_sam_template(Path(path).read_text(encoding="utf-8"))


def _merge_globals(global_value: Any, local_value: Any) -> Any:
    """SAM's Globals merge: mappings merge key by key, lists concatenate, otherwise local wins."""
    if isinstance(global_value, dict) and isinstance(local_value, dict):
        merged = copy.deepcopy(global_value)
        for key, value in local_value.items():
            merged[key] = _merge_globals(merged[key], value) if key in merged else value
        return merged
    if isinstance(global_value, list) and isinstance(local_value, list):
        return [*global_value, *local_value]
    return local_value


def _resolve(value: Any, template: Mapping[str, Any], what: str) -> Any:
    """A literal as is; ``{"Ref": P}`` as parameter P's default; anything else is an error."""
    if isinstance(value, dict) and set(value) == {"Ref"}:
        name = value["Ref"]
        parameter = template.get("Parameters", {}).get(name)
        if isinstance(parameter, dict) and "Default" in parameter:
            return parameter["Default"]
        raise ValueError(f"{what}: cannot resolve Ref {name!r} (not a parameter with a Default)")
    if isinstance(value, dict | list):
        raise ValueError(f"{what}: cannot resolve {value!r} outside CloudFormation")
    return value


def _env_string(value: Any) -> str:
    # CloudFormation passes YAML true/false to Lambda as "true"/"false", not Python's spelling.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def function_specs(template: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per FunctionName, the function's handler, limits and environment with Globals applied.

    Each value: ``{"handler", "timeout_s", "memory_mb", "environment", "package_type",
    "logical_id", "runtime", "description", "architectures", "tracing", "image_uri"}``;
    ``runtime`` is None for an image function that sets none, ``image_uri`` for a zip one.
    """
    globals_function = (template.get("Globals") or {}).get("Function") or {}
    specs: dict[str, dict[str, Any]] = {}
    for logical_id, resource in (template.get("Resources") or {}).items():
        if not isinstance(resource, dict) or resource.get("Type") != "AWS::Serverless::Function":
            continue
        # SAM's IgnoreGlobals attribute: "*" drops all of Globals, a list drops those properties.
        ignore = resource.get("IgnoreGlobals")
        if ignore == "*":
            defaults: dict[str, Any] = {}
        else:
            defaults = {k: v for k, v in globals_function.items() if k not in (ignore or ())}
        props = _merge_globals(defaults, resource.get("Properties") or {})
        what = f"function {logical_id}"

        package_type = _resolve(props.get("PackageType", "Zip"), template, what)
        if package_type == "Image":
            command = (props.get("ImageConfig") or {}).get("Command") or []
            if not command:
                raise ValueError(f"{what}: an Image function needs ImageConfig.Command")
            handler = command[0]
        else:
            handler = props.get("Handler")
            if not handler:
                raise ValueError(f"{what}: a Zip function needs a Handler")
        name = _resolve(props.get("FunctionName", logical_id), template, what)
        variables = (props.get("Environment") or {}).get("Variables") or {}
        specs[str(name)] = {
            "handler": str(_resolve(handler, template, what)),
            "timeout_s": float(_resolve(props.get("Timeout", _DEFAULT_TIMEOUT_S), template, what)),
            "memory_mb": int(_resolve(props.get("MemorySize", _DEFAULT_MEMORY_MB), template, what)),
            "environment": {
                str(k): _env_string(_resolve(v, template, f"{what} variable {k}"))
                for k, v in variables.items()
            },
            "package_type": str(package_type),
            "logical_id": str(logical_id),
            "runtime": _resolve(props.get("Runtime"), template, what),
            "description": str(_resolve(props.get("Description", ""), template, what)),
            "architectures": [str(_resolve(a, template, what))
                              for a in props.get("Architectures") or ["x86_64"]],
            "tracing": str(_resolve(props.get("Tracing", "PassThrough"), template, what)),
            "image_uri": _resolve(props.get("ImageUri"), template, what),
        }
    return specs


def check_template_functions(template: str | os.PathLike[str] | None, names: Iterable[str],
                             read_timeout_s: float) -> None:
    """Raises ValueError, naming the config key, unless every function in ``names`` is in the
    template (None: the project's) with a timeout below ``read_timeout_s``: the emulation runs
    only what the template defines, and a read timeout at or below a function's timeout makes
    the SDK re-send a call that still runs, so the function runs twice."""
    template = DEFAULT_TEMPLATE if template is None else template
    try:
        specs = function_specs(load_sam_template(template))
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"reward.emulator.template: cannot read {template}: {exc}") from None
    for name in sorted(names):
        if name not in specs:
            raise ValueError(f"reward.lambda_function / env_tasks.*.lambda_function: {name!r} is "
                             f"not a function of {template} ({sorted(specs)})")
        if read_timeout_s <= specs[name]["timeout_s"]:
            raise ValueError(
                f"reward.read_timeout_s ({read_timeout_s}) must exceed the timeout of "
                f"{name} ({specs[name]['timeout_s']} s): the SDK would re-send a long call "
                "while it still runs")
