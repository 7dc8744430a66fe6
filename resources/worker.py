"""Worker-resident state and the thin adapter that hands it to the plain functions of ``tasks/``.

One :class:`RollArcWorkerPlugin` per worker process holds, created lazily on first use, the
inference engine (model loaded once, versioned weights), the environment registry, the tokenizer
and, on the trainer's worker, the trainer. ``with_engine``/``with_envs``/``with_trainer`` are the
functions the flows submit: they look the state up on the executing worker and call the task.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from distributed import get_worker
from distributed.diagnostics.plugin import WorkerPlugin

from tasks.components import instantiate
from tasks.policy import PolicySpec, load_policy, load_tokenizer
from tasks.trainer import PolicyTrainer, TrainerHParams

logger = logging.getLogger(__name__)

PLUGIN_NAME = "rollarc"
TORCH_THREADS_ENV = "ROLLARC_TORCH_THREADS"


class EnvRegistry:
    """Environment instances of one worker, by id, with a live-instance count."""

    def __init__(self, address: str):
        self.address = address
        self._envs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.created = 0
        self.closed = 0

    def create(self, spec: dict, instance_id: str) -> Any:
        env = instantiate(spec)
        with self._lock:
            if instance_id in self._envs:
                raise KeyError(f"environment {instance_id} already exists on {self.address}")
            self._envs[instance_id] = env
            self.created += 1
        return env

    def get(self, instance_id: str) -> Any:
        try:
            return self._envs[instance_id]
        except KeyError:
            raise KeyError(f"environment {instance_id} is not live on {self.address}") from None

    def close(self, instance_id: str) -> bool:
        with self._lock:
            env = self._envs.pop(instance_id, None)
            if env is not None:
                self.closed += 1
        if env is None:
            return False
        env.close()
        return True

    @property
    def live(self) -> int:
        return len(self._envs)


class RollArcWorkerPlugin(WorkerPlugin):
    """Holds one worker's engine, environments, tokenizer and trainer."""

    name = PLUGIN_NAME

    def __init__(self, policy: dict, trainer: dict, seed: int = 0, reward: dict | None = None):
        self.policy_spec = policy
        self.trainer_hp = trainer
        self.seed = seed
        self.reward_cfg = reward or {"backend": "local"}

    def setup(self, worker) -> None:
        # worker-side state is created here: the plugin object itself is pickled to the workers
        self._lock = threading.RLock()
        self._engine = self._envs = self._tokenizer = self._trainer = None
        self._reward_clients: dict[str, Any] = {}
        self.address = worker.address
        # the pool's torch_threads reach the worker as an environment variable (Nanny env)
        torch.set_num_threads(int(os.environ.get(TORCH_THREADS_ENV, "1")))
        # the engine batches up to as many requests as the worker runs tasks at once
        self.engine_max_batch = max(1, int(worker.state.nthreads))

    def teardown(self, worker) -> None:
        if self._engine is not None:
            self._engine.close()
        for c in self._reward_clients.values():
            getattr(c, "close", lambda: None)()

    @property
    def spec(self) -> PolicySpec:
        return PolicySpec(**self.policy_spec)

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.spec)
            return self._tokenizer

    @property
    def engine(self):
        from resources.engine import InferenceEngine

        with self._lock:
            if self._engine is None:
                model, self._tokenizer = load_policy(self.spec)
                self._engine = InferenceEngine(model, max_batch=self.engine_max_batch)
                logger.info("engine loaded on %s", self.address)
            return self._engine

    @property
    def envs(self) -> EnvRegistry:
        with self._lock:
            if self._envs is None:
                self._envs = EnvRegistry(self.address)
            return self._envs

    @property
    def trainer(self) -> PolicyTrainer:
        with self._lock:
            if self._trainer is None:
                model, tok = load_policy(self.spec)
                self._trainer = PolicyTrainer(model, tok, TrainerHParams(**self.trainer_hp),
                                              seed=self.seed)
            return self._trainer

    def reward_client(self, function_name: str):
        """This worker's client of one reward function (one connection pool, one ledger)."""
        from resources.reward_client import build_reward_client

        with self._lock:
            if function_name not in self._reward_clients:
                self._reward_clients[function_name] = build_reward_client(self.reward_cfg,
                                                                          function_name)
            return self._reward_clients[function_name]

    def report(self) -> dict:
        """Counters for summaries and tests."""
        out: dict[str, Any] = {"address": self.address}
        if self._engine is not None:
            out["engine"] = dict(self._engine.stats.__dict__, version=self._engine.version)
        if self._envs is not None:
            out["envs"] = {"live": self._envs.live, "created": self._envs.created,
                           "closed": self._envs.closed}
        if self._trainer is not None:
            out["trainer"] = {"version": self._trainer.version}
        if self._reward_clients:
            out["reward_ledger"] = {n: {"keys": len(c.ledger), "duplicates": c.ledger.duplicates}
                                    for n, c in self._reward_clients.items()}
        return out


def _plugin() -> RollArcWorkerPlugin:
    return get_worker().plugins[PLUGIN_NAME]


def with_engine(fn, *args, **kwargs):
    """Call ``fn(engine, *args)`` with this worker's inference engine."""
    return fn(_plugin().engine, *args, **kwargs)


def with_engine_tokenizer(fn, *args, **kwargs):
    """Call ``fn(engine, first_arg, ..., tokenizer=...)``: decode needs both."""
    p = _plugin()
    return fn(p.engine, *args, tokenizer=p.tokenizer, **kwargs)


def with_envs(fn, *args, **kwargs):
    """Call ``fn(registry, tokenizer, *args)`` with this worker's environments."""
    p = _plugin()
    return fn(p.envs, p.tokenizer, *args, **kwargs)


def with_registry(fn, *args, **kwargs):
    return fn(_plugin().envs, *args, **kwargs)


def with_trainer(fn, *args, **kwargs):
    """Call ``fn(trainer, *args)`` with this worker's trainer."""
    return fn(_plugin().trainer, *args, **kwargs)


def plain(fn, *args, **kwargs):
    """Tasks that need no worker-resident state."""
    return fn(*args, **kwargs)


def with_reward_client(fn, function_name: str, *args, **kwargs):
    """Call ``fn(client, *args)`` with this worker's client of the reward function."""
    return fn(_plugin().reward_client(function_name), *args, **kwargs)


def worker_report(dask_worker=None) -> dict:
    """For ``client.run``: this worker's counters."""
    w = dask_worker or get_worker()
    p = w.plugins.get(PLUGIN_NAME)
    return p.report() if p is not None else {"address": w.address}
