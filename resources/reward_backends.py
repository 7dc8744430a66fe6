"""Picks the reward backend a run configured: ``local`` (in-process) or ``lambda`` (boto3).

Apart from both client modules so that neither imports the other's backend: the ``lambda`` client
builds on the shared helpers of :mod:`resources.reward_client`, and only this module knows both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resources.lambda_client import LambdaRewardClient
from resources.reward_client import LocalRewardClient
from tasks.reward_service import RewardFn
from tasks.scoring import RewardClient

LAMBDA_KEYS = ("region", "endpoint_url", "concurrency", "batch_max", "min_batch",
               "max_payload_bytes", "read_timeout_s", "connect_timeout_s", "sdk_max_attempts",
               "throttle_retries", "function_error_retries")


def build_reward_client(reward: dict[str, Any], lambda_function: str,
                        functions: Mapping[str, RewardFn] | None = None) -> RewardClient:
    """The client of ``reward`` (``TrainConfig.reward`` as a dict, its ``endpoint_url``
    resolved) for one Lambda function. ``functions`` are reward callables by name; only the
    in-process backend can run them, since a Lambda function runs what was deployed."""
    backend = reward["backend"]
    if backend == "local":
        return LocalRewardClient(reward["batch_max"], reward["min_batch"],
                                 reward["max_payload_bytes"], functions=functions)
    if backend != "lambda":
        raise ValueError(f"reward.backend: unknown backend {backend!r} (local or lambda)")
    if functions:
        raise ValueError("a Python callable reward cannot run on AWS Lambda: deploy it and name "
                         "it by its dotted path, or use reward.backend=local")
    return LambdaRewardClient(lambda_function, **{k: reward[k] for k in LAMBDA_KEYS},
                              dummy_credentials=bool(reward.get("emulated")))
