"""The ``vllm`` inference backend over a :class:`resources.vllm_engine.VLLMEngine`.

:class:`VLLMBackend` maps one turn onto the worker's engine
(``tasks.inference.InferenceBackend``). Its cache handle is the conversation's token ids: a trajectory's next turn sends its whole history
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
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from resources.vllm_engine import VLLMEngine, import_vllm, policy_dir, resolve_dtype
from tasks.policy import load_tokenizer, stop_token_ids
from tasks.records import DecodeOutput, SamplingParams, TurnSample, TurnShape, WeightsSnapshot
from tasks.specs import PolicySpec

logger = logging.getLogger(__name__)

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
        self._counters_lock = threading.Lock()
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
        with self._counters_lock:
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
            with self._counters_lock:
                self._handoff.update(handoffs=1, loaded_tokens=loaded, failed_loads=failed,
                                     recomputed_tokens=gen.prompt_tokens - gen.cached_tokens)
            if loaded and prefilled.version is not None:
                oldest = min(oldest, prefilled.version)  # the KV read is the prefill's
        tokens = gen.tokens
        stopped = tokens[-1] in self.stop_ids
        context_full = len(prompt) + len(tokens) >= self.max_context
        with self._counters_lock:
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
        with self._counters_lock:
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
        with self._counters_lock:
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
            with self._counters_lock:
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
        import_vllm()
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
