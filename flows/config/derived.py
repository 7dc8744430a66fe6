"""What a training config implies, computed from its fields: the pools a placement gives, the
trainer's devices and hyper-parameters, the production model device times are computed for,
the Lambda functions it calls, the environments with faults injected, Dask's ``Security``.

The schema holds shape only; these are the config's consequences, in one place. None of them
imports torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flows.config.choices import Placement
from resources.affinity import workload_model
from resources.catalog import CATALOG, get_profile
from resources.device_model import ModelSpec, model_spec
from resources.pools import PoolSpec, Role
from tasks.components import COMPONENT, describe

if TYPE_CHECKING:
    from distributed.security import Security

    from flows.config.cluster import TLSConfig
    from flows.config.schema import TrainConfig
    from flows.config.sections import EngineConfig, EnvTaskConfig, FaultsConfig, RewardConfig
    from tasks.specs import TrainerHParams

EMULATED_BACKEND = "resources.emulated.emulated_backend"


def known_profiles(cfg: TrainConfig) -> set[str]:
    """Hardware profile names a pool may use: the catalog's and the config's own."""
    return set(CATALOG) | set(cfg.affinity.profiles)


def batch_trajectories(cfg: TrainConfig) -> int:
    """Trajectories in one train batch, on average over the mix."""
    return round(sum(t.group_size * t.weight for t in cfg.env_tasks)
                 / sum(t.weight for t in cfg.env_tasks) * cfg.trainer.groups_per_step)


def trainer_hparams(cfg: TrainConfig) -> TrainerHParams:
    """The trainer's hyper-parameters, the lr decay spanning the run unless set."""
    hp = cfg.trainer.hparams
    return hp.model_copy(update={"total_steps": hp.total_steps or cfg.trainer.max_steps})


def effective_pools(cfg: TrainConfig) -> list[PoolSpec]:
    """The pools the run starts: the config's; monolithic, one pool of the same total size
    whose workers carry every tag (the serverless pool kept)."""
    if cfg.placement == Placement.DISAGGREGATED:
        return list(cfg.cluster.pools)
    serverless = [p for p in cfg.cluster.pools if p.role is Role.SERVERLESS]
    hardware = [p for p in cfg.cluster.pools if p.role is not Role.SERVERLESS]
    c = cfg.cluster
    return [PoolSpec(name="monolithic", profile=c.monolithic_profile, role=Role.ALL,
                     workers=c.monolithic_workers or sum(p.workers for p in hardware),
                     slots=max(p.slots for p in hardware),
                     gpus=c.monolithic_gpus or max(p.gpus for p in hardware))] + serverless


def trainer_gpus(cfg: TrainConfig) -> int:
    """Devices the trainer spans: its pool's, or every device of the monolithic pool
    (colocated training time-shares them all with generation)."""
    pool = next(p for p in effective_pools(cfg) if p.role in (Role.TRAIN, Role.ALL))
    return pool.gpus * (pool.workers if pool.role is Role.ALL else 1)


def is_emulated(engine: EngineConfig) -> bool:
    """Whether the inference backend is the emulated one (the trainer is then emulated too),
    told from its dotted path or, given as an object, from its name: nothing is imported."""
    backend = engine.backend[COMPONENT]
    if isinstance(backend, str):
        return backend == EMULATED_BACKEND
    return f"{getattr(backend, '__module__', '')}.{getattr(backend, '__qualname__', '')}" \
        == EMULATED_BACKEND


def emulation(engine: EngineConfig) -> dict | None:
    """What the workers need to emulate devices (None: a real backend)."""
    if not is_emulated(engine):
        return None
    return {"device": engine.device.model_dump(), "time_scale": engine.time_scale}


def device_model(cfg: TrainConfig) -> ModelSpec:
    """The production model device times are computed for: the emulated one, else the
    affinity router's workload."""
    if is_emulated(cfg.engine):
        return model_spec(cfg.engine.device.model)
    return workload_model(cfg.affinity.workload)


def pool_hardware(cfg: TrainConfig) -> dict[str, tuple[dict, int]]:
    """Each effective pool's hardware profile and devices per worker."""
    return {p.name: (get_profile(p.profile, cfg.affinity.profiles).model_dump(), p.gpus)
            for p in effective_pools(cfg)}


def reward_name(env_task: EnvTaskConfig) -> str:
    """What an env task's score requests call its reward: the dotted path, or for a Python
    callable its name and the env task's (two partials of one function differ)."""
    if isinstance(env_task.reward_fn, str):
        return env_task.reward_fn
    return f"{describe(env_task.reward_fn)}@{env_task.name}"


def lambda_function_of(reward: RewardConfig, env_task: EnvTaskConfig) -> str:
    """The Lambda function that scores ``env_task``."""
    return env_task.lambda_function or reward.lambda_function


def lambda_functions(cfg: TrainConfig) -> set[str]:
    """The Lambda functions the run calls."""
    return {lambda_function_of(cfg.reward, t) for t in cfg.env_tasks}


def reward_client_settings(reward: RewardConfig, emulator_url: str | None) -> dict:
    """What a reward client is built from (``build_reward_client``): the reward settings, the
    endpoint resolved to the running emulation's URL when there is one."""
    return reward.model_dump() | {"endpoint_url": emulator_url or reward.endpoint_url,
                                  "emulated": emulator_url is not None}


def with_env_faults(faults: FaultsConfig, env: dict[str, Any]) -> dict[str, Any]:
    """An environment's component spec with the injected faults of ``faults.env`` (itself when
    there are none)."""
    e = faults.env
    if not e.active:
        return env
    return {COMPONENT: "tasks.envs.latency.RemoteLatency", "env": env,
            "failure_rate": e.crash_rate, "hang_rate": e.hang_rate, "hang_s": e.hang_s,
            "step_latency": e.step_latency}


def tls_security(tls: TLSConfig) -> Security | None:
    """Dask's ``Security`` for every role (client, scheduler, worker), or None (plain TCP)."""
    if tls.ca_file is None:
        return None
    from distributed.security import Security  # distributed is imported only when TLS is used

    pair = {"cert": tls.cert_file, "key": tls.key_file}
    return Security(tls_ca_file=tls.ca_file, require_encryption=tls.require_encryption,
                    **{f"tls_{role}_{part}": path for role in ("client", "scheduler", "worker")
                       for part, path in pair.items()})
