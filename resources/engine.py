"""The ``hf`` inference backend: transformers models behind :class:`tasks.inference.InferenceBackend`.

:class:`InferenceEngine` is one model per worker process, versioned weights, and a
micro-batcher that merges the forward requests of concurrent tasks into shared forward passes.
:class:`HFBackend` puts the turn logic of :mod:`tasks.generation` (``kv_prefill``,
``kv_decode``) on top of it, with a :class:`resources.kv_store.KVStore` that keeps each
conversation's KV on the worker between turns; its cache handle is a
:class:`tasks.records.KVCache` (the conversation's key and tokens).

Each Dask task thread calls :meth:`InferenceEngine.forward` and blocks; one engine thread drains
the request queue, pads the requests' past KV caches (left) and new tokens (right) into one batch,
runs a single forward pass and hands each request its slice back. A stage task that runs several
trajectories at once (a cohort, :mod:`tasks.cohort`) announces its members first
(:meth:`InferenceEngine.members`): the engine then holds its next pass until each of them has
queued its request or finished, at most ``hold_s``, so that the cohort shares one pass rather
than the first few members' requests going ahead alone. New weights are applied by that
same thread between two forward passes: the safe point. Every result carries the version of the
weights that produced it.

The model may live on a GPU and in a half dtype (``policy.device``, ``policy.dtype``); the engine
moves the incoming past KV there and hands back KV and logits as float32 CPU tensors, since what
a turn returns ends up in records that Dask ships between workers as numpy arrays.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from resources.catalog import HardwareProfile
from resources.kv_store import KVStore
from resources.weight_staging import WeightStaging
from tasks.components import accepts
from tasks.generation import kv_decode, kv_prefill, kv_prefill_many
from tasks.policy import kv_geometry, load_policy, stop_token_ids
from tasks.records import (
    DecodeOutput,
    KVCache,
    PrefillOutput,
    SamplingParams,
    TurnShape,
    WeightsSnapshot,
)
from tasks.specs import PolicySpec

logger = logging.getLogger(__name__)

KV_STORE_GIB = 2.0  # the most conversations' KV an hf worker keeps between turns, by default
# the longest the engine holds a pass for announced members still to queue a request
HOLD_S = 0.01
_member = threading.local()  # the announced member a task thread is running, if any


def cache_kwarg(model: PreTrainedModel) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (the old name warns until 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class ForwardResult:
    """kv_new: [layers, 2, kv_heads, n_new, head_dim]; last_logits: [vocab]; both float32 on
    the CPU, whatever the model's device and dtype."""

    kv_new: torch.Tensor
    last_logits: torch.Tensor
    version: int


@dataclass
class _Request:
    past: torch.Tensor  # [L, 2, H, T, D]
    input_ids: list[int]
    future: Future


@dataclass
class EngineStats:
    forward_passes: int = 0
    requests: int = 0
    tokens: int = 0
    max_batch_seen: int = 0
    weight_loads: int = 0


class _Members:
    """The members of one stage task, announced to an engine: each counts as arrived once it
    has queued a forward request or finished without one."""

    def __init__(self, engine: InferenceEngine, n: int):
        self.engine, self.left = engine, set(range(n))
        with engine._gate:
            engine._expected += n

    def run(self, fn: Callable[[int], Any], i: int) -> Any:
        _member.current = (self, i)
        try:
            return fn(i)
        finally:
            _member.current = None
            self.arrived(i)

    def arrived(self, i: int) -> None:
        with self.engine._gate:
            if i in self.left:
                self.left.discard(i)
                self.engine._expected -= 1
                if self.engine._expected <= 0:
                    self.engine._gate.notify_all()

    def release(self) -> None:
        """The task returned: members still running (deferred) hold no pass back."""
        with self.engine._gate:
            self.engine._expected -= len(self.left)
            self.left.clear()
            self.engine._gate.notify_all()


class InferenceEngine:
    """Batched, versioned forward passes over a causal LM."""

    def __init__(self, model: PreTrainedModel, max_batch: int = 64, batch_wait_s: float = 0.0,
                 hold_s: float = HOLD_S):
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.layers, self.kv_heads, self.head_dim = kv_geometry(model)
        self._cache_kwarg = cache_kwarg(model)
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.hold_s = hold_s
        self._gate = threading.Condition()
        self._expected = 0  # announced members that have neither queued a request nor finished
        self.version = -1  # nothing loaded yet: the flow loads the trainer's weights first
        self.stats = EngineStats()
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._weights = WeightStaging()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rollarc-engine", daemon=True)
        self._thread.start()

    # -- public API, called from task threads -------------------------------------------------
    def empty_kv(self) -> torch.Tensor:
        return torch.zeros(self.layers, 2, self.kv_heads, 0, self.head_dim)

    def forward(self, past: torch.Tensor | np.ndarray | None, input_ids: list[int]) -> ForwardResult:
        """Run ``input_ids`` after the cached ``past``; blocks until the batch containing it ran."""
        fut = self._queued(past, input_ids)
        if (member := getattr(_member, "current", None)) is not None:
            member[0].arrived(member[1])
        return fut.result()

    def forward_many(self, requests: list[tuple[torch.Tensor | np.ndarray | None, list[int]]]
                     ) -> list[ForwardResult]:
        """:meth:`forward` of several sequences from one thread: queued together, they share
        the next pass (or passes, beyond ``max_batch``); an error of the pass is raised."""
        with self._gate:  # the pass waits (at most hold_s) until all of them are queued
            self._expected += 1
        try:
            futures = [self._queued(past, input_ids) for past, input_ids in requests]
        finally:
            with self._gate:
                self._expected -= 1
                if self._expected <= 0:
                    self._gate.notify_all()
        return [f.result() for f in futures]

    def _queued(self, past: torch.Tensor | np.ndarray | None, input_ids: list[int]) -> Future:
        if not input_ids:
            raise ValueError("forward needs at least one new token")
        if past is None:
            past = self.empty_kv()
        elif isinstance(past, np.ndarray):
            past = torch.from_numpy(past)
        fut: Future = Future()
        self._queue.put(_Request(past, list(input_ids), fut))
        return fut

    @contextmanager
    def members(self, n: int) -> Iterator[Callable[[Callable[[int], Any], int], Any]]:
        """Announce ``n`` members about to call :meth:`forward`, each through the yielded
        ``run(fn, i)`` on its own thread: the next pass waits (at most ``hold_s``) until every
        one has queued its request or finished, and takes them together."""
        members = _Members(self, n)
        try:
            yield members.run
        finally:
            members.release()

    def load_weights(self, state: dict[str, np.ndarray], version: int, timeout: float = 600) -> int:
        """Stage new weights; the engine thread switches at the next safe point. Returns the
        version in use once switched. Versions only move forward: weights older than those
        staged or in use are skipped, and every waiter is released by the newer switch."""
        self._weights.stage(state, version, self.version, lambda: self._queue.put(None), timeout)
        return self.version

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)

    # -- engine thread ------------------------------------------------------------------------
    def _load(self, state: dict[str, np.ndarray], version: int) -> None:
        tensors = {k: self._on_device(torch.from_numpy(np.asarray(v))) for k, v in state.items()}
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        missing = [m for m in missing if not m.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights v{version}: missing {missing}, unexpected {unexpected}")
        self.version = version
        self.stats.weight_loads += 1

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the model's device, floating point in the model's dtype."""
        return t.to(self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)

    def _loop(self) -> None:
        while not self._closed:
            first = self._queue.get()
            self._weights.apply(self.version, self._load)
            if first is None:
                continue
            batch = [first]
            if self.batch_wait_s:
                time.sleep(self.batch_wait_s)
            if self.hold_s:
                with self._gate:
                    self._gate.wait_for(lambda: self._expected <= 0, timeout=self.hold_s)
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    batch.append(item)
            try:
                results = self._run(batch)
            except Exception as exc:  # hand the error to every waiting task
                for r in batch:
                    r.future.set_exception(exc)
            else:
                for r, res in zip(batch, results, strict=True):
                    r.future.set_result(res)
            # the safe point after a pass: a loader's wake-up taken while the batch was gathered
            # would otherwise leave its weights waiting for the next request
            self._weights.apply(self.version, self._load)

    @torch.no_grad()
    def _run(self, batch: list[_Request]) -> list[ForwardResult]:
        B = len(batch)
        past_lens = [r.past.shape[3] for r in batch]
        new_lens = [len(r.input_ids) for r in batch]
        T, N = max(past_lens), max(new_lens)
        input_ids = torch.zeros(B, N, dtype=torch.long)
        mask = torch.zeros(B, T + N, dtype=torch.long)
        positions = torch.zeros(B, N, dtype=torch.long)
        kv = torch.zeros(self.layers, 2, B, self.kv_heads, T, self.head_dim, device=self.device,
                         dtype=self.dtype)
        for b, r in enumerate(batch):
            t, n = past_lens[b], new_lens[b]
            input_ids[b, :n] = torch.tensor(r.input_ids)
            mask[b, T - t : T + n] = 1
            positions[b] = torch.arange(t, t + N)
            if t:
                kv[:, :, b, :, T - t :] = self._on_device(r.past)
        input_ids, mask, positions = (x.to(self.device) for x in (input_ids, mask, positions))
        cfg = self.model.config
        cache = (DynamicCache(ddp_cache_data=[(kv[i, 0], kv[i, 1]) for i in range(self.layers)],
                              config=cfg) if T else DynamicCache(config=cfg))
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **{self._cache_kwarg: cache})
        layers = cache.layers  # filled in place
        # back to the CPU in float32, one copy each: [L, B, H, N, D] and [B, vocab]
        keys = torch.stack([layer.keys[:, :, T:] for layer in layers]).float().cpu()
        values = torch.stack([layer.values[:, :, T:] for layer in layers]).float().cpu()
        last = torch.tensor([n - 1 for n in new_lens], device=out.logits.device)
        logits = out.logits[torch.arange(B, device=last.device), last].float().cpu()
        self.stats.forward_passes += 1
        self.stats.requests += B
        self.stats.tokens += sum(new_lens)
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, B)
        results = []
        for b in range(B):
            n = new_lens[b]
            kv_new = torch.stack([keys[:, b, :, :n], values[:, b, :, :n]], dim=1).contiguous()
            results.append(ForwardResult(kv_new, logits[b].clone(), self.version))
        return results


class HFBackend:
    """The ``hf`` backend: an :class:`InferenceEngine` plus the tokenizer, stop tokens and
    context limit a turn needs, and the worker's store of conversations' KV."""

    def __init__(self, engine: InferenceEngine, tokenizer, stop_ids: list[int], max_context: int,
                 store: KVStore | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.store = store if store is not None else KVStore(int(KV_STORE_GIB * 2**30))
        self.stop_ids, self.max_context = list(stop_ids), max_context

    @property
    def version(self) -> int:
        return self.engine.version

    def members(self, n: int):
        """A cohort's ``n`` members share the engine's passes (:meth:`InferenceEngine.members`)."""
        return self.engine.members(n)

    def decodes_inline(self, params: SamplingParams) -> bool:
        """A one-token response is sampled from prefill's logits and not run (``kv_decode``):
        with no forward pass to share, a cohort's members decode one after another in the
        task's thread; a thread each cost three times the CPU, their small torch calls handing
        the GIL round. (A member whose conversation this worker's store lacks still runs it.)"""
        return params.max_new_tokens <= 1

    def prefill(self, cache: KVCache | None, new_ids: list[int],
                shape: TurnShape | None = None) -> PrefillOutput:
        """``shape`` (virtual lengths) means nothing to a real engine."""
        return kv_prefill(self.engine, self.store, cache, new_ids)

    def prefill_many(self, caches: list[KVCache | None],
                     new_ids: list[list[int]]) -> list[PrefillOutput | Exception]:
        """:meth:`prefill` of a cohort's members from one thread, in one pass
        (:func:`tasks.generation.kv_prefill_many`)."""
        return kv_prefill_many(self.engine, self.store, caches, new_ids)

    def decode(self, prefilled: PrefillOutput, cache: KVCache | None, params: SamplingParams,
               seed: int, shape: TurnShape | None = None) -> DecodeOutput:
        return kv_decode(self.engine, self.store, prefilled, cache, self.tokenizer, params,
                         self.stop_ids, self.max_context, seed)

    def load_weights(self, snapshot: WeightsSnapshot) -> int:
        return self.engine.load_weights(snapshot.state, snapshot.version)

    def stats(self) -> dict:
        return dict(self.engine.stats.__dict__, version=self.engine.version,
                    kv_store=dict(self.store.stats.__dict__, conversations=len(self.store),
                                  bytes=self.store.nbytes))

    def close(self) -> None:
        self.engine.close()


def hf_backend(policy: PolicySpec, max_batch: int = 64, batch_wait_s: float = 0.0,
               kv_store_gib: float = KV_STORE_GIB, hold_s: float = HOLD_S) -> HFBackend:
    """Build the ``hf`` backend of ``policy`` (the ``engine.backend`` default).

    The worker keeps its conversations' KV between their turns (float32 on the CPU) up to
    ``kv_store_gib`` and no more than four batches of full contexts (``max_batch`` x
    ``policy.max_context`` tokens each), least recently used evicted first: ended trajectories
    go before live ones, and a live one evicted has its KV computed again at its next turn."""
    model, tokenizer = load_policy(policy)
    layers, kv_heads, head_dim = kv_geometry(model)
    token_bytes = layers * 2 * kv_heads * head_dim * 4
    capacity = min(int(kv_store_gib * 2**30), 4 * max_batch * policy.max_context * token_bytes)
    engine = InferenceEngine(model, max_batch=max_batch, batch_wait_s=batch_wait_s,
                             hold_s=hold_s)
    return HFBackend(engine, tokenizer, stop_token_ids(tokenizer), policy.max_context,
                     KVStore(capacity))


def _check_hf_backend(batch_wait_s: float = 0.0, kv_store_gib: float = KV_STORE_GIB,
                      hold_s: float = HOLD_S, **_: Any) -> None:
    """The values of :func:`hf_backend`'s arguments (the config loader calls this)."""
    for name, value in (("batch_wait_s", batch_wait_s), ("kv_store_gib", kv_store_gib),
                        ("hold_s", hold_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")


hf_backend.check_config = _check_hf_backend  # type: ignore[attr-defined]


def backend_context(factory, hardware: HardwareProfile, gpus: int, emulation: dict,
                    engine_id: str = "engine") -> dict[str, Any]:
    """What a backend factory is given beside ``policy`` and ``max_batch``: the worker's
    ``hardware`` and ``gpus``, the ``device`` and ``time_scale`` of ``engine`` config, and an
    ``engine_id``, each only if the factory takes it (the ``hf`` backend takes none)."""
    offered = {"hardware": hardware, "gpus": gpus, "engine_id": engine_id, **emulation}
    return {k: v for k, v in offered.items() if accepts(factory, k)}
