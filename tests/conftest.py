"""Shared fixtures: a tiny policy, and real Dask clusters whose workers advertise pool tags."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from resources.engine import HFBackend, InferenceEngine  # noqa: E402
from tasks.policy import PolicySpec, load_policy, stop_token_ids  # noqa: E402
from tasks.records import EnvHandle, EnvObservation  # noqa: E402


@pytest.fixture(scope="session")
def policy():
    return load_policy(PolicySpec())


@pytest.fixture
def engine(policy):
    """An in-process engine over the tiny policy (its batching thread closed afterwards)."""
    eng = InferenceEngine(policy[0])
    yield eng
    eng.close()


@pytest.fixture
def make_backend(policy):
    """``hf`` backends over the tiny policy: ``make_backend(stop_ids=[], max_context=256)``."""
    made = []

    def make(stop_ids=None, max_context=256, engine=None):
        eng = engine or InferenceEngine(policy[0])
        made.append(eng)
        stops = stop_token_ids(policy[1]) if stop_ids is None else stop_ids
        return HFBackend(eng, policy[1], stops, max_context)

    yield make
    for eng in made:
        eng.close()


@pytest.fixture
def obs():
    """Build the observation record a prefill reads, from token ids."""
    return lambda ids: EnvObservation(handle=EnvHandle("w", "e"), text="", input_ids=ids)


@pytest.fixture
def tiny_cfg_overrides(tmp_path):
    """Overrides that make a flow run short and quiet."""
    return ["trainer.max_steps=2", "trainer.groups_per_step=2", "metrics.progress=false",
            "cluster.dashboard_port=0"]
