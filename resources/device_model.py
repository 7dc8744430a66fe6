"""The device model: how long a unit of work of a *production* model takes on a hardware profile.

One model, used by everything that needs a device time (the affinity router, the emulated
inference backend, the simulator), so they cannot disagree. One engine step takes

    t = floor + communication(tokens) + max(FLOPs / (peak x MFU), bytes / (bandwidth x MBU))

on the engine's devices, with the stated MFU and MBU (defaults 0.5 and 0.8: typical of serving
and training stacks on Hopper GPUs). The floor-plus-roofline form is the one the engine profile
(``flows/bench_engine.py``, :mod:`flows.benchmarks.engine_profile`) fits to a real engine's
measured step times: its FLOP and byte features are :meth:`DeviceModel.decode_work` and
:meth:`DeviceModel.prefill_work`, and its fitted floor is :attr:`DeviceModel.step_floor`.

- **floor** (:attr:`DeviceModel.step_floor`): the host work of a step (scheduling, inputs,
  sampling) plus each layer's kernels at tiny work, more for a MoE layer; the constants and
  their sources are in :mod:`resources.catalog`. It is what makes one sequence at batch 1 cost
  several ms per token on a real engine, not the fraction of a ms its bytes take.
- **communication** (:meth:`DeviceModel.comm_time`), on an engine of more than one device: a
  tensor-parallel all-reduce of the step's activations (``tokens x hidden x 2`` bytes, a ring:
  ``2 (g-1)/g`` of them over each device's link) after attention and after the MLP, each with
  the link's per-call latency; a MoE layer replaces the MLP's all-reduce by an expert-parallel
  dispatch and combine (all-to-all of each token's ``k`` expert copies, tokens spread evenly
  over the devices). Within a node over NVLink; an engine of more than 8 devices over RDMA.
- FLOPs count ``2 x`` the parameters a token multiplies through: the body's (the active
  parameters less the embedding table and the language-model head) at every token, the head's
  (``hidden x vocab``) only where logits are taken: the last token of a prefill chunk (the
  engine samples there), every decoded token, the positions a training step's loss reads. An
  untied input embedding table is a lookup, a row per token: no FLOPs, not read whole;
- prefill of ``n`` tokens after ``c`` cached ones: the body's FLOPs for ``n`` tokens, the head's
  for one, plus attention over ``c + n/2`` positions on average; it reads the weights its tokens
  touch and the ``c`` tokens' KV, and writes the ``n`` new tokens' KV;
- one decode step of a batch: the body's and the head's FLOPs per sequence plus attention over
  its context; it reads the weights and every sequence's KV. A MoE reads its shared (non-expert)
  weights once per step and the routed experts its tokens touch: of ``E`` experts with ``k`` per
  token, ``E (1 - (1 - k/E)^T)`` distinct ones per layer are expected for ``T`` tokens routed
  independently and uniformly (the occupancy of ``E`` bins after ``T`` draws of ``k``; balanced
  routing is what MoE load-balancing losses train for, Switch Transformer arXiv 2101.03961 §2.2).
  Expert weights are counted as spread evenly over the devices;
- a mixed step (chunked prefill plus decodes on one engine, as vLLM schedules them): both works'
  FLOPs and bytes in one step, the weights read once for all its tokens;
- a training step (:meth:`DeviceModel.train_step_time`), the passes ``tasks/trainer.py`` runs:
  the proximal log-probs' forward over every minibatch but the first (whose own first forward
  pass still has the step's starting weights; the head at the loss's positions, as the trainer
  takes log-probs there only), then per PPO epoch a forward and backward
  (``3 x`` the forward's FLOPs), and an optimizer step per minibatch (AdamW in mixed precision:
  reading and writing fp32 weights and moments, about 28 bytes per parameter, ZeRO arXiv
  1910.02054 §3.1, sharded over the trainer's devices; plus a step floor). Gradient reduction
  overlaps the backward pass (PyTorch DDP's bucketing, ZeRO's overlapped reduce-scatter) and is
  not counted;
- a weight broadcast and a KV transfer: bytes over the link between two engines at the narrower
  end's bandwidth (each end's devices times its per-device NIC, or NVLink within a node), plus
  the link's latency.

Per-device memory holds the weights first (sharded over the engine's GPUs); what is left, at
``memory_utilization``, holds KV cache and so caps how many sequences run at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from resources.catalog import HardwareProfile
from resources.model_specs import PRESETS, ModelName, ModelSpec, model_spec

__all__ = ["PRESETS", "DeviceModel", "Link", "ModelName", "ModelSpec", "model_spec"]

GPUS_PER_NODE = 8  # devices one NVLink domain joins (HGX/DGX servers)
ACTIVATION_BYTES = 2  # bf16 activations in tensor- and expert-parallel collectives
ADAM_STEP_BYTES = 28  # per parameter: fp32 weight, m, v read and written, grad read, bf16 write


@dataclass(frozen=True)
class Link:
    """One end of a transfer: its bandwidth (all its devices together, bytes/s) and latency."""

    bandwidth: float
    latency: float


class DeviceModel:
    """Times of the units of work of ``model`` on an engine of ``gpus`` devices of ``hw``."""

    def __init__(self, model: ModelSpec, hw: HardwareProfile, gpus: int = 1, mfu: float = 0.5,
                 mbu: float = 0.8, memory_utilization: float = 0.9):
        if gpus < 1:
            raise ValueError("an engine has at least one device")
        self.model, self.hw, self.gpus = model, hw, gpus
        self.mfu, self.mbu, self.memory_utilization = mfu, mbu, memory_utilization
        # The model's and the engine's constants, worked out once: the simulator and the router
        # time millions of steps. An engine's model, profile and size do not change (the spec
        # and the profile are frozen); each is the same expression, in the same order, that the
        # methods below would evaluate, so every time is bit-for-bit what it was.
        self._flops_rate = hw.peak_flops * gpus * mfu
        self._bytes_rate = hw.mem_bandwidth * gpus * mbu
        per_layer = hw.layer_floor_s + (hw.moe_layer_floor_s if model.moe else 0.0)
        self._step_floor = hw.step_floor_s + model.layers * per_layer
        self._moe, self._body, self._head = model.moe, model.body_params, model.head_params
        self._token_flops = 2.0 * (self._body + self._head)  # a decoded token's matmuls
        self._attention = model.attention_pair_flops
        self._kv = model.kv_bytes_per_token
        self._unrouted = model.shared_params - model.lookup_params  # a MoE's weights every step
        self._dense_weights = (model.params_total - model.lookup_params) * model.bytes_per_param
        self._all_reduce = 2 * (gpus - 1) / gpus  # of the activations, over each device's link

    def _roofline(self, flops: float, bytes_moved: float) -> float:
        return max(flops / self._flops_rate, bytes_moved / self._bytes_rate)

    # -- floor and communication -----------------------------------------------------------------
    @property
    def step_floor(self) -> float:
        """Seconds every engine step takes whatever its work: the host's step plus each
        layer's kernels (a MoE layer's more)."""
        return self._step_floor

    def _collective(self, nbytes: float) -> float:
        """One collective call moving ``nbytes`` over each device's link."""
        hw = self.hw
        if self.gpus > GPUS_PER_NODE:
            return hw.network_latency_s + nbytes / hw.network_bandwidth
        return hw.nvlink_latency_s + nbytes / hw.nvlink_bandwidth

    def comm_time(self, tokens: float) -> float:
        """Tensor- and expert-parallel communication of one step over ``tokens`` tokens (0 on
        one device, or when the model's hidden size is not known)."""
        m, g = self.model, self.gpus
        if g == 1 or not m.hidden or not m.layers:
            return 0.0
        activations = tokens * m.hidden * ACTIVATION_BYTES
        all_reduce = self._collective(self._all_reduce * activations)
        if not self._moe:
            return m.layers * 2 * all_reduce
        all_to_all = self._collective(activations * m.experts_per_token * (g - 1) / g / g)
        return m.layers * (all_reduce + 2 * all_to_all)

    def step_time(self, flops: float, bytes_moved: float, tokens: float) -> float:
        """One engine step of this work over ``tokens`` tokens: floor, communication, roofline."""
        return self._step_floor + self.comm_time(tokens) + self._roofline(flops, bytes_moved)

    # -- memory ---------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit beside the weights (0 if the weights do not fit)."""
        free = self.hw.memory_bytes * self.gpus * self.memory_utilization - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def fits(self, contexts: list[int]) -> bool:
        """Whether sequences of these context lengths fit in KV memory at once."""
        return sum(contexts) <= self.kv_capacity_tokens

    # -- inference work -------------------------------------------------------------------------
    def expected_experts(self, tokens: float) -> float:
        """Distinct routed experts per layer that ``tokens`` tokens touch: ``E (1 - (1 - k/E)^T)``
        (0 for a dense model)."""
        m = self.model
        if not self._moe or tokens <= 0:
            return 0.0
        return m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** tokens)

    def weights_read(self, tokens: float) -> float:
        """Weight bytes a step over ``tokens`` tokens reads: all of a dense model; of a MoE, the
        shared weights once and the experts its tokens touch. An untied input embedding table
        is read a row per token, which is left out. A MoE spec without expert shapes reads
        ``active`` parameters per token, at most all."""
        m = self.model
        if self._moe:
            routed = m.layers * self.expected_experts(tokens) * m.expert_params
            return (self._unrouted + routed) * m.bytes_per_param
        if m.params_active < m.params_total:
            return min(m.params_total, m.params_active * max(tokens, 1)) * m.bytes_per_param
        return self._dense_weights

    def _prefill_compute(self, n: int, cached: int) -> tuple[float, float]:
        """FLOPs and KV bytes of a prefill chunk, the weights left out: the head's logits at
        its last token only (what the engine samples from)."""
        flops = 2.0 * (self._body * n + self._head) + self._attention * n * (cached + n / 2)
        return flops, self._kv * (cached + n)

    def _decode_compute(self, batch: int, total_context: float) -> tuple[float, float]:
        """FLOPs and KV bytes of a decode step: they depend on its batch only through its size
        and the sum of its contexts (what lets the simulator keep a running batch as two
        numbers)."""
        flops = self._token_flops * batch + self._attention * total_context
        return flops, self._kv * total_context

    def prefill_work(self, n: int, cached: int = 0) -> tuple[float, float]:
        """FLOPs and bytes (weights and KV) of one prefill step of ``n`` tokens after
        ``cached``."""
        flops, kv = self._prefill_compute(n, cached)
        return flops, self.weights_read(n) + kv

    def decode_work(self, batch: int, total_context: float) -> tuple[float, float]:
        """FLOPs and bytes (weights and KV) of one decode step of ``batch`` sequences whose
        contexts sum to ``total_context``."""
        flops, kv = self._decode_compute(batch, total_context)
        return flops, self.weights_read(batch) + kv

    def prefill_time(self, n: int, cached: int = 0) -> float:
        """Seconds to read ``n`` new tokens after ``cached`` ones, in one step."""
        return self.step_time(*self.prefill_work(n, cached), n)

    def decode_step_time(self, contexts: list[int]) -> float:
        """Seconds of one decode step (one token each) for sequences at these context lengths."""
        return self.decode_batch_time(len(contexts), sum(contexts))

    def decode_batch_time(self, batch: int, total_context: float) -> float:
        """:meth:`decode_step_time` of ``batch`` sequences whose contexts sum to
        ``total_context``."""
        if batch <= 0:
            return 0.0
        return self.step_time(*self.decode_work(batch, total_context), batch)

    def mixed_step_time(self, prefills: list[tuple[int, int]], contexts: list[int]) -> float:
        """One engine step running chunked prefills (``(n, cached)`` each) and decodes
        together: the weights are read once for both."""
        return self.mixed_batch_time(prefills, len(contexts), sum(contexts))

    def mixed_batch_time(self, prefills: list[tuple[int, int]], batch: int,
                         total_context: float) -> float:
        """:meth:`mixed_step_time` with the decodes given as their number and summed
        contexts."""
        flops = kv = 0.0
        tokens = batch
        for n, cached in prefills:
            f, b = self._prefill_compute(n, cached)
            flops, kv, tokens = flops + f, kv + b, tokens + n
        if tokens <= 0:
            return 0.0
        f, b = self._decode_compute(batch, total_context) if batch else (0.0, 0.0)
        return self.step_time(flops + f, self.weights_read(tokens) + kv + b, tokens)

    # -- training -------------------------------------------------------------------------------
    def optimizer_step_time(self) -> float:
        """One AdamW step over every parameter, sharded over the devices, plus a step floor."""
        nbytes = self.model.params_total * ADAM_STEP_BYTES
        return self.hw.step_floor_s + nbytes / (self.hw.mem_bandwidth * self.gpus * self.mbu)

    def train_step_time(self, sequences: int | list[int], ppo_epochs: int = 1,
                        minibatches: int = 1, loss_tokens: int | None = None) -> float:
        """A training step over sequences of these lengths (an int: one sequence), as
        ``tasks/trainer.py`` runs it: the proximal log-probs' forward (2 x the body's active
        params per token, the head's at the ``loss_tokens`` positions the loss reads (None:
        every position), plus causal attention within each sequence) over all minibatches but
        the first, whose own first forward pass gives them, then ``ppo_epochs`` passes of
        forward and backward (3 x the forward), compute-bound, with an optimizer step per
        minibatch of each pass. Every forward or backward pass pays the layers' kernel
        floor."""
        if ppo_epochs < 1 or minibatches < 1:
            raise ValueError("ppo_epochs and minibatches are at least 1")
        m = self.model
        lengths = [sequences] if isinstance(sequences, int) else list(sequences)
        logits = sum(lengths) if loss_tokens is None else loss_tokens
        forward = 2.0 * (m.body_params * sum(lengths) + m.head_params * logits) + sum(
            m.attention_flops(n, 0.5 * n) for n in lengths)
        proximal = (minibatches - 1) / minibatches  # the share of the batch it covers
        compute = forward * (proximal + 3 * ppo_epochs) / (
            self.hw.peak_flops * self.gpus * self.mfu)
        updates = ppo_epochs * minibatches
        kernels = ((minibatches > 1) + 2 * updates) * (self.step_floor - self.hw.step_floor_s)
        return compute + kernels + updates * self.optimizer_step_time()

    # -- transfers ------------------------------------------------------------------------------
    def link(self, within_node: bool = False) -> Link:
        """This engine's end of a transfer: NVLink within a node, else each device's RDMA NIC."""
        hw = self.hw
        if within_node:
            return Link(hw.nvlink_bandwidth * self.gpus, hw.nvlink_latency_s)
        return Link(hw.network_bandwidth * self.gpus, hw.network_latency_s)

    def _peer_link(self, peer: DeviceModel | Link | int, within_node: bool) -> Link:
        if isinstance(peer, DeviceModel):
            return peer.link(within_node)
        if isinstance(peer, Link):
            return peer
        mine = self.link(within_node)
        return Link(mine.bandwidth / self.gpus * peer, mine.latency)

    def transfer_time(self, nbytes: float, within_node: bool = False,
                      peer: DeviceModel | Link | int | None = None) -> float:
        """Bytes between this engine and ``peer`` (the other end: its device model, its
        :class:`Link`, or its device count on this profile; None: an end like this one) at the
        narrower end's bandwidth, plus the slower end's latency."""
        a = self.link(within_node)
        b = a if peer is None else self._peer_link(peer, within_node)
        return max(a.latency, b.latency) + nbytes / min(a.bandwidth, b.bandwidth)

    def kv_transfer_time(self, tokens: int, within_node: bool = False,
                         peer: DeviceModel | Link | int | None = None) -> float:
        """The KV of ``tokens`` tokens handed between this engine and ``peer`` (the other
        end, sender or receiver: the narrower one sets the bandwidth)."""
        if tokens <= 0:
            return 0.0
        return self.transfer_time(tokens * self.model.kv_bytes_per_token, within_node, peer)

    def weight_broadcast_time(self, within_node: bool = False,
                              peer: DeviceModel | Link | int | None = None) -> float:
        """The trainer's weights to one inference engine (a pipelined broadcast to many takes
        about as long as to one)."""
        return self.transfer_time(self.model.weight_bytes, within_node, peer)
