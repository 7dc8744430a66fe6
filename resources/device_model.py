"""The device model: how long a unit of work of a *production* model takes on a hardware profile.

One model, used by everything that needs a device time (the affinity router today; the emulated
inference backend and the simulator build on it), so they cannot disagree. A roofline: each unit
takes ``max(FLOPs / (peak x MFU), bytes / (bandwidth x MBU))`` on the engine's devices, with the
stated MFU and MBU (defaults 0.5 and 0.8: typical of serving and training stacks on Hopper GPUs).

- prefill of ``n`` tokens after ``c`` cached ones: ``2 x active params x n`` FLOPs for the
  weights plus attention over ``c + n/2`` positions on average; it reads the weights once and
  the ``c`` tokens' KV, and writes the ``n`` new tokens' KV;
- one decode step of a batch: ``2 x active params`` FLOPs per sequence plus attention over its
  context; it reads the weights (of a MoE, the experts the batch touches) and every sequence's KV;
- a mixed step (chunked prefill plus decodes on one engine, as vLLM schedules them): both works'
  FLOPs and bytes in one pass, the weights read once;
- a training step over sequences of ``N`` tokens in all: ``6 x active params x N`` (forward
  and backward) plus a forward for the proximal log-probs (``2 x``), and each sequence's causal
  attention, on the trainer pool's devices;
- a weight broadcast and a KV transfer: bytes over the link between pools (RDMA per GPU), or
  over NVLink within a node.

Per-device memory holds the weights first (sharded over the engine's GPUs); what is left, at
``memory_utilization``, holds KV cache and so caps how many sequences run at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from resources.catalog import HardwareProfile


class ModelSpec(BaseModel):
    """A production model as the device model sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name or the config's model_type")
    params_total: float = Field(gt=0, description="All parameters (what memory holds)")
    params_active: float = Field(gt=0, description="Parameters one token runs through (MoE: "
                                 "the routed experts only)")
    layers: int = Field(default=0, ge=0, description="Transformer layers (0: attention FLOPs "
                        "not modelled)")
    q_dim: int = Field(default=0, ge=0, description="Query width: heads x head size")
    kv_bytes_per_token: float = Field(gt=0, description="KV cache bytes of one token, all layers")
    bytes_per_param: float = Field(default=2.0, gt=0, description="2 for bf16 weights")

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.bytes_per_param

    def attention_flops(self, tokens: float, positions: float) -> float:
        """QK^T and AV of ``tokens`` queries over ``positions`` keys each, all layers."""
        return 4.0 * self.layers * self.q_dim * tokens * positions

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path, kv_bytes: float = 2.0,
                       bytes_per_param: float = 2.0) -> ModelSpec:
        """From a Hugging Face ``config.json`` (a path or the parsed dict): parameters counted
        from the shapes (embeddings, attention, dense or mixture-of-experts MLP, norms), and KV
        bytes per token from layers x KV heads x head size."""
        if not isinstance(config, dict):
            config = json.loads(Path(config).read_text())
        c = config.get("text_config", config)
        hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        vocab = int(c["vocab_size"])
        attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
        experts = int(c.get("num_experts") or c.get("num_local_experts")
                      or c.get("n_routed_experts") or 0)
        if experts:
            expert = 3 * hidden * int(c.get("moe_intermediate_size") or c["intermediate_size"])
            shared = 3 * hidden * int(c.get("shared_expert_intermediate_size") or 0)
            shared += int(c.get("n_shared_experts") or 0) * expert
            router = hidden * experts
            per_layer_total = attn + experts * expert + shared + router
            per_layer_active = attn + int(c["num_experts_per_tok"]) * expert + shared + router
        else:
            per_layer_total = per_layer_active = attn + 3 * hidden * int(c["intermediate_size"])
        norms = 2 * hidden * layers + hidden
        embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
        return cls(name=str(c.get("model_type", "hf")),
                   params_total=layers * per_layer_total + norms + embeddings,
                   params_active=layers * per_layer_active + norms + embeddings,
                   layers=layers, q_dim=heads * head_dim,
                   kv_bytes_per_token=2 * layers * kv_heads * head_dim * kv_bytes,
                   bytes_per_param=bytes_per_param)


# Shapes from the models' published config.json files (Hugging Face model cards).
PRESETS: dict[str, ModelSpec] = {
    # meta-llama/Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336
    "dense-8b": ModelSpec.from_hf_config({
        "model_type": "dense-8b", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "tie_word_embeddings": False}),
    # Qwen/Qwen2.5-32B: 64 layers, hidden 5120, 40 heads, 8 KV heads, MLP 27648
    "dense-32b": ModelSpec.from_hf_config({
        "model_type": "dense-32b", "hidden_size": 5120, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
        "vocab_size": 152064, "tie_word_embeddings": False}),
    # Qwen/Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads x 128, 4 KV heads, 128 experts of
    # 768, 8 routed per token
    "moe-30b-a3b": ModelSpec.from_hf_config({
        "model_type": "moe-30b-a3b", "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}),
    # Qwen/Qwen3-235B-A22B: 94 layers, hidden 4096, 64 heads x 128, 4 KV heads, 128 experts of
    # 1536, 8 routed per token (the scale of the MoE arXiv 2512.22560 trains on 3,000+ GPUs)
    "moe-235b-a22b": ModelSpec.from_hf_config({
        "model_type": "moe-235b-a22b", "hidden_size": 4096, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}),
}


def _known_model(name: str) -> str:
    try:
        model_spec(name)
    except (KeyError, OSError, ValueError) as exc:
        raise ValueError(str(exc).strip("'\"")) from None
    return name


# a config field naming a production model: a preset or a Hugging Face config.json, checked
# when the config loads
ModelName = Annotated[str, AfterValidator(_known_model)]


def model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name, or the ``config.json`` of a Hugging Face model directory or file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise KeyError(f"unknown model {name_or_path!r}: a preset ({sorted(PRESETS)}) or a "
                       "Hugging Face config.json")
    return ModelSpec.from_hf_config(path)


class DeviceModel:
    """Times of the units of work of ``model`` on an engine of ``gpus`` devices of ``hw``."""

    def __init__(self, model: ModelSpec, hw: HardwareProfile, gpus: int = 1, mfu: float = 0.5,
                 mbu: float = 0.8, memory_utilization: float = 0.9):
        if gpus < 1:
            raise ValueError("an engine has at least one device")
        self.model, self.hw, self.gpus = model, hw, gpus
        self.mfu, self.mbu, self.memory_utilization = mfu, mbu, memory_utilization

    def _roofline(self, flops: float, bytes_moved: float) -> float:
        return max(flops / (self.hw.peak_flops * self.gpus * self.mfu),
                   bytes_moved / (self.hw.mem_bandwidth * self.gpus * self.mbu))

    # -- memory ---------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit beside the weights (0 if the weights do not fit)."""
        free = self.hw.memory_bytes * self.gpus * self.memory_utilization - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def fits(self, contexts: list[int]) -> bool:
        """Whether sequences of these context lengths fit in KV memory at once."""
        return sum(contexts) <= self.kv_capacity_tokens

    # -- inference ------------------------------------------------------------------------------
    def _decode_weight_bytes(self, batch: int) -> float:
        """Weights a decode step reads: all of a dense model; of a MoE, the experts its batch
        touches, at most all of them (each sequence routes to ``active`` parameters' worth)."""
        m = self.model
        return min(m.params_total, m.params_active * max(batch, 1)) * m.bytes_per_param

    def _prefill_work(self, n: int, cached: int) -> tuple[float, float]:
        m = self.model
        flops = 2.0 * m.params_active * n + m.attention_flops(n, cached + n / 2)
        return flops, m.kv_bytes_per_token * (cached + n)

    def _decode_work(self, batch: int, total_context: float) -> tuple[float, float]:
        """A decode step's work depends on its batch only through its size and the sum of
        its contexts (what lets the simulator keep a running batch as two numbers)."""
        m = self.model
        flops = 2.0 * m.params_active * batch + m.attention_flops(1, total_context)
        return flops, m.kv_bytes_per_token * total_context

    def prefill_time(self, n: int, cached: int = 0) -> float:
        """Seconds to read ``n`` new tokens after ``cached`` ones."""
        flops, kv = self._prefill_work(n, cached)
        return self._roofline(flops, self.model.weight_bytes + kv)

    def decode_step_time(self, contexts: list[int]) -> float:
        """Seconds of one decode step (one token each) for sequences at these context lengths."""
        return self.decode_batch_time(len(contexts), sum(contexts))

    def decode_batch_time(self, batch: int, total_context: float) -> float:
        """:meth:`decode_step_time` of ``batch`` sequences whose contexts sum to
        ``total_context``."""
        if batch <= 0:
            return 0.0
        flops, kv = self._decode_work(batch, total_context)
        return self._roofline(flops, self._decode_weight_bytes(batch) + kv)

    def mixed_step_time(self, prefills: list[tuple[int, int]], contexts: list[int]) -> float:
        """One engine step running chunked prefills (``(n, cached)`` each) and decodes
        together: the weights are read once for both."""
        return self.mixed_batch_time(prefills, len(contexts), sum(contexts))

    def mixed_batch_time(self, prefills: list[tuple[int, int]], batch: int,
                         total_context: float) -> float:
        """:meth:`mixed_step_time` with the decodes given as their number and summed
        contexts."""
        flops = kv = 0.0
        for n, cached in prefills:
            f, b = self._prefill_work(n, cached)
            flops, kv = flops + f, kv + b
        f, b = self._decode_work(batch, total_context) if batch else (0.0, 0.0)
        weights = self.model.weight_bytes if prefills else self._decode_weight_bytes(batch)
        return self._roofline(flops + f, weights + kv + b)

    # -- training and transfers ------------------------------------------------------------------
    def train_step_time(self, sequences: int | list[int]) -> float:
        """A training step over sequences of these lengths (an int: one sequence): forward and
        backward (6 x active params per token) plus the proximal log-probs' forward (2 x), and
        causal attention within each sequence, compute-bound."""
        m = self.model
        lengths = [sequences] if isinstance(sequences, int) else list(sequences)
        tokens = sum(lengths)
        flops = 8.0 * m.params_active * tokens + 4 * sum(m.attention_flops(n, 0.5 * n)
                                                         for n in lengths)
        return flops / (self.hw.peak_flops * self.gpus * self.mfu)

    def transfer_time(self, nbytes: float, within_node: bool = False) -> float:
        """Bytes from this engine's devices to another pool's: RDMA per GPU across nodes, or
        NVLink within one, spread over the engine's devices."""
        link = self.hw.nvlink_bandwidth if within_node else self.hw.network_bandwidth
        return nbytes / (link * self.gpus)

    def kv_transfer_time(self, tokens: int, within_node: bool = False) -> float:
        """The KV of ``tokens`` tokens handed from a prefill engine to a decode engine."""
        return self.transfer_time(tokens * self.model.kv_bytes_per_token, within_node)

    def weight_broadcast_time(self, within_node: bool = False) -> float:
        """The trainer's weights to one inference engine (a pipelined broadcast to many takes
        about as long as to one)."""
        return self.transfer_time(self.model.weight_bytes, within_node)
