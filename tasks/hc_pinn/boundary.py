"""Boundary functions ``B`` for the trial function ``u~ = A + B N`` and the grammar that names them.

``B`` must vanish on every prescribed face of the problem and nowhere inside. A spec is a
family and one integer parameter, written as two words (``sine 2``, ``exp 8``): the grammar an
agent proposes in (:mod:`tasks.hc_pinn.grammar`). Per family, with ``phi`` the distance to a face:

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

from collections.abc import Callable

import torch

from tasks.hc_pinn.grammar import (  # noqa: F401  (re-exported: the grammar with its functions)
    COMMON,
    FAMILIES,
    MAX_POWER,
    MAX_SHARPNESS,
    POWER_FAMILIES,
    SHARPNESS_FAMILIES,
    BoundarySpec,
    grammar,
    parse_spec,
)
from tasks.hc_pinn.problems import Face, Problem

Tensor = torch.Tensor

PI = torch.pi


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
