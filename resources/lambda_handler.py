"""The reward-scoring AWS Lambda handler (aws-lambda-powertools v3) around the pure core.

:func:`tasks.reward_service.handle` validates and scores the event (its module documents the
event and response); this module adds what only a deployed function needs: structured JSON logs
carrying the invocation's context, CloudWatch metrics in the Embedded Metric Format (per-batch
counts, scores, latency, cold starts), and the cold-start set-up. It lives with the deployment
code so that nothing on the client side imports powertools.

Deployed by ``resources/lambda/template.yaml`` (Handler ``resources.lambda_handler.lambda_handler``)
and run locally by ``resources/lambda_emulator.py``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from tasks import reward_service

SERVICE = os.environ.get("POWERTOOLS_SERVICE_NAME", "rollarc-reward")

logger = Logger(service=SERVICE)
metrics = Metrics(namespace=os.environ.get("POWERTOOLS_METRICS_NAMESPACE", "RollArc"),
                  service=SERVICE)


def _init() -> None:
    """Cold-start set-up (Lambda's init phase): the core's log records go out as this Logger's
    JSON lines, with the invocation's keys, rather than as the runtime's plain text; and the
    reward model optionally loads now, not on the first invocation."""
    core = logging.getLogger(reward_service.__name__)
    core.handlers = [logger.registered_handler]
    core.setLevel(logger.log_level)
    core.propagate = False  # the runtime's root handler would write each record a second time
    if os.environ.get("ROLLARC_PRELOAD_REWARD_MODEL") == "1":
        from tasks.reward_models import embedding_model

        embedding_model()


_init()


@logger.inject_lambda_context(clear_state=True)
@metrics.log_metrics(capture_cold_start_metric=True)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    t0 = time.perf_counter()
    response = reward_service.handle(event)
    if "error" in response:
        logger.error("malformed event", extra={"error": response["error"]})
        metrics.add_metric(name="MalformedEvents", unit=MetricUnit.Count, value=1)
        return response
    results = response["results"]
    failed = sum(r["score"] is None for r in results)
    metrics.add_metric(name="ScoredItems", unit=MetricUnit.Count, value=len(results) - failed)
    metrics.add_metric(name="FailedItems", unit=MetricUnit.Count, value=failed)
    metrics.add_metric(name="BatchSize", unit=MetricUnit.Count, value=len(results))
    # EMF holds at most 100 values per metric: the batch's scores up to that
    for r in results[:100]:
        if r["score"] is not None:
            metrics.add_metric(name="Score", unit=MetricUnit.NoUnit, value=r["score"])
    latency_ms = (time.perf_counter() - t0) * 1000
    metrics.add_metric(name="HandlerLatency", unit=MetricUnit.Milliseconds, value=latency_ms)
    logger.info("scored batch", extra={"items": len(results), "failed": failed,
                                       "latency_ms": round(latency_ms, 2)})
    return response
