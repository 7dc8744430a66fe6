"""Worker-resident state and the thin adapter that hands it to the plain functions of ``tasks/``.

One :class:`RollArcWorkerPlugin` per worker process holds, created lazily on first use, the
inference backend (model loaded once, versioned weights), the environment registry, the tokenizer,
the reward clients and, on the trainer's worker, the trainer. ``with_backend``/``with_envs``/
``with_trainer``/``with_reward_client`` are the functions the flows submit: they look the state up
on the executing worker and call the stage function.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch
from distributed import get_worker
from distributed.diagnostics.plugin import WorkerPlugin

from resources.catalog import HardwareProfile
from resources.device_model import DeviceModel, model_spec
from resources.engine import backend_context
from tasks.components import COMPONENT, bind, instantiate, resolve
from tasks.env_steps import EnvRegistry
from tasks.inference import InferenceBackend
from tasks.policy import load_tokenizer
from tasks.specs import PolicySpec, TrainerHParams
from tasks.trainer import Trainer

logger = logging.getLogger(__name__)

PLUGIN_NAME = "rollarc"
TORCH_THREADS_ENV = "ROLLARC_TORCH_THREADS"


class RollArcWorkerPlugin(WorkerPlugin):
    """Holds one worker's inference backend, environments, tokenizer, trainer and reward clients.

    ``backend`` and ``trainer`` are component specs (``{_component_: path or object, ...}``),
    called as ``backend(policy=PolicySpec, max_batch=int, **backend_context(...))`` and
    ``trainer(policy=PolicySpec, hparams=TrainerHParams, seed=int, loss=LossFn)``;
    ``reward_functions`` are Python reward callables by name, for the ``local`` reward backend.
    ``pool_hardware`` maps pool names to ``(profile, gpus)``: a worker named ``<pool>-<i>`` is
    one engine of its pool's (others: of ``default_pool``'s). With ``emulation``
    (``{"device": ..., "time_scale": ...}``) the trainer's steps and weight exports take
    device-model time too, and environments that take a ``time_scale`` get it. Dask pickles the
    plugin (cloudpickle), so objects defined in a notebook reach the workers with it.
    """

    name = PLUGIN_NAME

    def __init__(self, policy: dict, backend: dict | None = None, trainer: dict | None = None,
                 hparams: dict | None = None, loss: dict | None = None, seed: int = 0,
                 reward: dict | None = None, reward_functions: dict[str, Any] | None = None,
                 pool_hardware: dict[str, tuple[dict, int]] | None = None,
                 default_pool: str | None = None, trainer_gpus: int | None = None,
                 emulation: dict | None = None, stragglers: dict[str, float] | None = None):
        self.policy_spec = policy
        self.backend_spec = backend or {COMPONENT: "resources.engine.hf_backend"}
        self.trainer_spec = trainer or {COMPONENT: "tasks.trainer.policy_trainer"}
        self.hparams = hparams or {}
        self.loss_spec = loss
        self.seed = seed
        self.reward_cfg = reward or {"backend": "local"}
        self.reward_functions = dict(reward_functions or {})
        self.pool_hardware = dict(pool_hardware or {})
        self.default_pool = default_pool
        self.trainer_gpus = trainer_gpus
        self.emulation = emulation
        self.stragglers = dict(stragglers or {})  # pool -> slowdown factor (injected faults)

    def setup(self, worker) -> None:
        # worker-side state is created here: the plugin object itself is pickled to the workers
        quiet_message_sizing()
        self._lock = threading.RLock()
        self._backend = self._envs = self._tokenizer = self._trainer = None
        self._reward_clients: dict[str, Any] = {}
        self.address = worker.address
        # the pool's torch_threads reach the worker as an environment variable (Nanny env)
        torch.set_num_threads(int(os.environ.get(TORCH_THREADS_ENV, "1")))
        # the engine batches up to as many requests as the worker runs tasks at once
        self.engine_max_batch = max(1, int(worker.state.nthreads))
        self.worker_name = str(worker.name)
        pool = self.worker_name.rsplit("-", 1)[0]
        self.slowdown = float(self.stragglers.get(pool, 1.0))
        profile, self.gpus = self.pool_hardware.get(
            pool, self.pool_hardware.get(self.default_pool, (None, 1)))
        self.hardware = HardwareProfile(**profile) if profile else None

    @property
    def time_scale(self) -> float:
        return self.emulation["time_scale"] if self.emulation else 1.0

    def teardown(self, worker) -> None:
        if self._backend is not None:
            self._backend.close()
        for c in self._reward_clients.values():
            c.close()

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
    def backend(self) -> InferenceBackend:
        with self._lock:
            if self._backend is None:
                context = backend_context(resolve(self.backend_spec[COMPONENT]), self.hardware,
                                          self.gpus, self.emulation or {}, self.worker_name)
                self._backend = instantiate(self.backend_spec, policy=self.spec,
                                            max_batch=self.engine_max_batch, **context)
                logger.info("inference backend loaded on %s", self.address)
            return self._backend

    @property
    def envs(self) -> EnvRegistry:
        with self._lock:
            if self._envs is None:
                self._envs = EnvRegistry(self.address, self.time_scale)
            return self._envs

    @property
    def trainer(self) -> Trainer:
        with self._lock:
            if self._trainer is None:
                loss = bind(self.loss_spec) if self.loss_spec else None
                self._trainer = instantiate(self.trainer_spec, policy=self.spec,
                                            hparams=TrainerHParams(**self.hparams),
                                            seed=self.seed, loss=loss)
                if self.emulation:
                    from resources.emulated import DeviceEmulation, device_of
                    from resources.emulated_trainer import EmulatedTrainer

                    device = device_of(self.hardware, self.trainer_gpus or self.gpus,
                                       DeviceEmulation(**self.emulation["device"]))
                    hp = TrainerHParams(**self.hparams)
                    self._trainer = EmulatedTrainer(self._trainer, device,
                                                    self.emulation["time_scale"],
                                                    hp.ppo_epochs, hp.minibatches)
            return self._trainer

    def reward_client(self, lambda_function: str):
        """This worker's client of one reward function (one connection pool, one ledger)."""
        from resources.reward_backends import build_reward_client

        with self._lock:
            if lambda_function not in self._reward_clients:
                client = build_reward_client(self.reward_cfg, lambda_function,
                                             self.reward_functions)
                judge = self.reward_cfg.get("judge")
                if judge:  # a model-based reward's GPU time, emulated
                    from resources.emulated_judge import JudgedRewardClient, JudgeEmulation

                    j = JudgeEmulation(**judge)
                    device = DeviceModel(model_spec(j.model),
                                         HardwareProfile(**self.reward_cfg["judge_hardware"]),
                                         j.gpus)
                    client = JudgedRewardClient(client, device, self.time_scale,
                                                dedicated=self.reward_cfg["backend"] == "local")
                self._reward_clients[lambda_function] = client
            return self._reward_clients[lambda_function]

    def report(self) -> dict:
        """Counters for summaries and tests."""
        out: dict[str, Any] = {"address": self.address}
        if self._backend is not None:
            out["engine"] = self._backend.stats()
        if self._envs is not None:
            out["envs"] = {"live": self._envs.live, "created": self._envs.created,
                           "closed": self._envs.closed,
                           "replays_refused": self._envs.replays_refused}
        if self._trainer is not None:
            out["trainer"] = {"version": self._trainer.version,
                              "emulated_busy_s": getattr(self._trainer, "busy_s", None)}
        if self._reward_clients:
            out["reward_ledger"] = {n: {"keys": len(c.ledger), "duplicates": c.ledger.duplicates}
                                    for n, c in self._reward_clients.items()}
            judges = {n: c.stats() for n, c in self._reward_clients.items()
                      if hasattr(c, "stats")}
            if judges:
                out["reward_judge"] = judges
        return out


def _plugin() -> RollArcWorkerPlugin:
    return get_worker().plugins[PLUGIN_NAME]


def _straggling(p: RollArcWorkerPlugin, call):
    """A straggler (faults.stragglers): the call takes ``slowdown`` times as long."""
    if p.slowdown <= 1.0:
        return call()
    t0 = time.perf_counter()
    out = call()
    time.sleep((p.slowdown - 1.0) * (time.perf_counter() - t0))
    return out


def with_backend(fn, *args, **kwargs):
    """Call ``fn(backend, *args)`` with this worker's inference backend."""
    p = _plugin()
    return _straggling(p, lambda: fn(p.backend, *args, **kwargs))


def with_envs(fn, *args, **kwargs):
    """Call ``fn(registry, tokenizer, *args)`` with this worker's environments."""
    p = _plugin()
    return _straggling(p, lambda: fn(p.envs, p.tokenizer, *args, **kwargs))


def with_registry(fn, *args, **kwargs):
    return fn(_plugin().envs, *args, **kwargs)


def with_trainer(fn, *args, **kwargs):
    """Call ``fn(trainer, *args)`` with this worker's trainer."""
    return fn(_plugin().trainer, *args, **kwargs)


def plain(fn, *args, **kwargs):
    """Tasks that need no worker-resident state."""
    return fn(*args, **kwargs)


def with_reward_client(fn, lambda_function: str, *args, **kwargs):
    """Call ``fn(client, *args)`` with this worker's client of the reward function."""
    return fn(_plugin().reward_client(lambda_function), *args, **kwargs)


class _MessageSizingFilter(logging.Filter):
    """Drops one warning that reports nothing wrong. Before sending a message, Dask's comm layer
    sizes it with ``safe_sizeof(msg, default_size=-1)`` to choose whether to serialise it on a
    thread (``distributed/comm/utils.py``); a worker's profile tree, which the performance
    report asks for, nests deeper than ``sizeof`` recurses, so it logs "Sizeof calculation for
    object of type 'dict' failed. Defaulting to -1 B" and offloads the message, as it would a
    large one. Every other sizeof failure (of a task's result) is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Sizeof calculation for object of type 'dict' failed" in message
                    and "Defaulting to -1 B" in message)


def quiet_message_sizing() -> None:
    """Install :class:`_MessageSizingFilter` in this process (once)."""
    log = logging.getLogger("distributed.sizeof")
    if not any(isinstance(f, _MessageSizingFilter) for f in log.filters):
        log.addFilter(_MessageSizingFilter())


def quiet_close(dask_worker=None) -> None:
    """For ``client.run`` once a run is over, before its cluster closes: this worker's Dask
    loggers no longer report the scheduler going away (a heartbeat in flight while it closes
    is no error of the run)."""
    for name in ("distributed", "tornado"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def worker_report(dask_worker=None) -> dict:
    """For ``client.run``: this worker's counters."""
    w = dask_worker or get_worker()
    p = w.plugins.get(PLUGIN_NAME)
    return p.report() if p is not None else {"address": w.address}
