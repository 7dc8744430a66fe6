"""The ``score`` task: one call of a reward client for a burst of finished trajectories."""

from __future__ import annotations

from typing import Protocol

from tasks.records import ScoreBatch, ScoreRequest


class RewardClient(Protocol):
    """What a reward backend offers (``resources.reward_backends.build_reward_client``)."""

    def score(self, requests: list[ScoreRequest]) -> ScoreBatch: ...

    def check(self) -> None:
        """Fail fast when the reward service is not reachable (before a run, not mid-run)."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...


def score(client: RewardClient, requests: list[ScoreRequest]) -> ScoreBatch:
    """Score ``requests``: one result per request, in order, and the calls made (the client
    packs, fans out, retries and deduplicates)."""
    return client.score(requests)
