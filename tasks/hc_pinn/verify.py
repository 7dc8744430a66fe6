"""Serverless verification of an HC-PINN design: train the proposed HC-PINN for a fixed budget
and score how far it converged. This is the expensive, stateless check of the ``hc_pinn`` env
task; it runs as its own Lambda function (``rollarc-reward-pinn``, a container image with torch
on the CPU: ``resources/lambda/template.yaml``), not on the environment workers.

Score: ``min(1, -log10(loss) / DECADES)``, the decades the relative residual loss fell in
:data:`VERIFY_STEPS` Adam steps, out of :data:`DECADES` (1 at ``10^-3``, about 0.07 for a
collapsed design stuck at 0.6), minus the format penalty per reply that named no boundary
function. Success: the loss fell below :data:`SUCCESS_LOSS`. The design scored is the agent's
last valid proposal, re-parsed from its replies; the problem and the network's seed come from
the environment's ``info``.

A result depends only on (problem, design, seed), so a warm sandbox keeps the results it has
computed (:func:`converge`): a group's members share the problem and often the design.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

from tasks.hc_pinn.grammar import BoundarySpec, parse_replies

VERIFY_STEPS = 300
VERIFY_LR = 3e-3
DECADES = 3.0
SUCCESS_LOSS = 0.05


@functools.lru_cache(maxsize=1024)
def converge(problem: str, spec: BoundarySpec, init_seed: int) -> dict[str, Any]:
    """Train once and return what the score needs (cached per process)."""
    import torch

    from tasks.hc_pinn.problems import get_problem
    from tasks.hc_pinn.training import train

    # A Lambda sandbox has about one vCPU per 1769 MB; the emulator sets OMP_NUM_THREADS to match.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = train(get_problem(problem), spec, init_seed, max_steps=VERIFY_STEPS,
                   lr=VERIFY_LR, threshold=10.0 ** -DECADES)
    return {"final_loss": result.final_loss, "l2_error": result.l2_error, "steps": result.steps}


def hc_pinn_convergence(item: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Train the agent's last valid proposal and score its convergence (module docstring).
    Needs ``info.problem`` and ``info.init_seed``; no valid proposal scores 0."""
    info = item["info"]
    penalty = float(info.get("format_penalty", 0.0))
    valid, format_errors = parse_replies(item["responses"])
    if not valid:
        return -penalty * format_errors, {"success": False, "format_errors": format_errors,
                                          "spec": None}
    spec = valid[-1]
    run = converge(str(info["problem"]), spec, int(info["init_seed"]))
    loss = run["final_loss"]
    decades = -math.log10(loss) if loss > 0 else DECADES
    score = max(0.0, min(1.0, decades / DECADES)) if math.isfinite(loss) else 0.0
    return score - penalty * format_errors, {
        "success": bool(math.isfinite(loss) and loss <= SUCCESS_LOSS), "spec": str(spec),
        "format_errors": format_errors, "final_loss": loss, "l2_error": run["l2_error"],
        "train_steps": run["steps"],
        "agrees_with_env": (loss <= SUCCESS_LOSS) == bool(info.get("success", False))}
