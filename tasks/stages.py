"""The per-turn stage functions the rollout driver submits, as one typed set.

Each is a plain function whose first argument is the worker-resident thing it works on (the
inference backend, the environment registry, the reward client, the trainer), handed to it by
:mod:`resources.worker`. Replace one without editing the package::

    def slow_env_step(registry, tokenizer, prev, sample):
        time.sleep(0.01)
        return env_step(registry, tokenizer, prev, sample)

    run_training(cfg, run_dir, stages=Stages(env_step=slow_env_step))

Dask ships a replaced function to the workers with cloudpickle, so one defined in a notebook
cell works too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tasks.env_steps import env_close, env_reset, env_step
from tasks.generation import decode, load_weights, prefill, response_of
from tasks.records import (
    DecodeOutput,
    EnvHandle,
    EnvObservation,
    SamplingParams,
    ScoreBatch,
    ScoreRequest,
    TrainBatch,
    TrainStats,
    TurnSample,
    TurnShape,
    WeightsSnapshot,
)
from tasks.scoring import score
from tasks.trainer import load_checkpoint, publish_weights, save_checkpoint, train_step


class PrefillFn(Protocol):
    def __call__(self, backend: Any, past: DecodeOutput | None, observation: EnvObservation,
                 shape: TurnShape | None = None) -> Any: ...


class DecodeFn(Protocol):
    def __call__(self, backend: Any, prefilled: Any, past: DecodeOutput | None,
                 params: SamplingParams, seed: int,
                 shape: TurnShape | None = None) -> DecodeOutput: ...


class EnvResetFn(Protocol):
    def __call__(self, registry: Any, tokenizer: Any, env_spec: dict, seed: int,
                 instance_id: str, system_prompt: str | None = None) -> EnvObservation: ...


class EnvStepFn(Protocol):
    def __call__(self, registry: Any, tokenizer: Any, prev: EnvObservation,
                 sample: TurnSample) -> EnvObservation: ...


class EnvCloseFn(Protocol):
    def __call__(self, registry: Any, handle: EnvHandle) -> bool: ...


class ScoreFn(Protocol):
    def __call__(self, client: Any, requests: list[ScoreRequest]) -> ScoreBatch: ...


class TrainStepFn(Protocol):
    def __call__(self, trainer: Any, batch: TrainBatch) -> TrainStats: ...


class LoadWeightsFn(Protocol):
    def __call__(self, backend: Any, snapshot: WeightsSnapshot) -> int: ...


@dataclass(frozen=True)
class Stages:
    """The functions one trajectory's tasks run, and the trainer's; defaults from ``tasks/``."""

    prefill: PrefillFn = prefill
    decode: DecodeFn = decode
    response: Callable[[DecodeOutput], TurnSample] = response_of
    env_reset: EnvResetFn = env_reset
    env_step: EnvStepFn = env_step
    env_close: EnvCloseFn = env_close
    score: ScoreFn = score
    train_step: TrainStepFn = train_step
    publish_weights: Callable[[Any], WeightsSnapshot] = publish_weights
    load_weights: LoadWeightsFn = load_weights
    save_checkpoint: Callable[[Any, str], str] = save_checkpoint
    load_checkpoint: Callable[[Any, str], int] = load_checkpoint
