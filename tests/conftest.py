"""Shared fixtures: the tiny policy, engines and backends over it, observation records, and a
Chromium for the dashboard page's screenshots. The overrides of a short run are in
:mod:`tests` (``QUIET``, ``SMALL``, ``NO_PICTURES``); Dask clusters are started by the modules
that use them, one per module where tests can share it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One intra-op thread in this process and the ones it starts (train.py, notebooks), as the
# workers run (cluster.pools[].torch_threads): the tiny policy's ops are too small to split, and
# on a shared machine OpenMP's spare threads spin waiting for work (libgomp's OMP_WAIT_POLICY,
# https://gcc.gnu.org/onlinedocs/libgomp/OMP_005fWAIT_005fPOLICY.html), slowing every test
# several-fold. Set before torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from resources.engine import HFBackend, InferenceEngine  # noqa: E402
from tasks.policy import load_policy, stop_token_ids  # noqa: E402
from tasks.records import EnvHandle, EnvObservation  # noqa: E402
from tasks.specs import PolicySpec  # noqa: E402
from tests import ROOT  # noqa: E402


@pytest.fixture(scope="session")
def policy():
    return load_policy(PolicySpec(device="cpu"))  # exact comparisons: float32 on the CPU


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


ARTIFACTS = Path(os.environ.get("ROLLARC_TEST_ARTIFACTS",
                                ROOT / "test-artifacts"))


@pytest.fixture(scope="session")
def chromium() -> str:
    """The system Chromium (Debian's ``chromium``), installed with apt-get where absent;
    skipped, with the reason, only if it cannot be installed."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium is absent and cannot be installed here (no apt-get, or not root)")
    proc = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True,
                          text=True, timeout=900, env={**os.environ,
                                                       "DEBIAN_FRONTEND": "noninteractive"})
    if proc.returncode != 0:  # a stale package index: refresh it once
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"],
                              capture_output=True, text=True, timeout=900,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    found = shutil.which("chromium")
    if not found:
        pytest.skip(f"chromium could not be installed: {proc.stderr.strip()[-300:]}")
    return found


@pytest.fixture
def restore_global_rngs():
    """Leave the process-wide RNGs (random, numpy, torch) as the test found them: tests that
    seed them (sampling, trainers) must not change what later tests draw."""
    import random

    import numpy as np
    import torch

    py, npy, th = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(th)
