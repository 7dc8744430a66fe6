"""PDE problems with exact solutions, posed for hard-constrained PINNs.

Every problem lives on the unit box ``[0, 1]^d`` (time, where there is one, is the last
coordinate, scaled to ``[0, 1]``). It names the faces on which the solution is prescribed (both
ends of each space axis; ``t = 0`` for time), gives ``A`` (a smooth function meeting the
prescribed values on those faces), the exact solution (for the L2 error) and the PDE residual.

The residual is written per collocation point, in terms of the trial function's value, gradient
and Hessian there, so the same code serves training and the neural tangent kernel
(:mod:`tasks.hc_pinn.ntk`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Face:
    """A face of the unit box on which the solution is prescribed: ``x[axis] == side``."""

    axis: int
    side: int  # 0 or 1

    def distance(self, x: Tensor) -> Tensor:
        """Distance of ``x`` (shape ``(..., d)``) to this face's plane."""
        return x[..., self.axis] if self.side == 0 else 1.0 - x[..., self.axis]


@dataclass(frozen=True)
class Problem:
    """One PDE problem for an HC-PINN.

    ``residual(x, u, grad, hess)`` gives the PDE residual at one point ``x`` (shape ``(d,)``)
    from the trial function's value, gradient ``(d,)`` and Hessian ``(d, d)`` there.
    ``lift(x)`` is ``A``: it meets the prescribed values on every face of ``faces``.
    """

    name: str
    dim: int
    faces: tuple[Face, ...]
    lift: Callable[[Tensor], Tensor]
    exact: Callable[[Tensor], Tensor]
    residual: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    description: str
    # Interior collocation points per axis, and evaluation points per axis for the L2 error.
    points_per_axis: int = 12
    eval_points_per_axis: int = 41

    def collocation(self, points_per_axis: int | None = None) -> Tensor:
        """Interior collocation points, a tensor grid ``(n, d)`` in float64; faces excluded
        (the constraint holds there exactly)."""
        k = points_per_axis or self.points_per_axis
        axis = (torch.arange(1, k + 1, dtype=torch.float64) - 0.5) / k
        grids = torch.meshgrid(*([axis] * self.dim), indexing="ij")
        return torch.stack([g.reshape(-1) for g in grids], dim=-1)

    def evaluation_grid(self) -> Tensor:
        """A grid including the faces, ``(m, d)`` float64, for the L2 error."""
        axis = torch.linspace(0.0, 1.0, self.eval_points_per_axis, dtype=torch.float64)
        grids = torch.meshgrid(*([axis] * self.dim), indexing="ij")
        return torch.stack([g.reshape(-1) for g in grids], dim=-1)

    def boundary_points(self, per_face: int = 33) -> Tensor:
        """Points on the prescribed faces, ``(m, d)`` float64."""
        s = torch.linspace(0.0, 1.0, per_face, dtype=torch.float64)
        pts = []
        for face in self.faces:
            others = torch.meshgrid(*([s] * (self.dim - 1)), indexing="ij") if self.dim > 1 else ()
            cols = [o.reshape(-1) for o in others]
            n = cols[0].numel() if cols else 1
            cols.insert(face.axis, torch.full((n,), float(face.side), dtype=torch.float64))
            pts.append(torch.stack(cols, dim=-1))
        return torch.cat(pts)


PI = math.pi


def _poisson_1d() -> Problem:
    # -u'' = f on (0, 1), u(0) = 0, u(1) = 1/2; u = sin(2 pi x) + x / 2.
    def exact(x):
        return torch.sin(2 * PI * x[..., 0]) + 0.5 * x[..., 0]

    def residual(x, u, grad, hess):
        f = (2 * PI) ** 2 * torch.sin(2 * PI * x[..., 0])
        return -hess[..., 0, 0] - f

    return Problem("poisson1d", 1, (Face(0, 0), Face(0, 1)), lift=lambda x: 0.5 * x[..., 0],
                   exact=exact, residual=residual, points_per_axis=64, eval_points_per_axis=401,
                   description="-u'' = f on (0,1), u(0) = 0, u(1) = 1/2, "
                               "u = sin(2 pi x) + x/2")


def _poisson_2d() -> Problem:
    # -lap u = f on the unit square, u = x y on its boundary; u = sin(pi x) sin(2 pi y) + x y.
    def exact(x):
        return torch.sin(PI * x[..., 0]) * torch.sin(2 * PI * x[..., 1]) + x[..., 0] * x[..., 1]

    def residual(x, u, grad, hess):
        f = 5 * PI**2 * torch.sin(PI * x[..., 0]) * torch.sin(2 * PI * x[..., 1])
        return -(hess[..., 0, 0] + hess[..., 1, 1]) - f

    return Problem("poisson2d", 2, (Face(0, 0), Face(0, 1), Face(1, 0), Face(1, 1)),
                   lift=lambda x: x[..., 0] * x[..., 1], exact=exact, residual=residual,
                   description="-lap u = f on the unit square, u = x y on the boundary, "
                               "u = sin(pi x) sin(2 pi y) + x y")


HEAT_KAPPA = 0.1


def _heat_1d() -> Problem:
    # u_t = kappa u_xx on (0,1) x (0,1], u = 0 at x = 0 and 1, u(x, 0) = sin(pi x) + sin(3 pi x)/2;
    # u = exp(-kappa pi^2 t) sin(pi x) + exp(-9 kappa pi^2 t) sin(3 pi x) / 2.
    def initial(x):
        return torch.sin(PI * x[..., 0]) + 0.5 * torch.sin(3 * PI * x[..., 0])

    def exact(x):
        t = x[..., 1]
        return (torch.exp(-HEAT_KAPPA * PI**2 * t) * torch.sin(PI * x[..., 0])
                + 0.5 * torch.exp(-9 * HEAT_KAPPA * PI**2 * t) * torch.sin(3 * PI * x[..., 0]))

    def residual(x, u, grad, hess):
        return grad[..., 1] - HEAT_KAPPA * hess[..., 0, 0]

    return Problem("heat1d", 2, (Face(0, 0), Face(0, 1), Face(1, 0)), lift=initial, exact=exact,
                   residual=residual,
                   description=f"u_t = {HEAT_KAPPA} u_xx, u = 0 at x = 0, 1, "
                               "u(x, 0) = sin(pi x) + sin(3 pi x)/2")


PROBLEMS: dict[str, Callable[[], Problem]] = {
    "poisson1d": _poisson_1d,
    "poisson2d": _poisson_2d,
    "heat1d": _heat_1d,
}


def get_problem(name: str) -> Problem:
    """The problem called ``name`` (one of :data:`PROBLEMS`)."""
    try:
        return PROBLEMS[name]()
    except KeyError:
        raise ValueError(f"unknown HC-PINN problem {name!r}; known: {sorted(PROBLEMS)}") from None
