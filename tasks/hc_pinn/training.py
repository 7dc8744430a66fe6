"""Training an HC-PINN: full-batch Adam on the mean squared PDE residual at the collocation
points, until the loss falls below a threshold or the step budget runs out.

The loss is reported relative to the loss of ``u~ = A`` (the network contributing nothing), so
one threshold means the same on every problem. Convergence is measured as the steps taken to
reach it (the budget when it is never reached), the final relative loss, and the relative L2
error against the exact solution on a grid that includes the boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tasks.hc_pinn.boundary import BoundarySpec
from tasks.hc_pinn.ntk import DEFAULT_DEPTH, DEFAULT_WIDTH, HCPinn, make_network
from tasks.hc_pinn.problems import Problem

DEFAULT_LR = 3e-3
DEFAULT_THRESHOLD = 1e-3


@dataclass(frozen=True)
class TrainResult:
    """How an HC-PINN trained."""

    problem: str
    spec: str
    seed: int
    steps: int                  # steps taken (to the threshold, or the budget)
    reached: bool               # relative loss reached the threshold within the budget
    final_loss: float           # relative loss at the end (loss / loss of u~ = A)
    l2_error: float             # ||u~ - u|| / ||u|| on the evaluation grid
    loss_curve: tuple[float, ...]   # relative loss every `curve_every` steps


def relative_l2_error(pinn: HCPinn, params, problem: Problem) -> float:
    grid = problem.evaluation_grid()
    with torch.no_grad():
        pred = pinn.predict(params, grid)
        exact = problem.exact(grid)
    return float(torch.linalg.vector_norm(pred - exact) / torch.linalg.vector_norm(exact))


def train(problem: Problem, spec: BoundarySpec, seed: int, *, max_steps: int = 2000,
          threshold: float = DEFAULT_THRESHOLD, lr: float = DEFAULT_LR,
          width: int = DEFAULT_WIDTH, depth: int = DEFAULT_DEPTH,
          points_per_axis: int | None = None, curve_every: int = 50) -> TrainResult:
    """Train the HC-PINN of ``problem`` with boundary function ``spec``, the network drawn from
    ``seed``, for at most ``max_steps`` Adam steps or until the relative loss is at most
    ``threshold``."""
    if max_steps < 1 or not threshold > 0 or not lr > 0:
        raise ValueError("max_steps must be >= 1, threshold and lr > 0")
    network = make_network(problem.dim, seed, width, depth)
    pinn = HCPinn(problem, spec, network)
    xs = problem.collocation(points_per_axis)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in pinn.params().items()}
    zero = {k: torch.zeros_like(v) for k, v in params.items()}
    scale = float(pinn.residuals(zero, xs).detach().square().mean())
    scale = scale if scale > 0 else 1.0
    opt = torch.optim.Adam(params.values(), lr=lr)
    curve: list[float] = []
    rel, steps, reached = math.inf, 0, False
    for step in range(max_steps + 1):
        loss = pinn.residuals(params, xs).square().mean()
        rel = float(loss.detach()) / scale
        if step % curve_every == 0:
            curve.append(rel)
        if not math.isfinite(rel):
            break
        if rel <= threshold:
            reached = True
            break
        if step == max_steps:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps = step + 1
    detached = {k: v.detach() for k, v in params.items()}
    return TrainResult(problem=problem.name, spec=str(spec), seed=seed, steps=steps,
                       reached=reached, final_loss=rel,
                       l2_error=relative_l2_error(pinn, detached, problem),
                       loss_curve=tuple(curve))
