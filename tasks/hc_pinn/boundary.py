"""Boundary functions ``B`` for the trial function ``u~ = A + B N`` and the grammar that names them.

``B`` must vanish on every prescribed face of the problem and nowhere inside. A spec is a
family and one integer parameter, written as two words (``sine 2``, ``exp 8``): the grammar an
agent proposes in (:func:`parse_spec`). Per family, with ``phi`` the distance to a face:

==========  ==========================================================  ================
family      factor per axis (both ends / one end prescribed)             parameter
==========  ==========================================================  ================
``poly``    ``(x (1 - x))^p``  /  ``phi^p``                             power p
``sine``    ``sin(pi x)^p``  /  ``sin(pi phi / 2)^p``                   power p
``exp``     ``(1 - e^{-k x})(1 - e^{-k (1 - x)})``  /  ``1 - e^{-k phi}`` sharpness k
``tanh``    ``tanh(k x) tanh(k (1 - x))``  /  ``tanh(k phi)``           sharpness k
``dist``    ``(min over faces of phi)^p``: the exact distance, kinked    power p
``rfun``    R-function conjunction of the faces' ``phi`` (smooth         power p
            approximate distance; Sukumar and Srivastava, CMAME 2022)
==========  ==========================================================  ================

The axis factors multiply. Every ``B`` is scaled to 1 at the box's centre (0.5 on two-sided
axes, 1 on one-sided ones), so families differ in shape, not in size: effective rank and
condition number ignore a constant factor, but a training run's step size does not.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tasks.hc_pinn.problems import Face, Problem

Tensor = torch.Tensor

POWER_FAMILIES = ("poly", "sine", "dist", "rfun")
SHARPNESS_FAMILIES = ("exp", "tanh")
FAMILIES = POWER_FAMILIES + SHARPNESS_FAMILIES
MAX_POWER = 8
MAX_SHARPNESS = 32
PI = torch.pi

# The forms found in HC-PINN papers and codes: x(1-x) products and their square, sin(pi x)
# products, the exact distance, the R-function distance, and 1-e^{-t} / tanh(t) in time.
COMMON: tuple[str, ...] = ("poly 1", "poly 2", "sine 1", "dist 1", "rfun 1", "exp 1", "tanh 1")

_SPEC_RE = re.compile(r"\b(" + "|".join(FAMILIES) + r")\b(?:\s+(\d{1,3}))?", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class BoundarySpec:
    """A boundary function: a family of :data:`FAMILIES` and its integer parameter."""

    family: str
    param: int = 1

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown boundary family {self.family!r}; known: {list(FAMILIES)}")
        top = MAX_POWER if self.family in POWER_FAMILIES else MAX_SHARPNESS
        if not 1 <= self.param <= top:
            raise ValueError(f"{self.family}: parameter must be in 1..{top}, got {self.param}")

    def __str__(self) -> str:
        return f"{self.family} {self.param}"


def parse_spec(text: str) -> BoundarySpec | None:
    """The first ``family [param]`` in ``text`` (param defaults to 1), or None when there is
    none or its parameter is out of range. Never raises."""
    if not isinstance(text, str) or len(text) > 256:
        return None
    m = _SPEC_RE.search(text)
    if not m:
        return None
    try:
        return BoundarySpec(m.group(1).lower(), int(m.group(2)) if m.group(2) else 1)
    except ValueError:
        return None


def grammar() -> list[BoundarySpec]:
    """Every spec the grammar allows."""
    return [BoundarySpec(f, p) for f in POWER_FAMILIES for p in range(1, MAX_POWER + 1)] + \
        [BoundarySpec(f, k) for f in SHARPNESS_FAMILIES for k in range(1, MAX_SHARPNESS + 1)]


def _axes(faces: tuple[Face, ...]) -> dict[int, set[int]]:
    sides: dict[int, set[int]] = {}
    for face in faces:
        sides.setdefault(face.axis, set()).add(face.side)
    return sides


def _axis_factor(family: str, param: int, x: Tensor, sides: set[int]) -> Tensor:
    if sides == {0, 1}:
        if family == "poly":
            return (x * (1 - x)) ** param
        if family == "sine":
            return torch.sin(PI * x) ** param
        if family == "exp":
            return (1 - torch.exp(-param * x)) * (1 - torch.exp(-param * (1 - x)))
        return torch.tanh(param * x) * torch.tanh(param * (1 - x))
    phi = x if sides == {0} else 1 - x
    if family == "poly":
        return phi**param
    if family == "sine":
        return torch.sin(PI * phi / 2) ** param
    if family == "exp":
        return 1 - torch.exp(-param * phi)
    return torch.tanh(param * phi)


def _r_conjunction(a: Tensor, b: Tensor) -> Tensor:
    # R0 conjunction: zero exactly where either is zero, positive where both are.
    return a + b - torch.sqrt(a * a + b * b)


def _raw(spec: BoundarySpec, problem: Problem, x: Tensor) -> Tensor:
    if spec.family in ("dist", "rfun"):
        phis = [face.distance(x) for face in problem.faces]
        if spec.family == "dist":
            d = torch.stack(phis, dim=-1).amin(dim=-1)
        else:
            d = phis[0]
            for phi in phis[1:]:
                d = _r_conjunction(d, phi)
        return d**spec.param
    out = torch.ones_like(x[..., 0])
    for axis, sides in sorted(_axes(problem.faces).items()):
        out = out * _axis_factor(spec.family, spec.param, x[..., axis], sides)
    return out


def centre(problem: Problem) -> Tensor:
    """The point where every ``B`` is scaled to 1: 0.5 on axes prescribed at both ends (and on
    free axes), the far end on axes prescribed at one end."""
    c = torch.full((problem.dim,), 0.5, dtype=torch.float64)
    for axis, sides in _axes(problem.faces).items():
        if sides == {0}:
            c[axis] = 1.0
        elif sides == {1}:
            c[axis] = 0.0
    return c


def boundary_function(spec: BoundarySpec, problem: Problem) -> Callable[[Tensor], Tensor]:
    """``B(x)`` for ``x`` of shape ``(..., d)``, vanishing on ``problem.faces``, 1 at
    :func:`centre`; written in torch ops, so it differentiates (``torch.func`` included)."""
    scale = 1.0 / float(_raw(spec, problem, centre(problem)))

    def b(x: Tensor) -> Tensor:
        return scale * _raw(spec, problem, x)

    return b
