"""The simulator's settings: the ``simulate:`` section of a config (:class:`SimSettings`), its
``simulate.key=value`` overrides, and a training config loaded together with it."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from flows.config import ConfigError, TrainConfig, read_config_file, validated
from flows.config.overrides import apply_overrides, check_path, parse_value

SIM_PREFIX = "simulate."  # overrides of the simulate: section, not of the run's config


class TurnCount(BaseModel):
    """Turns of one trajectory: ``mean`` on average (the two integers around it), at most
    ``max``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean: float = Field(gt=0, description="Mean turns per trajectory")
    max: int = Field(default=1000, ge=1, description="Most turns")

    def sample(self, rng: random.Random) -> int:
        low = math.floor(self.mean)
        n = low + (rng.random() < self.mean - low)
        return int(min(self.max, max(1, n)))


class SimSettings(BaseModel):
    """The ``simulate:`` section of a config: what the simulator needs beyond the run's."""

    model_config = ConfigDict(extra="forbid")

    gpus: int | None = Field(default=None, ge=1, description="Scale the GPU pools (and the "
                             "batch, env slots and max_in_flight with them) to about this many "
                             "GPUs; null: the config's pools as they are")
    hours: float | None = Field(default=None, gt=0, description="Simulated hours to run "
                                "(null: until trainer.max_steps)")
    turns: dict[str, TurnCount] = Field(default_factory=dict, description="Turns per "
                                        "trajectory by env task (default: the env's max_turns)")
    local_env_step_s: float = Field(default=0.002, ge=0, description="Step time of an "
                                    "environment with no remote latency")
    turn_overhead_s: float = Field(default=0.0, ge=0, description="Fixed time a turn spends "
                                   "outside its tasks (messages, transfers) beyond the queues")
    turn_overhead_per_turn_in_flight_s: float = Field(
        default=0.0, ge=0, description="Time a turn spends outside its tasks for each turn in "
        "flight when it is submitted, less those waiting on their environment: orchestration "
        "sharing the host's cores (fitted by flows/simulate.py --calibrate)")
    turn_overhead_per_hop_in_flight_s: float = Field(
        default=0.0, ge=0, description="... and for each hand-off between workers in it (env -> "
        "prefill -> decode -> env) times the turns in flight (fitted by --calibrate)")
    train_overhead_s: float = Field(default=0.0, ge=0, description="Fixed time per train step "
                                    "beyond the device model's")
    scheduler_us_per_task: float = Field(default=0.0, ge=0, description="Scheduler time per "
                                         "task (0: not modelled); from "
                                         "flows/benchmarks/scheduler.py")
    driver_us_per_event: float = Field(default=0.0, ge=0, description="Driver time per "
                                       "completion handled (0: not modelled)")
    shards: int = Field(default=1, ge=1, description="Schedulers the rollout is sharded over "
                        "(the scale remedy, cluster.shards), one driver for all")
    shard_drivers: bool = Field(default=False, description="A design the flow does not have: "
                                "one driver process per shard as well")
    group_placement: bool = Field(default=False, description="A design the flow does not "
                                  "have: a group's trajectories ready together share their "
                                  "workers, so that cohorts (rollout.cohort_max) form at scale")
    lambda_concurrency: int | None = Field(default=None, ge=1, description="Concurrent Lambda "
                                           "instances per function (null: the emulator's, or "
                                           "1000, AWS's default account limit)")
    lambda_cold_start_s: float = Field(default=0.5, ge=0, description="A new instance's start")
    lambda_latency_s: float | None = Field(default=None, ge=0, description="Per call (null: "
                                           "reward.emulator.latency_s)")
    throttle_backoff_s: float = Field(default=0.1, ge=0, description="Wait before a throttled "
                                      "call is retried")
    reward_flush_s: float = Field(default=0.1, ge=0, description="The driver sends the "
                                  "finished trajectories waiting for scoring at most this "
                                  "often (its loop gathers completions for about as long)")
    seed: int | None = Field(default=None, description="Seed of the simulator's own draws "
                             "(null: the run's)")


def load(path: str | Path, overrides: list[str] = ()) -> tuple[TrainConfig, SimSettings]:
    """A training config and its ``simulate:`` section, overrides applied to both."""
    data = read_config_file(Path(path))
    sim = data.pop("simulate", None) or {}
    train, settings = split_overrides(overrides)
    apply_overrides(data, train)
    cfg, sim_cfg = validated(data), sim_settings(sim, settings)
    names = {t.name for t in cfg.env_tasks}
    for name in sim_cfg.turns:
        if name not in names:
            raise ConfigError(f"simulate.turns.{name}: no such env task; env tasks: "
                              f"{sorted(names)}")
    return cfg, sim_cfg


def split_overrides(overrides) -> tuple[list[str], list[str]]:
    """(the run's overrides, the ``simulate.*`` ones)."""
    sim = [o for o in overrides if o.startswith(SIM_PREFIX)]
    return [o for o in overrides if not o.startswith(SIM_PREFIX)], sim


def sim_settings(section: dict, overrides: list[str] = ()) -> SimSettings:
    """The ``simulate:`` section with ``simulate.key=value`` overrides, validated; a bad key
    or value is a ConfigError naming it."""
    section = json.loads(json.dumps(section))
    for item in overrides:
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")[1:]
        check_path(SimSettings, parts[:1], key)
        node = section
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parse_value(raw)
    try:
        return SimSettings.model_validate(section)
    except Exception as exc:  # pydantic's ValidationError: name the key
        err = exc.errors()[0]  # type: ignore[attr-defined]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"simulate.{loc}: {err['msg']}") from None
