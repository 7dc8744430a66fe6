"""Shared fixtures: a tiny policy, and real Dask clusters whose workers advertise pool tags."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tasks.policy import PolicySpec, load_policy  # noqa: E402


@pytest.fixture(scope="session")
def policy():
    return load_policy(PolicySpec())


@pytest.fixture
def tiny_cfg_overrides(tmp_path):
    """Overrides that make a flow run short and quiet."""
    return ["trainer.max_steps=2", "trainer.groups_per_step=2", "metrics.progress=false",
            "cluster.dashboard_port=0"]
