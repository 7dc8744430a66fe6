"""prefill and decode: the two halves of one turn of generation.

The stage functions (:func:`prefill`, :func:`decode`, :func:`response_of`) are what the flows
submit; they call any :class:`tasks.inference.InferenceBackend` and pass its cache handle along
without looking inside.

:func:`kv_prefill` and :func:`kv_decode` are how the ``hf`` backend computes a turn over a
batched forward engine (:class:`resources.engine.InferenceEngine`): prefill (compute-bound) reads
the turn's new tokens after the cache so far and returns only their KV plus the last position's
logits; decode (bandwidth-bound) samples from those logits and continues token by token, running
only the tokens it sampled itself, except the last, which the next turn's prefill reads first.
Each keeps the conversation's KV in its worker's store (:class:`resources.kv_store.KVStore`, the
``store`` argument) for the next turn, so between turns only the new tokens' KV moves, prefill to
decode; the one KV computed twice is what a worker's store lacks: the tokens decode ran itself,
when their next prefill runs on another worker, and whatever was evicted.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch

from tasks.records import (
    DecodeOutput,
    EnvObservation,
    KVCache,
    PrefillOutput,
    SamplingParams,
    TurnSample,
    TurnShape,
    WeightsSnapshot,
)

# -- stage functions (one Dask task each) -----------------------------------------------------


def prefill(backend, past: DecodeOutput | None, observation: EnvObservation,
            shape: TurnShape | None = None):
    """Read the observation's tokens after the trajectory's cache so far (``shape``, the
    turn's virtual lengths, goes only to backends that emulate devices: it is None otherwise)."""
    extra = {"shape": shape} if shape is not None else {}
    return backend.prefill(past.cache if past is not None else None, list(observation.input_ids),
                           **extra)


def prefill_together(backend, pasts: list[DecodeOutput | None],
                     observations: list[EnvObservation]) -> list | None:
    """:func:`prefill` of several members from the calling thread, on a backend that runs
    them together (``prefill_many``, the ``hf`` backend's); None where it cannot (each member
    then runs on a thread of its own). A member's own failure is returned in its place."""
    many = getattr(backend, "prefill_many", None)
    if many is None:
        return None
    return many([p.cache if p is not None else None for p in pasts],
                [list(o.input_ids) for o in observations])


# the batched form :func:`tasks.cohort.prefill_many` runs for this stage function (a stage
# function of one's own, without it, runs member by member)
prefill.together = prefill_together


def decode(backend, prefilled, past: DecodeOutput | None, params: SamplingParams,
           seed: int, shape: TurnShape | None = None) -> DecodeOutput:
    """Sample the turn's response from what prefill left."""
    extra = {"shape": shape} if shape is not None else {}
    return backend.decode(prefilled, past.cache if past is not None else None, params, seed,
                          **extra)


def response_of(decoded: DecodeOutput) -> TurnSample:
    """The small part of a decode output, extracted where it lives so the cache stays put."""
    return decoded.sample


# -- the hf backend's turn over a forward engine ------------------------------------------------


def kv_prefill(engine, store, cache: KVCache | None, new_ids: list[int]) -> PrefillOutput:
    """KV for ``cache.pending_ids + new_ids`` (new tokens only) and the last logits; what of the
    conversation's KV before them ``store`` lacks is run in the same pass."""
    turn = _PrefillTurn(store, cache, new_ids)
    return turn.output(store, engine.forward(turn.held, turn.to_run))


def kv_prefill_many(engine, store, caches: list[KVCache | None],
                    new_ids: list[list[int]]) -> list[PrefillOutput | Exception]:
    """:func:`kv_prefill` of several conversations from the calling thread, their forwards
    queued together (:meth:`resources.engine.InferenceEngine.forward_many`): one pass for a
    cohort, without a thread per member handing the GIL round. A conversation's own failure
    is returned in its place; a failure of the pass is raised."""
    turns: list[_PrefillTurn | Exception] = []
    for cache, ids in zip(caches, new_ids, strict=True):
        try:
            turns.append(_PrefillTurn(store, cache, ids))
        except Exception as exc:
            turns.append(exc)
    results = iter(engine.forward_many([(t.held, t.to_run) for t in turns
                                        if isinstance(t, _PrefillTurn)]))
    return [t if isinstance(t, Exception) else t.output(store, next(results)) for t in turns]


class _PrefillTurn:
    """One conversation's prefill: what ``store`` holds of it, and the tokens to run."""

    def __init__(self, store, cache: KVCache | None, new_ids: list[int]):
        self.key = cache.key if cache is not None else uuid.uuid4().hex
        history = list(cache.token_ids) if cache is not None else []
        self.n_past = cache.n_tokens if cache is not None else 0
        self.ids = history + list(new_ids)
        self.held = store.lookup(self.key, history, self.n_past)
        self.m = self.held.shape[3] if self.held is not None else 0
        if self.n_past > self.m:
            store.recomputed(self.n_past - self.m)
        self.to_run = self.ids[self.m:]
        if not self.to_run:
            raise ValueError("prefill needs at least one new token")

    def output(self, store, res) -> PrefillOutput:
        kv_run = res.kv_new.numpy()
        kv = np.concatenate([self.held, kv_run], axis=3) if self.m else kv_run
        store.put(self.key, self.ids, kv)
        return PrefillOutput(
            kv_new=np.ascontiguousarray(kv[:, :, :, self.n_past:]),
            last_logits=res.last_logits.numpy(), n_past=self.n_past,
            n_new=len(self.ids) - self.n_past, policy_version=res.version, key=self.key,
            input_ids=self.ids[self.n_past:],
        )


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator) -> tuple[int, float]:
    """Sample one token; returns it and its log-prob at the sampling temperature (what the
    trainer recomputes), greedy or not."""
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    if params.greedy:
        tok = int(torch.argmax(logp))
        return tok, float(logp[tok])
    tok = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return tok, float(logp[tok])


def kv_decode(engine, store, prefill_out: PrefillOutput, cache: KVCache | None, tokenizer,
              params: SamplingParams, stop_ids: list[int], max_context: int,
              seed: int) -> DecodeOutput:
    """Sample the turn's response starting from prefill's logits.

    The cache grows on this worker: what ``store`` holds of the conversation (all of it when
    turn placement keeps a trajectory's decodes on one worker; what it lacks is run first) +
    ``prefill_out.kv_new`` + the sampled tokens'. The last sampled token is not run: no token is
    sampled from its logits in this turn, so its KV is left to the next turn's prefill, which
    reads it first (``KVCache.pending_ids``), as a serving engine leaves a finished request's
    last token unprocessed. A one-token response then costs decode no forward pass at all.
    """
    n_past = prefill_out.n_past
    history = list(cache.token_ids[:n_past]) if cache is not None else []
    held = store.lookup(prefill_out.key, history, n_past)
    m = held.shape[3] if held is not None else 0
    parts = [held] if m else []
    version = oldest = prefill_out.policy_version
    recomputed = n_past - m
    if recomputed:  # this worker lacks part of the conversation's KV: run it first
        store.recomputed(recomputed)
        res = engine.forward(held, history[m:])
        parts.append(res.kv_new.numpy())
        oldest = min(oldest, res.version)
    kv = torch.from_numpy(np.concatenate(parts + [prefill_out.kv_new], axis=3))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.from_numpy(prefill_out.last_logits)
    tokens, logprobs, versions = [], [], []
    processed = 0
    stopped = context_full = False
    while True:
        tok, lp = sample_token(logits, params, gen)
        tokens.append(tok)
        logprobs.append(lp)
        versions.append(version)
        stopped = tok in stop_ids
        # the context holds the cache, this token and the next turn's input
        context_full = kv.shape[3] + 1 >= max_context
        if stopped or context_full or len(tokens) >= params.max_new_tokens:
            break
        res = engine.forward(kv, [tok])
        processed += 1
        oldest = min(oldest, res.version)
        kv = torch.cat([kv, res.kv_new], dim=3)
        logits, version = res.last_logits, res.version
    text_ids = tokens[:-1] if stopped else tokens
    sample = TurnSample(
        token_ids=tokens, logprobs=logprobs, versions=versions,
        text=tokenizer.decode(text_ids, skip_special_tokens=True), stopped=stopped,
        context_full=context_full, decode_tokens_processed=processed, oldest_version=oldest,
    )
    conversation = history + list(prefill_out.input_ids) + tokens
    n_tokens = int(kv.shape[3])
    store.put(prefill_out.key, conversation[:n_tokens], kv.numpy())
    return DecodeOutput(cache=KVCache(prefill_out.key, conversation, n_tokens), sample=sample)


def load_weights(backend, snapshot: WeightsSnapshot) -> int:
    """Switch an inference backend to published weights (at its next safe point)."""
    return backend.load_weights(snapshot)
