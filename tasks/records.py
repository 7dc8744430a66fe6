"""Typed records passed between tasks.

The ``hf`` backend's KV travels (a turn's new tokens', prefill to decode) as one float32 numpy
array shaped ``[layers, 2 (k|v), kv_heads, tokens, head_dim]``: numpy arrays cross Dask as
zero-copy frames, while Dask's torch serialiser goes through ``Tensor.numpy()`` and so fails on
CUDA and bf16 tensors (dask/distributed issues #6111, #8001). A frame costs the receiving worker
a read of its own (``distributed.comm.tcp.TCP.read`` reads each out-of-band buffer separately), so
arrays up to :data:`INBAND_BYTES` travel inside the pickle instead: a cohort's prefill outputs of
the tiny policy are some hundred small arrays.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# arrays up to this size cross Dask inside the pickle (copied once), larger ones as frames of
# their own (zero-copy, a read each)
INBAND_BYTES = 64 * 1024


def _inband(a: np.ndarray) -> Any:
    """What pickles ``a``: itself (a frame of its own) when large, else its bytes."""
    if a.nbytes > INBAND_BYTES:
        return a
    return a.dtype.str, a.shape, bytearray(np.ascontiguousarray(a).data)


def _array(state: Any) -> np.ndarray:
    if isinstance(state, np.ndarray):
        return state
    dtype, shape, raw = state
    return np.frombuffer(raw, dtype=dtype).reshape(shape)  # writable: over a bytearray


@dataclass
class PrefillOutput:
    """KV of this turn's new tokens only, and the logits at the last position.

    kv_new: [layers, 2, kv_heads, n_new, head_dim]; last_logits: [vocab]; ``key`` and
    ``input_ids``: the conversation's key in the workers' KV stores and the ``n_new`` tokens
    read, after ``n_past`` whose KV exists already.
    """

    kv_new: np.ndarray
    last_logits: np.ndarray
    n_past: int
    n_new: int
    policy_version: int
    key: str = ""
    input_ids: list[int] = field(default_factory=list)

    def __sizeof__(self) -> int:  # what Dask's sizeof reports, for transfers and memory
        return int(self.kv_new.nbytes + self.last_logits.nbytes) + 128

    def __getstate__(self) -> dict:
        return self.__dict__ | {"kv_new": _inband(self.kv_new),
                                "last_logits": _inband(self.last_logits)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, kv_new=_array(state["kv_new"]),
                             last_logits=_array(state["last_logits"]))


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_new_tokens: int = 4
    greedy: bool = False


@dataclass
class TurnSample:
    """What the policy said in one turn. Small: this is what crosses to the environment.

    logprobs[i] and versions[i] are those of the forward pass that actually sampled token i.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    stopped: bool  # ended on a stop token
    context_full: bool  # hit the context limit
    decode_tokens_processed: int  # tokens decode ran through the model (not prefill's)
    # the oldest weights of any forward pass of this turn, KV-only passes included: later turns
    # read that KV, so a trajectory's staleness counts it (-1: no pass recorded)
    oldest_version: int = -1
    # tokens the turn stood for on an emulated production engine (prompt read + response
    # generated; 0 on a real engine): what the emulated trainer's step time counts
    virtual_tokens: int = 0
    virtual_response_tokens: int = 0  # of virtual_tokens, the response's (the loss reads them)
    emulated_wait_s: float = 0.0  # real seconds the turn's tasks waited on emulated devices
    # of emulated_wait_s: the prefill engine's share and the KV hand-offs' (the rest is the
    # decode engine's)
    prefill_wait_s: float = 0.0
    kv_transfer_s: float = 0.0


@dataclass(frozen=True)
class TurnShape:
    """The lengths a turn has on an emulated production engine, drawn per turn by the flows
    from the env task's workload shape: the tiny policy's real tokens stand for them."""

    prompt_tokens: int  # new tokens prefill reads (the observation / tool output of this turn)
    response_tokens: int  # tokens decode generates


@dataclass
class KVCache:
    """The ``hf`` backend's cache handle: the conversation's key and its tokens so far; the KV of
    all but the last ``len(pending_ids)`` of them (the last sampled token, whose KV no turn
    needed yet; the next prefill reads it first) exists on the workers that computed it.

    The KV itself stays on those workers, in their :class:`resources.kv_store.KVStore`, so only
    this handle moves between turns; a worker whose store lacks some of it (the last turn ran on
    another pool, or it was evicted) computes it again from ``token_ids``.
    """

    key: str
    token_ids: list[int]
    n_tokens: int

    @property
    def pending_ids(self) -> list[int]:
        return self.token_ids[self.n_tokens:]

    def __sizeof__(self) -> int:
        return 64 * (len(self.token_ids) + 4)


@dataclass
class DecodeOutput:
    """The trajectory's cache after this turn (opaque to the flows: a backend's handle, see
    :mod:`tasks.inference`) and the sample."""

    cache: Any
    sample: TurnSample

    def __sizeof__(self) -> int:
        return sys.getsizeof(self.cache) + 64 * (len(self.sample.token_ids) + 4)


@dataclass(frozen=True)
class EnvHandle:
    """An environment instance living in the registry of one worker."""

    worker: str
    instance_id: str


@dataclass
class EnvObservation:
    """Result of env_reset / env_step, plus the tokens the next prefill must read."""

    handle: EnvHandle
    text: str
    input_ids: list[int]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict = field(default_factory=dict)
    sample: TurnSample | None = None  # the action that produced this observation
    consumed_ids: list[int] = field(default_factory=list)  # the ids read before that action
    step_seconds: float = 0.0
    env_steps: int = 0  # steps applied to the instance when this was observed (0: the reset)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


@dataclass
class Trajectory:
    """One finished episode, assembled by the driver from its turns.

    token_ids, loss_mask, behaviour_logprobs, versions: [T]. loss_mask is True only on tokens
    the policy generated; versions is -1 elsewhere.
    """

    traj_id: str
    group_id: str
    env_name: str
    seed: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    env_rewards: list[float]
    responses: list[str]
    info: dict  # the environment's last info, as it gave it (handed to the reward function)
    num_turns: int
    truncated: bool  # ended by the context limit or max_turns, not by the environment
    context_truncated: bool
    attempt: int = 0
    success: bool = False
    format_errors: int = 0
    env_step_s: float = 0.0  # environment time summed over the turns
    evaluation: bool = False  # a greedy episode on a held-out seed: reported, never trained
    reward: float | None = None
    reward_details: dict = field(default_factory=dict)
    # oldest weights of any forward pass, KV-only passes included (TurnSample.oldest_version)
    forward_oldest_version: int | None = None
    virtual_tokens: int = 0  # TurnSample.virtual_tokens summed over the turns
    virtual_response_tokens: int = 0  # TurnSample.virtual_response_tokens summed likewise

    @property
    def oldest_version(self) -> int:
        """The oldest weights that touched this trajectory: of its sampled tokens, and of every
        forward pass whose KV later tokens read."""
        gen = self.versions[self.loss_mask]
        found = [int(gen.min())] if gen.size else []
        if self.forward_oldest_version is not None and self.forward_oldest_version >= 0:
            found.append(self.forward_oldest_version)
        return min(found) if found else 0


@dataclass
class ScoreRequest:
    """JSON-able request for one trajectory's reward (crosses the Lambda boundary as JSON)."""

    id: str
    idempotency_key: str
    reward_fn: str
    env_name: str
    env_rewards: list[float]
    responses: list[str]
    info: dict
    # tokens the trajectory stands for on emulated devices: what an emulated reward model reads
    # (emulation metadata, never sent to the function)
    virtual_tokens: int = 0

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "virtual_tokens"}


@dataclass
class ScoreResult:
    """One trajectory's reward, or ``error`` (``"<reason>: <message>"``) and no score."""

    id: str
    score: float | None
    details: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class InvocationRecord:
    """One call of a reward function (one Lambda ``invoke``, or one in-process call).

    ``status`` is ``ok``, ``function_error``, ``bad_event``, or the AWS error code the call
    ended with (e.g. ``TooManyRequestsException`` once retries ran out). ``sdk_retries`` are the
    re-sends botocore made itself; ``throttles`` counts every 429 seen, whichever layer retried.
    """

    function: str
    batch_size: int
    payload_bytes: int
    latency_s: float
    status: str
    sdk_retries: int = 0
    throttles: int = 0
    cold_start: bool = False
    init_ms: float | None = None
    attempt: int = 0  # 0: the first call of its batch; k: the client's k-th retry of it


@dataclass
class ScoreBatch:
    """What the ``score`` task returns: one result per request, in order, and the calls made."""

    results: list[ScoreResult]
    invocations: list[InvocationRecord] = field(default_factory=list)
    deduplicated: int = 0  # requests answered from the client's ledger (key already scored)


@dataclass
class TrainSample:
    """One trajectory as the trainer sees it. Arrays are [T]."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantage: float
    virtual_tokens: int = 0  # Trajectory.virtual_tokens (emulated trainers count these)
    virtual_response_tokens: int = 0  # Trajectory.virtual_response_tokens


@dataclass
class TrainBatch:
    samples: list[TrainSample]
    policy_version: int


@dataclass
class TrainStats:
    policy_version: int  # version after the step
    loss: float
    pg_clipfrac: float
    tis_mean: float
    kl_behaviour: float
    entropy: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float

    def log(self, prefix: str = "train") -> dict[str, float]:
        return {f"{prefix}/{k}": float(v) for k, v in self.__dict__.items()}


@dataclass
class WeightsSnapshot:
    """Published weights: float32 numpy arrays by parameter name."""

    version: int
    state: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.state.values()))

    def __sizeof__(self) -> int:
        return self.nbytes + 128 * len(self.state)
