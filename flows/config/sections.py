"""The sections of a training config: what to roll out and how, the reward service, the
trainer, the inference engine, evaluation, metrics and injected faults. Shape only: what a
config implies is computed in :mod:`flows.config.derived`, checks across sections are
:mod:`flows.config.rules`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from flows.config.choices import RewardBackend, TurnPlacement
from flows.config.fields import ComponentSpec, RewardFn, Section, component_spec
from flows.training.workload import TurnShapeConfig
from resources.emulated import DeviceEmulation
from resources.emulated_judge import JudgeEmulation
from tasks.components import COMPONENT
from tasks.envs.base import EVAL_SEED_OFFSET
from tasks.specs import TrainerHParams


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature")
    max_new_tokens: int = Field(default=16, ge=1, description="Response tokens per turn at most")
    greedy: bool = Field(default=False, description="Take the most likely token (tests, "
                         "oracle runs); evaluation is always greedy")


class EnvTaskConfig(Section):
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
                                  "devices (flows.training.workload); null: the real lengths")

class RolloutConfig(Section):
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
    cohort_barrier: bool = Field(
        default=False, description="A cohort's stage waits for every member (a barrier per "
        "cohort per turn: the baseline the benchmark measures it with); false: members leave "
        "as they finish, the rest go on in the background and are collected")
    cohort_grace_s: float = Field(
        default=0.05, ge=0, description="Wall seconds a cohort's stage waits, after a member "
        "finished, for mates finishing in the engine's next forward pass; a finished member "
        "waits at most 2 x this or a quarter of its own stage time (tasks.cohort)")
    cohort_per_env_task: bool = Field(
        default=False, description="A cohort holds one env task, so every task's Dask span "
        "names its env task (exact time per env task in Fine Performance Metrics) at the cost "
        "of more, smaller tasks; false: a cohort mixing env tasks carries the span 'mixed'")
    lookahead: bool = Field(
        default=True, description="Each trajectory's next turn is submitted with its turn in "
        "flight and reads that turn's results through Dask, so it starts as soon as they exist "
        "instead of after the driver's round trip (a turn that ended the episode leaves the "
        "next one nothing to do). Turns of env tasks with emulated lengths (shape) are placed "
        "one at a time, and the env_barrier baseline waits by design: neither looks ahead")
    turn_placement: TurnPlacement = Field(
        default=TurnPlacement.SPLIT, description="split: every turn's prefill on the compute pool and "
        "decode on the bandwidth pool | length_aware: per turn, split or keep it on one pool, "
        "whichever the device model says finishes first for its expected response length | "
        "env_task: each env task's trajectories on the home (whole turns on the compute pool, "
        "on the bandwidth pool, or split) that finishes them soonest per dollar by the device "
        "model and the lengths they have shown, at the pools' load")
    env_barrier: bool = Field(
        default=False, description="Sync: batch-level environment handling, a baseline: each "
                                   "turn of the batch waits until every trajectory has finished "
                                   "the turn before (false: each trajectory goes on alone)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)


class EmulatorConfig(Section):
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


class RewardConfig(Section):
    backend: RewardBackend = Field(
        default=RewardBackend.LAMBDA, description="lambda: boto3 lambda.invoke (AWS, or the emulation); "
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


class TrainerConfig(Section):
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
            "vllm": "resources.vllm_backend.vllm_backend",
            "emulated": "resources.emulated.emulated_backend"}


def _backend_spec(v: Any) -> Any:
    if isinstance(v, str):
        if v not in BACKENDS:
            raise ValueError(f"unknown backend {v!r}: one of {sorted(BACKENDS)} or "
                             "{_component_: ...}")
        return {COMPONENT: BACKENDS[v]}
    return component_spec(v)


class EngineConfig(Section):
    backend: Annotated[dict[str, Any], BeforeValidator(_backend_spec)] = Field(
        default_factory=lambda: {COMPONENT: BACKENDS["hf"]},
        description="Inference backend (tasks.inference.InferenceBackend) on every inference "
                    "worker: hf | vllm | emulated | {_component_: ...}, called with policy and "
                    "max_batch (and the worker's hardware, gpus, device, time_scale and "
                    "engine_id when it takes them)")
    time_scale: float = Field(default=1.0, gt=0, description="Multiplies every emulated wait "
                              "(device time, environment and reward latency): shrinks a "
                              "benchmark's wall time, every ratio kept")
    device: DeviceEmulation = Field(default_factory=DeviceEmulation,
                                    description="The production model and efficiencies the "
                                                "emulated backend and trainer emulate")


class EvalConfig(Section):
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


class WandbConfig(Section):
    project: str = Field(default="rollarc", description="W&B project")
    entity: str | None = Field(default=None, description="W&B entity (team or user)")
    mode: Literal["offline", "online"] = Field(
        default="offline", description="offline: files under <run_dir>/wandb, to `wandb sync` "
                                       "later; online: needs WANDB_API_KEY and a network")


class MetricsConfig(Section):
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


class EnvFaults(Section):
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


class RewardFaults(Section):
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


class FaultsConfig(Section):
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
