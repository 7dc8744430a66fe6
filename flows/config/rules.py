"""Checks across the sections of a training config, one function per rule.

Each rule takes the whole config and raises ``ValueError`` with a message that names the keys
involved; :func:`check_rules` runs them in order. A rule reads fields only: it imports no
component (those are resolved afterwards, by :func:`flows.config.loading.check_components`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from flows.config.choices import Mode, Placement, RewardBackend
from flows.config.derived import is_emulated, known_profiles
from resources.pools import Role
from tasks.components import describe

if TYPE_CHECKING:
    from flows.config.schema import TrainConfig


def env_task_names_unique(cfg: TrainConfig) -> None:
    names = [t.name for t in cfg.env_tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"env_tasks names must be unique, got {names}")


def in_flight_holds_a_group(cfg: TrainConfig) -> None:
    biggest = max(t.group_size for t in cfg.env_tasks)
    if cfg.rollout.max_in_flight < biggest:
        raise ValueError(f"rollout.max_in_flight ({cfg.rollout.max_in_flight}) must hold "
                         f"a whole group ({biggest})")


def stragglers_name_pools(cfg: TrainConfig) -> None:
    pool_names = {p.name for p in cfg.cluster.pools}
    for pool in cfg.faults.stragglers:
        if pool not in pool_names:
            raise ValueError(f"faults.stragglers.{pool}: no such pool; pools: "
                             f"{sorted(pool_names)}")


def profiles_known(cfg: TrainConfig) -> None:
    known = known_profiles(cfg)
    for i, p in enumerate(cfg.cluster.pools):
        if p.profile not in known:
            raise ValueError(f"cluster.pools.{i}.profile: unknown hardware profile "
                             f"{p.profile!r}; known: {sorted(known)}")
    if cfg.placement == Placement.MONOLITHIC and cfg.cluster.monolithic_profile not in known:
        raise ValueError(f"cluster.monolithic_profile: unknown hardware profile "
                         f"{cfg.cluster.monolithic_profile!r}")


def sampling_matches_trainer_temperature(cfg: TrainConfig) -> None:
    for t in cfg.env_tasks:
        temp = (t.sampling or cfg.rollout.sampling).temperature
        if temp != cfg.trainer.hparams.temperature:
            raise ValueError(
                f"sampling temperature of {t.name} ({temp}) must equal "
                f"trainer.hparams.temperature ({cfg.trainer.hparams.temperature}): the "
                "trainer recomputes log-probs of the same sampling distribution")


def pools_cover_every_role(cfg: TrainConfig) -> None:
    roles = {p.role for p in cfg.cluster.pools}
    needs = [Role.SERVERLESS] + ([] if Role.ALL in roles else
                                 [Role.INFERENCE, Role.ENV, Role.TRAIN])
    for need in needs:
        if need not in roles:
            raise ValueError(f"cluster.pools has no pool with role {need.value!r}")


def one_lambda_endpoint(cfg: TrainConfig) -> None:
    r = cfg.reward
    if r.backend == RewardBackend.LAMBDA and r.emulator.enabled and r.endpoint_url:
        raise ValueError("reward.endpoint_url is set and reward.emulator.enabled is true: "
                         "choose one (emulator.enabled=false to use the endpoint)")


def lambda_rewards_are_dotted_paths(cfg: TrainConfig) -> None:
    if cfg.reward.backend != RewardBackend.LAMBDA:
        return
    for i, t in enumerate(cfg.env_tasks):
        if not isinstance(t.reward_fn, str):
            raise ValueError(
                f"env_tasks.{i}.reward_fn: a Python callable ({describe(t.reward_fn)}) "
                "cannot run on AWS Lambda (reward.backend=lambda): deploy it and name "
                "it by its dotted path, or set reward.backend=local")


def judge_needs_emulated_devices(cfg: TrainConfig) -> None:
    judge = cfg.reward.judge
    if judge is None:
        return
    if not is_emulated(cfg.engine):
        raise ValueError("reward.judge emulates a reward model's GPU time: it needs "
                         "engine.backend=emulated")
    if judge.profile not in known_profiles(cfg):
        raise ValueError(f"reward.judge.profile: unknown hardware profile {judge.profile!r}")


def env_barrier_is_sync(cfg: TrainConfig) -> None:
    if cfg.rollout.env_barrier and cfg.mode != Mode.SYNC:
        raise ValueError("rollout.env_barrier (batch-level environment handling) is a "
                         "baseline of mode=sync")


def min_max_staleness(window_batches: int) -> int:
    """The staleness async admission produces by design: a trajectory admitted while the
    trainer is at v may be trained up to ``window_batches`` steps later, and its first turn may
    still run on v - 1 weights while v is being loaded (one step of sync lag)."""
    return window_batches + 1


def staleness_fits_the_window(cfg: TrainConfig) -> None:
    floor = min_max_staleness(cfg.rollout.window_batches)
    if cfg.mode == Mode.ASYNC and cfg.rollout.max_staleness < floor:
        raise ValueError(
            f"rollout.max_staleness ({cfg.rollout.max_staleness}) is below what "
            f"rollout.window_batches ({cfg.rollout.window_batches}) implies plus one step "
            f"of weight-sync lag ({floor}): most rollouts would go stale by design")


RULES: tuple[Callable[[TrainConfig], None], ...] = (
    env_task_names_unique, in_flight_holds_a_group, stragglers_name_pools, profiles_known,
    sampling_matches_trainer_temperature, pools_cover_every_role, one_lambda_endpoint,
    lambda_rewards_are_dotted_paths, judge_needs_emulated_devices, env_barrier_is_sync,
    staleness_fits_the_window)


def check_rules(cfg: TrainConfig, rules=RULES) -> None:
    """Run every rule; the first broken one raises."""
    for rule in rules:
        rule(cfg)
