"""The closed choices of a training config, as enums (they compare equal to their YAML
strings)."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    ASYNC = "async"  # rollout goes on while the trainer trains, staleness bounded
    SYNC = "sync"  # a batch is rolled out, then trained, then the next (the baseline)


class Placement(StrEnum):
    DISAGGREGATED = "disaggregated"  # a pool per kind of work
    MONOLITHIC = "monolithic"  # every stage on the same workers, which carry every tag


class RewardBackend(StrEnum):
    LAMBDA = "lambda"  # boto3 lambda.invoke (AWS, or the local emulation)
    LOCAL = "local"  # the handler's core in-process on the reward worker


class TurnPlacement(StrEnum):
    SPLIT = "split"  # every turn's prefill on the compute pool, decode on the bandwidth pool
    LENGTH_AWARE = "length_aware"  # per turn, split or kept on one pool by the device model
    ENV_TASK = "env_task"  # each env task's trajectories on their best-fit pool
