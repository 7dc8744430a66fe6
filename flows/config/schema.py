"""The training flow's configuration, :class:`TrainConfig`: one typed model of every section.

YAML holds values, this holds shape: each field is checked here; the rules across sections
(:mod:`flows.config.rules`) run after it in :func:`flows.config.loading.validated`. Neither
imports torch or transformers.
"""

from __future__ import annotations

from pydantic import Field

from flows.config.choices import Mode, Placement
from flows.config.cluster import AffinityConfig, ClusterConfig
from flows.config.fields import Section
from flows.config.sections import (
    EngineConfig,
    EnvTaskConfig,
    EvalConfig,
    FaultsConfig,
    MetricsConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from tasks.specs import PolicySpec


class TrainConfig(Section):
    """The training flow's configuration (flows/train.py)."""

    seed: int = Field(default=0, description="Global seed")
    mode: Mode = Field(default=Mode.ASYNC, description="async | sync")
    placement: Placement = Field(default=Placement.DISAGGREGATED,
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
