"""Sampled trajectories of each train batch as readable text (``metrics.dump_trajectories`` or
``python flows/train.py --dump-trajectories N``): turn by turn, the action the policy took, the
environment's reward and the policy versions that sampled it; then the trajectory's reward."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from tasks.records import Trajectory


def turn_versions(traj: Trajectory) -> list[list[int]]:
    """The policy versions of each turn's generated tokens (a turn is a run of loss-mask
    tokens); several when the weights changed in the middle of a response."""
    mask = np.asarray(traj.loss_mask, dtype=bool)
    versions = np.asarray(traj.versions)
    out, start = [], None
    for i, m in enumerate([*mask.tolist(), False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append(sorted({int(v) for v in versions[start:i]}))
            start = None
    return out


def format_trajectory(traj: Trajectory, step: int) -> str:
    versions = turn_versions(traj)
    lines = [f"== step {step} | {traj.env_name} | trajectory {traj.traj_id} (group "
             f"{traj.group_id}, seed {traj.seed}, attempt {traj.attempt}) | reward "
             f"{traj.reward if traj.reward is None else f'{traj.reward:+.3f}'} | success "
             f"{traj.success} | turns {traj.num_turns}"
             + (" | truncated" if traj.truncated else "")]
    for t, action in enumerate(traj.responses):
        env_r = traj.env_rewards[t] if t < len(traj.env_rewards) else None
        v = versions[t] if t < len(versions) else []
        lines.append(f"  turn {t + 1}: action {action!r} | env reward "
                     f"{'-' if env_r is None else f'{env_r:+.2f}'} | policy version "
                     f"{','.join(map(str, v)) or '-'}")
    if traj.reward_details:
        lines.append(f"  reward details: {traj.reward_details}")
    if traj.format_errors:
        lines.append(f"  format errors: {traj.format_errors}")
    return "\n".join(lines) + "\n"


class TrajectoryDump:
    """Appends ``per_step`` trajectories of each train batch, drawn with a seeded sampler."""

    def __init__(self, path: Path, per_step: int, seed: int):
        self.path, self.per_step, self.seed = Path(path), per_step, seed

    def __call__(self, step: int, trajectories: list[Trajectory]) -> None:
        rng = random.Random(f"{self.seed}/dump/{step}")
        picked = rng.sample(trajectories, min(self.per_step, len(trajectories)))
        with self.path.open("a") as f:
            for traj in sorted(picked, key=lambda t: int(t.traj_id)):
                f.write(format_trajectory(traj, step))
