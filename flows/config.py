"""One typed schema for the training flow: YAML holds values, this holds shape.

``load_config(path, overrides)`` reads YAML, applies dotted overrides (``trainer.max_steps=20``,
``env_tasks.0.weight=0.5``) and validates. Any problem raises :class:`ConfigError` whose message
names the key; the entry point prints that one line and exits with status 2.

Through the Python API a component (``_component_``) or a reward function may be a Python object
instead of a dotted path (a class or function defined in a notebook cell, a
``functools.partial``)::

    cfg = load_config()
    cfg.env_tasks[0].env = {"_component_": MyEnv, "size": 4}
    cfg.env_tasks[0].reward_fn = my_reward          # run by reward.backend=local
    cfg = validate(cfg)                              # re-checks the whole config

An entry of ``env_tasks`` (an environment, its weight in the mix, its reward) is an *env task*.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from flows.dispatch import Dispatch
from flows.orchestration import min_max_staleness
from flows.workload import TurnShapeConfig
from resources.affinity import Objective, Workload, workload_model
from resources.catalog import CATALOG, HardwareProfile, get_profile
from resources.device_model import ModelSpec, model_spec
from resources.emulated import DeviceEmulation, JudgeEmulation
from resources.engine import backend_context
from resources.pools import PoolSpec, Role
from tasks.components import COMPONENT, check_component, check_signature, describe, resolve
from tasks.envs.base import EVAL_SEED_OFFSET
from tasks.policy import PolicySpec
from tasks.reward_service import resolve_reward
from tasks.trainer import TrainerHParams

if TYPE_CHECKING:  # distributed is imported only when TLS is used
    from distributed.security import Security

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "default.yaml"


class ConfigError(ValueError):
    """A bad config; the message names the key."""


# Keys renamed so that a reward's Python path and its Lambda function cannot be confused.
RENAMED = {"reward": "reward_fn", "reward_function": "lambda_function",
           "function_name": "lambda_function"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              arbitrary_types_allowed=True)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in RENAMED.items():
                if old in data and old not in cls.model_fields and new in cls.model_fields:
                    raise ValueError(f"{old!r} was renamed {new!r}")
        return data


def _component_spec(v: Any) -> Any:
    """``{_component_: path or object, **kwargs}``; a bare Python object becomes its spec."""
    if callable(v) and not isinstance(v, dict):
        return {COMPONENT: v}
    if not isinstance(v, dict):
        raise ValueError("must be a mapping with a _component_ key")
    if COMPONENT not in v:
        raise ValueError("needs a _component_ key")
    if not isinstance(v[COMPONENT], str) and not callable(v[COMPONENT]):
        raise ValueError("_component_ must be a dotted path or a Python callable")
    return v


ComponentSpec = Annotated[dict[str, Any], BeforeValidator(_component_spec)]


def _reward_fn(v: Any) -> Any:
    if isinstance(v, str) or callable(v):
        return v
    raise ValueError("must be a dotted path or a Python callable")


RewardFn = Annotated[str | Callable[..., Any], BeforeValidator(_reward_fn)]


class SamplingConfig(_Strict):
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature")
    max_new_tokens: int = Field(default=16, ge=1, description="Response tokens per turn at most")
    greedy: bool = Field(default=False, description="Take the most likely token (tests, "
                         "oracle runs); evaluation is always greedy")


class EnvTaskConfig(_Strict):
    """One env task: an environment, its share of the mix, and how it is rewarded."""

    name: str = Field(description="Name used in metrics (env/<name>/...)")
    env: ComponentSpec = Field(description="{_component_: path or class, **kwargs} of a TextEnv")
    weight: float = Field(default=1.0, gt=0, description="Share of groups drawn from this env "
                          "task")
    group_size: int = Field(default=8, ge=2, description="Trajectories per group (same seed)")
    reward_fn: RewardFn = Field(
        default="tasks.rewards.env_return",
        description="Reward function: a dotted path in tasks.rewards or tasks.reward_models "
                    "(what the Lambda handler may call), or a Python callable (backend local)")
    lambda_function: str | None = Field(
        default=None, description="Lambda function that runs reward_fn (null: "
                                  "reward.lambda_function); model-based rewards need the model one")
    seed_range: int = Field(default=1_000_000, ge=1, le=EVAL_SEED_OFFSET,
                            description="Training seeds drawn below this (held-out evaluation "
                                        "seeds start at 10**9)")
    sampling: SamplingConfig | None = Field(default=None,
                                            description="Overrides rollout.sampling for this "
                                                        "env task")
    shape: TurnShapeConfig | None = Field(
        default=None, description="Virtual prompt and response lengths per turn on emulated "
                                  "devices (flows.workload); null: the real lengths")

    def reward_name(self) -> str:
        """What this env task's score requests call its reward: the dotted path, or for a
        Python callable its name and the env task's (two partials of one function differ)."""
        if isinstance(self.reward_fn, str):
            return self.reward_fn
        return f"{describe(self.reward_fn)}@{self.name}"


class RolloutConfig(_Strict):
    max_staleness: int = Field(default=2, ge=0, description="Bound on trained staleness (steps)")
    window_batches: int = Field(
        default=1, ge=1,
        description="Async: batches admitted beyond those being trained; about the staleness "
                    "admission aims for (max_staleness is the hard bound)")
    spare_groups: int = Field(
        default=0, ge=0,
        description="Async: groups admitted beyond the window, so a batch is cut from the groups "
                    "that finish first instead of waiting for the last straggler")
    max_in_flight: int = Field(default=96, ge=1, description="Trajectories rolling out at once")
    max_attempts: int = Field(default=2, ge=1, description="Attempts per trajectory on failure "
                              "(a task error, a lost worker, a turn past turn_timeout_s)")
    turn_timeout_s: float | None = Field(
        default=300, gt=0, description="Watchdog: a turn (prefill, decode, env step) not "
        "answered within this many seconds is abandoned, the environment or stage that stopped "
        "answering named in the log, and the trajectory restarted or dropped (null: no limit)")
    end_timeout_s: float = Field(
        default=120, gt=0, description="After the last train step, the longest the run waits "
        "for the turns, scores and evaluation episodes still in flight; then they are "
        "cancelled, their environments closed and their trajectories dropped as run_ended, "
        "and the run ends")
    cohort_max: int = Field(
        default=64, ge=1, description="Turns ready at once on the same workers go as one task "
        "per stage, this many trajectories at most (1: a task per trajectory and turn)")
    cohort_per_env_task: bool = Field(
        default=False, description="A cohort holds one env task, so every task's Dask span "
        "names its env task (exact time per env task in Fine Performance Metrics) at the cost "
        "of more, smaller tasks; false: a cohort mixing env tasks carries the span 'mixed'")
    dispatch: Dispatch = Field(
        default=Dispatch.SPLIT, description="split: every turn's prefill on the compute pool and "
        "decode on the bandwidth pool | length_aware: per turn, split or keep it on one pool, "
        "whichever the device model says finishes first for its expected response length")
    env_barrier: bool = Field(
        default=False, description="Sync: batch-level environment handling, a baseline: each "
                                   "turn of the batch waits until every trajectory has finished "
                                   "the turn before (false: each trajectory goes on alone)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)


class EmulatorConfig(_Strict):
    enabled: bool = Field(default=True, description="backend=lambda: start the local Lambda "
                          "emulation and point the client at it (no AWS account needed)")
    template: str | None = Field(default=None, description="SAM template whose functions it "
                                 "runs (null: resources/lambda/template.yaml)")
    host: str = Field(default="127.0.0.1", description="Address it binds")
    port: int = Field(default=0, ge=0, le=65535, description="Port (0: a free one)")
    concurrency: int = Field(default=4, ge=1, description="Sandbox processes per function; "
                             "calls beyond it get 429 TooManyRequestsException")
    latency_s: float = Field(default=0.0, ge=0, description="Added to every call (a remote "
                             "service's round trip; waits, burns no core)")
    init_delay_s: float = Field(default=0.0, ge=0, description="Added to every cold start")


class RewardConfig(_Strict):
    backend: Literal["local", "lambda"] = Field(
        default="lambda", description="lambda: boto3 lambda.invoke (AWS, or the emulation); "
                                      "local: the handler's core in-process")
    lambda_function: str = Field(default="rollarc-reward",
                                 description="Lambda function of env tasks that name none")
    region: str = Field(default="us-east-1", description="AWS region")
    endpoint_url: str | None = Field(default=None, description="Lambda endpoint (null: AWS, or "
                                     "the emulation when emulator.enabled)")
    concurrency: int = Field(default=16, ge=1, description="Concurrent invocations at most "
                             "(and the client's connection pool)")
    batch_max: int = Field(default=32, ge=1, description="Trajectories per invocation at most")
    min_batch: int = Field(default=4, ge=1, description="A burst is spread over concurrent "
                           "calls, but not below this many trajectories per call")
    max_payload_bytes: int = Field(default=6 * 1024 * 1024 - 64 * 1024, ge=1024,
                                   le=6 * 1024 * 1024,
                                   description="Event size per invocation (sync limit: 6 MB)")
    read_timeout_s: float = Field(default=130.0, gt=0, description="Above every function's "
                                  "timeout, or the SDK re-sends a long call and it runs twice")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="Connect timeout")
    sdk_max_attempts: int = Field(default=3, ge=1, description="botocore standard-mode attempts "
                                  "(throttles and transport errors)")
    throttle_retries: int = Field(default=8, ge=0, description="Client retries of a throttle "
                                  "that outlasted botocore's attempts")
    function_error_retries: int = Field(default=2, ge=0, description="Retries of a function "
                                        "error; then its trajectories are dropped with reason")
    emulator: EmulatorConfig = Field(default_factory=EmulatorConfig)
    judge: JudgeEmulation | None = Field(
        default=None, description="Emulated devices: the rewards are a model's, whose GPU time "
                                  "each call takes (lambda: a serverless instance per call; "
                                  "local: one dedicated engine on the reward worker)")

    def function_of(self, env_task: EnvTaskConfig) -> str:
        """The Lambda function that scores ``env_task``."""
        return env_task.lambda_function or self.lambda_function

    def functions(self, env_tasks: list[EnvTaskConfig]) -> set[str]:
        """The Lambda functions the run calls."""
        return {self.function_of(t) for t in env_tasks}

    def client_settings(self, emulator_url: str | None) -> dict:
        """What a reward client is built from (``build_reward_client``): these settings, the
        endpoint resolved to the running emulation's URL when there is one."""
        return self.model_dump() | {"endpoint_url": emulator_url or self.endpoint_url,
                                    "emulated": emulator_url is not None}


class TrainerConfig(_Strict):
    max_steps: int = Field(default=100, ge=1, description="Train steps (policy versions) to run")
    groups_per_step: int = Field(default=8, ge=1, description="Groups in one train batch")
    hparams: TrainerHParams = Field(default_factory=TrainerHParams)
    backend: ComponentSpec = Field(
        default_factory=lambda: {COMPONENT: "tasks.trainer.policy_trainer"},
        description="Trainer (tasks.trainer.Trainer), called with policy, hparams, seed, loss")
    loss: ComponentSpec = Field(
        default_factory=lambda: {COMPONENT: "tasks.losses.decoupled_ppo_loss"},
        description="Policy loss (tasks.losses.LossFn); extra keys are bound as kwargs")
    resume_from: str | None = Field(default=None, description="checkpoint.pt to resume from")
    checkpoint_every: int = Field(
        default=5, ge=0, description="Write a resumable checkpoint after the first train step "
        "and every this many steps under <run_dir>/checkpoints/ (0: only the final one): a lost "
        "trainer worker is rebuilt from the newest, and python flows/train.py --resume RUN_DIR "
        "continues from it")
    keep_checkpoints: int = Field(default=2, ge=1, description="Periodic checkpoints kept (the "
                                  "oldest are deleted)")


# engine.backend may name a built-in backend instead of giving its component spec
BACKENDS = {"hf": "resources.engine.hf_backend",
            "emulated": "resources.emulated.emulated_backend"}


def _backend_spec(v: Any) -> Any:
    if isinstance(v, str):
        if v not in BACKENDS:
            raise ValueError(f"unknown backend {v!r}: one of {sorted(BACKENDS)} or "
                             "{_component_: ...}")
        return {COMPONENT: BACKENDS[v]}
    return _component_spec(v)


class EngineConfig(_Strict):
    backend: Annotated[dict[str, Any], BeforeValidator(_backend_spec)] = Field(
        default_factory=lambda: {COMPONENT: BACKENDS["hf"]},
        description="Inference backend (tasks.inference.InferenceBackend) on every inference "
                    "worker: hf | emulated | {_component_: ...}, called with policy and "
                    "max_batch (and the worker's hardware, gpus, device, time_scale and "
                    "engine_id when it takes them)")
    time_scale: float = Field(default=1.0, gt=0, description="Multiplies every emulated wait "
                              "(device time, environment and reward latency): shrinks a "
                              "benchmark's wall time, every ratio kept")
    device: DeviceEmulation = Field(default_factory=DeviceEmulation,
                                    description="The production model and efficiencies the "
                                                "emulated backend and trainer emulate")

    @property
    def emulated(self) -> bool:
        """Whether the backend is the emulated one (the trainer is then emulated too)."""
        from resources.emulated import emulated_backend

        try:
            return resolve(self.backend[COMPONENT]) is emulated_backend
        except ImportError:
            return False

    def emulation(self) -> dict | None:
        """What the workers need to emulate devices (None: a real backend)."""
        if not self.emulated:
            return None
        return {"device": self.device.model_dump(), "time_scale": self.time_scale}


def _existing_file(v: str | None) -> str | None:
    if v is not None and not Path(v).is_file():
        raise ValueError("no such file" if not Path(v).exists() else "not a file")
    return v


TLSFile = Annotated[str | None, AfterValidator(_existing_file)]


class TLSConfig(_Strict):
    """TLS for every Dask connection (Dask's ``Security``); all null: plain TCP."""

    ca_file: TLSFile = Field(default=None, description="CA certificate (PEM) that signed every "
                             "certificate of the cluster (dask --tls-ca-file)")
    cert_file: TLSFile = Field(default=None, description="Certificate (PEM) this run's client, "
                               "scheduler and workers present (dask --tls-cert)")
    key_file: TLSFile = Field(default=None, description="Private key (PEM) of cert_file (dask "
                              "--tls-key)")
    require_encryption: bool = Field(default=True, description="Refuse plain-TCP connections "
                                     "once TLS is set")

    @model_validator(mode="after")
    def _together(self) -> TLSConfig:
        given = {k: getattr(self, k) for k in ("ca_file", "cert_file", "key_file")}
        missing = [k for k, v in given.items() if v is None]
        if missing and len(missing) < len(given):  # Dask's TLS is mutual: all three or none
            raise ValueError(f"{missing[0]} is needed with "
                             f"{[k for k in given if k not in missing][0]} (TLS takes a CA, "
                             "a certificate and its key)")
        return self

    @property
    def enabled(self) -> bool:
        """Whether TLS is configured."""
        return self.ca_file is not None

    def security(self) -> Security | None:
        """Dask's ``Security`` for every role (client, scheduler, worker), or None (plain
        TCP)."""
        if not self.enabled:
            return None
        from distributed.security import Security

        pair = {"cert": self.cert_file, "key": self.key_file}
        return Security(tls_ca_file=self.ca_file, require_encryption=self.require_encryption,
                        **{f"tls_{role}_{part}": path for role in ("client", "scheduler", "worker")
                           for part, path in pair.items()})


class AdaptiveEnvConfig(_Strict):
    enabled: bool = Field(default=False, description="Scale the environment pool with demand "
                          "(embedded local cluster): add CPU_ENV workers when environment work "
                          "fills the pool, retire idle ones once their live instances are done")
    min_workers: int = Field(default=1, ge=1, description="Fewest environment workers")
    max_workers: int = Field(default=4, ge=1, description="Most environment workers")
    high: float = Field(default=0.7, gt=0, description="Add a worker above this share of the "
                        "pool's slots busy with environment steps (mean over window_s)")
    low: float = Field(default=0.25, ge=0, description="Retire a worker below this share")
    window_s: float = Field(default=5.0, gt=0, description="Window of the busy share")
    cooldown_s: float = Field(default=5.0, ge=0, description="Wait after a change")

    @model_validator(mode="after")
    def _order(self) -> AdaptiveEnvConfig:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers "
                             f"({self.max_workers})")
        return self


class ClusterConfig(_Strict):
    pools: list[PoolSpec] = Field(description="Pools of the embedded local cluster")
    monolithic_workers: int | None = Field(default=None, ge=1, description="Workers of the "
                                           "monolithic pool (null: as many as the pools have)")
    monolithic_gpus: int | None = Field(default=None, ge=1, description="Devices per monolithic "
                                        "worker (null: the most a pool has)")
    monolithic_profile: str = Field(default="H800", description="Profile of the single pool "
                                    "that placement=monolithic uses")
    host: str = Field(default="127.0.0.1", description="Address the embedded scheduler, its "
                      "workers and dashboard bind (another than loopback is reachable from "
                      "other machines)")
    dashboard_port: int = Field(default=8787, ge=0, le=65535, description="Dashboard port")
    processes: bool = Field(default=True, description="Workers in separate processes (Nanny)")
    startup_timeout_s: float = Field(default=120, gt=0, description="Wait for workers")
    shards: int = Field(default=1, ge=1, description="Rollout shards: local Dask clusters, "
                        "each with its own scheduler and its own copy of the inference and "
                        "environment pools, over which whole groups are spread (1: one "
                        "cluster; the trainer and reward dispatch stay on the first)")
    adaptive_env: AdaptiveEnvConfig = Field(default_factory=AdaptiveEnvConfig)
    pool_empty_timeout_s: float = Field(
        default=300, gt=0, description="A pool (resource tag) left without any worker this long "
        "stops the run with a checkpoint (when the trainer is alive) instead of waiting on")
    tls: Annotated[TLSConfig, BeforeValidator(lambda v: {} if v is None else v)] = Field(
        default_factory=TLSConfig, description="TLS of the Dask connections, the embedded "
        "cluster's and --scheduler's (null: plain TCP)")


class AffinityConfig(_Strict):
    objective: Objective = Field(default=Objective.COST, description="time | cost")
    workload: Workload = Field(default_factory=Workload)
    profiles: dict[str, HardwareProfile] = Field(default_factory=dict,
                                                 description="Extra or overriding profiles")


class EvalConfig(_Strict):
    every_steps: int = Field(default=0, ge=0, description="Greedy evaluation on held-out seeds "
                             "every this many train steps, and after the last (0: off)")
    episodes: int = Field(default=8, ge=1, description="Held-out episodes per env task "
                          "and evaluation")


class SinkKind(StrEnum):
    JSONL = "jsonl"  # metrics.jsonl in the run directory
    TENSORBOARD = "tensorboard"  # event files under <run_dir>/tensorboard (extra: tensorboard)
    WANDB = "wandb"  # Weights & Biases; offline mode needs no network (extra: wandb)
    NULL = "null"  # nowhere


def _sink_list(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


class WandbConfig(_Strict):
    project: str = Field(default="rollarc", description="W&B project")
    entity: str | None = Field(default=None, description="W&B entity (team or user)")
    mode: Literal["offline", "online"] = Field(
        default="offline", description="offline: files under <run_dir>/wandb, to `wandb sync` "
                                       "later; online: needs WANDB_API_KEY and a network")


class MetricsConfig(_Strict):
    sinks: Annotated[list[SinkKind], BeforeValidator(_sink_list)] = Field(
        default_factory=lambda: [SinkKind.JSONL],
        description="Where train and evaluation rows go, several at once: jsonl | tensorboard "
                    "| wandb | null")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    dashboard: bool = Field(default=True, description="The RollArc page, rollarc_ series on "
                            "/metrics and events on the scheduler's dashboard")
    curves: bool = Field(default=True, description="Draw curves.png in the run directory at "
                         "the end")
    performance_report: bool = Field(default=True, description="Save Dask's performance "
                                     "report (dask-report.html) of the run")
    dump_trajectories: int = Field(default=0, ge=0, description="Sampled trajectories per "
                                   "train step written as text to trajectories.txt")
    progress: bool = Field(default=True, description="Live progress line")
    task_stream: bool = Field(default=False, description="Save every task's worker, stage, "
                              "start and stop to task_stream.json (benchmark timelines)")


class EnvFaults(_Strict):
    crash_rate: float = Field(default=0.0, ge=0, lt=1, description="Share of environment "
                              "resets and steps that raise (a sandbox that crashed)")
    hang_rate: float = Field(default=0.0, ge=0, lt=1, description="Share of steps that stop "
                             "answering for hang_s (for rollout.turn_timeout_s to notice)")
    hang_s: float = Field(default=600, ge=0, description="How long a hung step is silent")
    step_latency: dict[str, Any] | float | None = Field(
        default=None, description="Extra latency of every step, a tasks.envs.latency.Latency "
        "spec (e.g. {kind: heavy_tail, p50_s: 0.01, p99_over_p50: 50}: straggling sandboxes)")

    @field_validator("step_latency")
    @classmethod
    def _latency(cls, v):
        from tasks.envs.latency import Latency

        Latency.of(v)  # raises ValueError naming what is wrong
        return v

    @property
    def active(self) -> bool:
        return bool(self.crash_rate or self.hang_rate or self.step_latency)


class RewardFaults(_Strict):
    """Faults of the local Lambda emulation (reward.emulator): each call draws one."""

    throttle_rate: float = Field(default=0.0, ge=0, lt=1, description="Calls answered 429 "
                                 "TooManyRequestsException (a throttling burst)")
    error_5xx_rate: float = Field(default=0.0, ge=0, lt=1, description="Calls answered 500 "
                                  "ServiceException")
    timeout_rate: float = Field(default=0.0, ge=0, lt=1, description="Calls whose function "
                                "times out: after timeout_s, Lambda's Sandbox.Timedout error")
    timeout_s: float = Field(default=0.0, ge=0, description="How long a timed-out call runs")
    function_error_rate: float = Field(default=0.0, ge=0, lt=1, description="Calls whose "
                                       "function raises (HTTP 200, X-Amz-Function-Error)")
    seed: int = Field(default=0, description="Seed of the draws")


class FaultsConfig(_Strict):
    """Faults injected on purpose: tests, and users' own drills."""

    env: EnvFaults = Field(default_factory=EnvFaults, description="Every env task's "
                           "environment wrapped in tasks.envs.latency.RemoteLatency")
    reward: RewardFaults = Field(default_factory=RewardFaults, description="The Lambda "
                                 "emulation's answers")
    stragglers: dict[str, float] = Field(
        default_factory=dict, description="Pool name -> slowdown factor (>= 1) of every "
        "inference and environment task its workers run (a slow machine)")

    @field_validator("stragglers")
    @classmethod
    def _factors(cls, v: dict[str, float]) -> dict[str, float]:
        for pool, factor in v.items():
            if factor < 1:
                raise ValueError(f"stragglers.{pool}: a slowdown factor is >= 1, got {factor}")
        return v

    def env_spec(self, env: dict[str, Any]) -> dict[str, Any]:
        """``env`` with the environment faults injected (itself when there are none)."""
        e = self.env
        if not e.active:
            return env
        return {COMPONENT: "tasks.envs.latency.RemoteLatency", "env": env,
                "failure_rate": e.crash_rate, "hang_rate": e.hang_rate, "hang_s": e.hang_s,
                "step_latency": e.step_latency}


class TrainConfig(_Strict):
    """The training flow's configuration (flows/train.py)."""

    seed: int = Field(default=0, description="Global seed")
    mode: Literal["async", "sync"] = Field(default="async", description="async | sync")
    placement: Literal["disaggregated", "monolithic"] = Field(default="disaggregated",
                                                              description="Pools or one pool")
    policy: PolicySpec = Field(default_factory=PolicySpec)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    env_tasks: list[EnvTaskConfig] = Field(min_length=1, description="The mix of env tasks")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    cluster: ClusterConfig
    affinity: AffinityConfig = Field(default_factory=AffinityConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        names = [t.name for t in self.env_tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"env_tasks names must be unique, got {names}")
        biggest = max(t.group_size for t in self.env_tasks)
        if self.rollout.max_in_flight < biggest:
            raise ValueError(f"rollout.max_in_flight ({self.rollout.max_in_flight}) must hold "
                             f"a whole group ({biggest})")
        pool_names = {p.name for p in self.cluster.pools}
        for pool in self.faults.stragglers:
            if pool not in pool_names:
                raise ValueError(f"faults.stragglers.{pool}: no such pool; pools: "
                                 f"{sorted(pool_names)}")
        for i, p in enumerate(self.cluster.pools):
            if p.profile not in CATALOG and p.profile not in self.affinity.profiles:
                raise ValueError(f"cluster.pools.{i}.profile: unknown hardware profile "
                                 f"{p.profile!r}; known: {sorted(CATALOG) + sorted(self.affinity.profiles)}")
        if (self.placement == "monolithic" and self.cluster.monolithic_profile not in CATALOG
                and self.cluster.monolithic_profile not in self.affinity.profiles):
            raise ValueError(f"cluster.monolithic_profile: unknown hardware profile "
                             f"{self.cluster.monolithic_profile!r}")
        temps = {t.name: (t.sampling or self.rollout.sampling).temperature for t in self.env_tasks}
        for name, temp in temps.items():
            if temp != self.trainer.hparams.temperature:
                raise ValueError(
                    f"sampling temperature of {name} ({temp}) must equal "
                    f"trainer.hparams.temperature ({self.trainer.hparams.temperature}): the "
                    "trainer recomputes log-probs of the same sampling distribution")
        roles = {p.role for p in self.cluster.pools}
        needs = [Role.SERVERLESS] + ([] if Role.ALL in roles else
                                     [Role.INFERENCE, Role.ENV, Role.TRAIN])
        for need in needs:
            if need not in roles:
                raise ValueError(f"cluster.pools has no pool with role {need.value!r}")
        if self.reward.backend == "lambda" and self.reward.emulator.enabled \
                and self.reward.endpoint_url:
            raise ValueError("reward.endpoint_url is set and reward.emulator.enabled is true: "
                             "choose one (emulator.enabled=false to use the endpoint)")
        if self.reward.backend == "lambda":
            for i, t in enumerate(self.env_tasks):
                if not isinstance(t.reward_fn, str):
                    raise ValueError(
                        f"env_tasks.{i}.reward_fn: a Python callable ({describe(t.reward_fn)}) "
                        "cannot run on AWS Lambda (reward.backend=lambda): deploy it and name "
                        "it by its dotted path, or set reward.backend=local")
        if self.reward.judge is not None:
            if not self.engine.emulated:
                raise ValueError("reward.judge emulates a reward model's GPU time: it needs "
                                 "engine.backend=emulated")
            if (self.reward.judge.profile not in CATALOG
                    and self.reward.judge.profile not in self.affinity.profiles):
                raise ValueError(f"reward.judge.profile: unknown hardware profile "
                                 f"{self.reward.judge.profile!r}")
        if self.rollout.env_barrier and self.mode != "sync":
            raise ValueError("rollout.env_barrier (batch-level environment handling) is a "
                             "baseline of mode=sync")
        floor = min_max_staleness(self.rollout.window_batches)
        if self.mode == "async" and self.rollout.max_staleness < floor:
            raise ValueError(
                f"rollout.max_staleness ({self.rollout.max_staleness}) is below what "
                f"rollout.window_batches ({self.rollout.window_batches}) implies plus one step "
                f"of weight-sync lag ({floor}): most rollouts would go stale by design")
        return self

    def batch_trajectories(self) -> int:
        """Trajectories in one train batch, on average over the mix."""
        return round(sum(t.group_size * t.weight for t in self.env_tasks)
                     / sum(t.weight for t in self.env_tasks) * self.trainer.groups_per_step)

    def trainer_hparams(self) -> TrainerHParams:
        """The trainer's hyper-parameters, the lr decay spanning the run unless set."""
        hp = self.trainer.hparams
        return hp.model_copy(update={"total_steps": hp.total_steps or self.trainer.max_steps})

    def effective_pools(self) -> list[PoolSpec]:
        """Monolithic: one pool of the same total size whose workers carry every tag."""
        if self.placement == "disaggregated":
            return list(self.cluster.pools)
        hardware = [p for p in self.cluster.pools if p.role is not Role.SERVERLESS]
        total = self.cluster.monolithic_workers or sum(p.workers for p in hardware)
        slots = max(p.slots for p in hardware)
        gpus = self.cluster.monolithic_gpus or max(p.gpus for p in hardware)
        return [PoolSpec(name="monolithic", profile=self.cluster.monolithic_profile, role=Role.ALL,
                         workers=total, slots=slots, gpus=gpus)] + [
            p for p in self.cluster.pools if p.role is Role.SERVERLESS]


    def trainer_gpus(self) -> int:
        """Devices the trainer spans: its pool's, or every device of the monolithic pool
        (colocated training time-shares them all with generation)."""
        pool = next(p for p in self.effective_pools() if p.role in (Role.TRAIN, Role.ALL))
        return pool.gpus * (pool.workers if pool.role is Role.ALL else 1)

    def device_model(self) -> ModelSpec:
        """The production model device times are computed for: the emulated one, else the
        affinity router's workload."""
        if self.engine.emulated:
            return model_spec(self.engine.device.model)
        return workload_model(self.affinity.workload)

    def pool_hardware(self) -> dict[str, tuple[dict, int]]:
        """Each effective pool's hardware profile and devices per worker."""
        return {p.name: (get_profile(p.profile, self.affinity.profiles).model_dump(), p.gpus)
                for p in self.effective_pools()}


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _check_path(model: type[BaseModel], parts: list[str], key: str) -> None:
    """Reject an override whose key the schema does not have."""
    cls: Any = model
    for i, part in enumerate(parts):
        if isinstance(cls, type) and issubclass(cls, BaseModel):
            if part not in cls.model_fields:
                new = RENAMED.get(part)
                hint = ""
                if new in cls.model_fields:
                    segs = key.split(".")
                    segs[len(segs) - 1 - segs[::-1].index(part)] = new
                    hint = f" (renamed {'.'.join(segs)!r})"
                raise ConfigError(f"{key}: unknown config key "
                                  f"{'.'.join(parts[: i + 1])!r}{hint}")
            ann = cls.model_fields[part].annotation
            origin = getattr(ann, "__origin__", None)
            if origin is list:
                (item,) = ann.__args__
                if i + 1 < len(parts):
                    if not parts[i + 1].isdigit():
                        raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} is a list; "
                                          "index it with a number")
                    return _check_path(item, parts[i + 2:], key) if i + 2 < len(parts) else None
                return
            cls = ann if isinstance(ann, type) else None
        else:
            return  # free-form dicts (component kwargs) take any key


def apply_override(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    _check_path(TrainConfig, parts, key)
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            idx = int(part)
            if idx >= len(node):
                raise ConfigError(f"{key}: index {idx} out of range")
            node = node[idx]
        else:
            if node.get(part) is None:  # a null section (tls: null) takes keys as an absent one
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} is not a section")
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    data = read_config_file(Path(path) if path else DEFAULT_CONFIG)
    _apply_overrides(data, overrides or [])
    return _validated(data)


def read_config_file(path: Path) -> dict:
    """A config YAML's data, or a ConfigError naming ``--config`` and why it cannot be read."""
    try:
        return yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {str(path)!r}") from None
    except IsADirectoryError:
        raise ConfigError(f"--config: {str(path)!r} is a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"--config: {str(path)!r} cannot be read: {reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config: {path} is not valid YAML: {exc}".splitlines()[0]) from None


def _apply_overrides(data: dict, overrides) -> None:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item!r}: overrides are written key=value")
        key, _, raw = item.partition("=")
        apply_override(data, key.strip(), _parse_value(raw))


def with_overrides(cfg: TrainConfig, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """``cfg`` (Python objects in it kept) with dotted overrides applied, validated."""
    data = cfg.model_dump()
    _apply_overrides(data, overrides)
    return _validated(data)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check a config built or edited in Python (with component objects) as a file is checked."""
    return _validated(cfg.model_dump())


def _validated(data: dict) -> TrainConfig:
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        loc = ".".join(str(p) for p in err["loc"])
        if not loc:  # a cross-field check: its message names the keys itself
            raise ConfigError(msg) from None
        got = (f" (got {err['input']!r})"
               if isinstance(err.get("input"), str | int | float | bool | None) else "")
        raise ConfigError(f"{loc}: {msg}{got}") from None
    _check_components(cfg)
    return cfg


def _check_components(cfg: TrainConfig) -> None:
    """Resolve every component and check its arguments fit, without constructing anything
    (environments are built on the workers, per trajectory); an environment class checks
    argument values itself with a ``check_config(**kwargs)`` static method."""
    loss_kwargs = set(cfg.trainer.loss) & {"clip_eps", "tis_cap"}
    if loss_kwargs:
        raise ConfigError(f"trainer.loss.{sorted(loss_kwargs)[0]}: set it in trainer.hparams "
                          "(the trainer passes it to the loss)")
    tensors = [None] * 5  # logp, prox_logp, behaviour_logp, advantages, mask
    checks = [(f"env_tasks.{i}.env", check_component, t.env) for i, t in enumerate(cfg.env_tasks)]
    checks += [
        ("engine.backend", lambda spec: check_signature(
            spec, policy=None, max_batch=1, **backend_context(
                resolve(spec[COMPONENT]), CATALOG["H800"], 1, cfg.engine.emulation() or {})),
         cfg.engine.backend),
        ("trainer.backend", lambda spec: check_signature(spec, policy=None, hparams=None, seed=0,
                                                         loss=None), cfg.trainer.backend),
        ("trainer.loss", lambda spec: check_signature(spec, *tensors, clip_eps=0.2, tis_cap=2.0),
         cfg.trainer.loss)]
    for key, check, spec in checks:
        try:
            check(spec)
        except Exception as exc:
            raise ConfigError(f"{key}: {type(exc).__name__}: {exc}") from None
    for i, t in enumerate(cfg.env_tasks):
        if isinstance(t.reward_fn, str):
            try:
                resolve_reward(t.reward_fn)
            except (ImportError, PermissionError) as exc:
                raise ConfigError(f"env_tasks.{i}.reward_fn: {exc}") from None


def reward_callables(cfg: TrainConfig) -> dict[str, Callable]:
    """The env tasks' Python reward functions by the name their score requests carry."""
    return {t.reward_name(): t.reward_fn for t in cfg.env_tasks
            if not isinstance(t.reward_fn, str)}


def resolved_yaml(cfg: TrainConfig) -> str:
    """The config as YAML; a component given as a Python object is named, as far as it can
    be (it cannot be loaded back from the file)."""
    data = cfg.model_dump(mode="json", fallback=lambda v: f"<python: {describe(v)}>")
    return yaml.safe_dump(data, sort_keys=False)
