"""The HC-PINN network, its trial function, the residual neural tangent kernel and its spectrum.

The trial function is ``u~(x) = A(x) + B(x) N(x; theta)`` with ``N`` a tanh MLP. The residual
kernel is ``K = J J^T`` with ``J[i, j] = d r(x_i; theta) / d theta_j``, the Jacobian of the PDE
residual at the collocation points with respect to every parameter (Wang, Yu and Perdikaris,
"When and why PINNs fail to train: a neural tangent kernel perspective", JCP 2022). Because
``r`` involves ``B``, ``grad B`` and ``hess B``, the boundary function modulates every row of
``J``: it filters the kernel's spectrum.

Spectral measures: the **effective rank** ``exp(H(p))`` with ``p_k = lambda_k / sum lambda``
(Roy and Vetterli, "The effective rank: a measure of effective dimensionality", EUSIPCO 2007),
which is 1 for a rank-one kernel and n for the identity; and the **condition number**
``lambda_max / lambda_min``.

The spectrum is taken from the singular values of ``J`` (``lambda_k = sigma_k^2``), not from
``eigvalsh(J J^T)``: forming ``K`` squares the spread, so ``eigvalsh`` resolves eigenvalues only
down to about ``eps lambda_max`` and returns round-off (clamped to 0) below, where the SVD of
``J`` (``n`` points by ``P`` parameters) resolves them down to about ``(max(n, P) eps)^2
lambda_max`` (:func:`roundoff_floor`). At these sizes even that floor is reached: the kernel is
numerically singular, and its condition number is at float64's limit
(:attr:`Spectrum.condition_at_limit`): its computed value is round-off, the true one is at least
``lambda_max / floor``.

Everything runs in float64 on the CPU with ``torch.func``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, jacfwd, jacrev, vmap

from tasks.hc_pinn.boundary import BoundarySpec, boundary_function
from tasks.hc_pinn.problems import Problem

Tensor = torch.Tensor
Params = dict[str, Tensor]

_TRANSFORMS = threading.Lock()

DEFAULT_WIDTH = 32
DEFAULT_DEPTH = 2


def make_network(dim: int, seed: int, width: int = DEFAULT_WIDTH, depth: int = DEFAULT_DEPTH
                 ) -> nn.Module:
    """A tanh MLP ``R^dim -> R`` with ``depth`` hidden layers of ``width``, float64, its
    initialisation drawn from ``seed`` (PyTorch's default Linear init)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        sizes = [dim] + [width] * depth
        for a, b in zip(sizes[:-1], sizes[1:], strict=True):
            layers += [nn.Linear(a, b), nn.Tanh()]
        layers.append(nn.Linear(sizes[-1], 1))
        return nn.Sequential(*layers).double()


class HCPinn:
    """One problem, one boundary function and one network: the trial function and the PDE
    residual as pure functions of ``(params, x)``."""

    def __init__(self, problem: Problem, spec: BoundarySpec, network: nn.Module):
        self.problem, self.spec, self.network = problem, spec, network
        self.boundary: Callable[[Tensor], Tensor] = boundary_function(spec, problem)

    def params(self) -> Params:
        return {k: v.detach() for k, v in self.network.named_parameters()}

    def trial(self, params: Params, x: Tensor) -> Tensor:
        """``u~`` at one point ``x`` of shape ``(d,)``: a scalar."""
        return self.predict(params, x.unsqueeze(0)).reshape(())

    def residual_at(self, params: Params, x: Tensor) -> Tensor:
        """The PDE residual at one point ``x`` of shape ``(d,)``: a scalar."""
        grad = jacrev(self.trial, argnums=1)(params, x)
        hess = jacfwd(jacrev(self.trial, argnums=1), argnums=1)(params, x)
        return self.problem.residual(x, self.trial(params, x), grad, hess)

    def residuals(self, params: Params, xs: Tensor) -> Tensor:
        """The residual at every row of ``xs`` ``(n, d)``: shape ``(n,)``, differentiable in
        ``params``. Batched reverse mode over the points (a few times faster than ``vmap`` of
        :meth:`residual_at` for training); the same values to round-off."""
        xs = xs.detach().requires_grad_(True)
        u = self.predict(params, xs)
        (grad,) = torch.autograd.grad(u.sum(), xs, create_graph=True)
        hess = torch.stack([torch.autograd.grad(grad[:, i].sum(), xs, create_graph=True)[0]
                            for i in range(xs.shape[1])], dim=1)
        return self.problem.residual(xs, u, grad, hess)

    def predict(self, params: Params, xs: Tensor) -> Tensor:
        """``u~`` at every row of ``xs``: shape ``(n,)``."""
        n = functional_call(self.network, params, (xs,)).squeeze(-1)
        return self.problem.lift(xs) + self.boundary(xs) * n

    def residual_jacobian(self, xs: Tensor, params: Params | None = None) -> Tensor:
        """``J`` of shape ``(n, P)``: d residual_i / d theta, over all parameters in order, at
        ``params`` (None: the network's own)."""
        params = self.params() if params is None else params
        # One thread at a time: torch.func's forward-mode levels are process-wide state, and an
        # environment worker steps many environments on threads of one process.
        with _TRANSFORMS:
            jac = vmap(jacrev(self.residual_at, argnums=0), in_dims=(None, 0))(params, xs)
        return torch.cat([jac[k].reshape(xs.shape[0], -1) for k in params], dim=1)


def residual_ntk(pinn: HCPinn, xs: Tensor, params: Params | None = None) -> Tensor:
    """The residual kernel ``K = J J^T`` at the collocation points ``xs``: ``(n, n)``."""
    jac = pinn.residual_jacobian(xs, params)
    return jac @ jac.T


def jacobian_spectrum(pinn: HCPinn, xs: Tensor, params: Params | None = None) -> Tensor:
    """The eigenvalues of the residual kernel ``K = J J^T`` at ``xs``, descending, as the
    squared singular values of ``J``, shape ``(n,)`` (exact zeros beyond ``P``, the number of
    parameters). See the module docstring for why not :func:`eigenvalues` of
    :func:`residual_ntk`."""
    jac = pinn.residual_jacobian(xs, params)
    values = torch.linalg.svdvals(jac).square()
    return torch.cat([values, values.new_zeros(jac.shape[0] - values.numel())])


def roundoff_floor(values: Tensor, shape: tuple[int, int]) -> float:
    """The smallest eigenvalue that :func:`jacobian_spectrum` of an ``(n, P)`` Jacobian
    resolves: ``(max(n, P) eps sigma_max)^2``, the square of the default tolerance of
    ``numpy.linalg.matrix_rank``. Eigenvalues at or below it are round-off."""
    eps = torch.finfo(values.dtype).eps
    return float(values.max()) * (max(shape) * eps) ** 2


def eigenvalues(kernel: Tensor) -> Tensor:
    """The eigenvalues of a symmetric PSD kernel, descending, round-off negatives set to 0."""
    sym = 0.5 * (kernel + kernel.T)
    return torch.linalg.eigvalsh(sym).flip(0).clamp_min(0.0)


def effective_rank(values: Tensor) -> float:
    """Roy and Vetterli's effective rank of the non-negative spectrum ``values``:
    ``exp`` of the Shannon entropy of ``values / sum(values)``; 0 for an all-zero spectrum."""
    total = float(values.sum())
    if total <= 0.0:
        return 0.0
    p = values[values > 0] / total
    return math.exp(float(-(p * p.log()).sum()))


def condition_number(values: Tensor) -> float:
    """``lambda_max / lambda_min``; ``inf`` when the smallest is 0 (singular in float64)."""
    top, low = float(values.max()), float(values.min())
    return math.inf if low <= 0.0 else top / low


@dataclass(frozen=True)
class Spectrum:
    """What the environment reports of a kernel's eigenspectrum."""

    n: int
    effective_rank: float
    condition_number: float
    top_share: float       # lambda_1 / sum lambda
    modes_90: int          # eigenvalues holding 90 % of the trace
    trace: float
    numerical_rank: int    # eigenvalues above the round-off floor
    condition_at_limit: bool  # lambda_min is at the round-off floor: the condition number
    #                           is round-off, the true one at least lambda_max / floor

    @property
    def log10_condition(self) -> float:
        return math.log10(self.condition_number) if math.isfinite(self.condition_number) \
            else math.inf


def spectrum_of(values: Tensor, floor: float = 0.0) -> Spectrum:
    """The :class:`Spectrum` of a descending non-negative eigenvalue vector; eigenvalues at or
    below ``floor`` are round-off (:func:`roundoff_floor`)."""
    total = float(values.sum())
    share = values / total if total > 0 else values
    modes_90 = int(torch.searchsorted(share.cumsum(0), torch.tensor(0.9, dtype=share.dtype))) + 1
    return Spectrum(n=int(values.numel()), effective_rank=effective_rank(values),
                    condition_number=condition_number(values),
                    top_share=float(share[0]) if total > 0 else 0.0,
                    modes_90=min(modes_90, int(values.numel())), trace=total,
                    numerical_rank=int((values > floor).sum()),
                    condition_at_limit=bool(float(values.min()) <= floor))


def analyse(problem: Problem, spec: BoundarySpec, seed: int, *, width: int = DEFAULT_WIDTH,
            depth: int = DEFAULT_DEPTH, points_per_axis: int | None = None
            ) -> tuple[Spectrum, Tensor]:
    """Spectrum (and descending eigenvalues, :func:`jacobian_spectrum`) of the residual kernel
    at initialisation, for the network drawn from ``seed``."""
    pinn = HCPinn(problem, spec, make_network(problem.dim, seed, width, depth))
    xs = problem.collocation(points_per_axis)
    values = jacobian_spectrum(pinn, xs)
    n_params = sum(p.numel() for p in pinn.network.parameters())
    return spectrum_of(values, roundoff_floor(values, (xs.shape[0], n_params))), values
