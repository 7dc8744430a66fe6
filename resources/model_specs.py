"""Production models as the device model (:mod:`resources.device_model`) sees them.

A :class:`ModelSpec` counts parameters from a Hugging Face ``config.json`` (embeddings,
attention, dense or mixture-of-experts MLP, norms), the KV bytes of one token, and what the
device model needs for a MoE (experts per layer, experts per token, one routed expert's size)
and for tensor-parallel communication (the hidden size). :data:`PRESETS` holds the shapes the
configs name; :func:`model_spec` resolves a preset or a config file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class ModelSpec(BaseModel):
    """A production model as the device model sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name or the config's model_type")
    params_total: float = Field(gt=0, description="All parameters (what memory holds)")
    params_active: float = Field(gt=0, description="Parameters one token runs through (MoE: "
                                 "the routed experts only)")
    layers: int = Field(default=0, ge=0, description="Transformer layers (0: attention FLOPs "
                        "and per-layer floors not modelled)")
    q_dim: int = Field(default=0, ge=0, description="Query width: heads x head size")
    hidden: int = Field(default=0, ge=0, description="Hidden size: the width of the activations "
                        "tensor- and expert-parallel collectives move (0: not modelled)")
    experts: int = Field(default=0, ge=0, description="Routed experts per MoE layer (0: dense)")
    experts_per_token: int = Field(default=0, ge=0, description="Routed experts each token uses")
    expert_params: float = Field(default=0.0, ge=0, description="Parameters of one routed "
                                 "expert in one layer")
    vocab: int = Field(default=0, ge=0, description="Vocabulary size: with the hidden size, the "
                       "language-model head's and the embedding table's shapes (0: not modelled, "
                       "every active parameter is a matmul at every token)")
    tied_embeddings: bool = Field(default=False, description="The head is the embedding table")
    kv_bytes_per_token: float = Field(gt=0, description="KV cache bytes of one token, all layers")
    bytes_per_param: float = Field(default=2.0, gt=0, description="2 for bf16 weights")

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.bytes_per_param

    @property
    def moe(self) -> bool:
        return self.experts > 0 and self.experts_per_token > 0 and self.expert_params > 0

    @property
    def shared_params(self) -> float:
        """Parameters every token reads whatever its routing: attention, embeddings, norms,
        routers, shared experts (all of a dense model)."""
        if not self.moe:
            return self.params_total
        return self.params_total - self.layers * self.experts * self.expert_params

    @property
    def head_params(self) -> float:
        """The language-model head (hidden x vocab): a matmul only where logits are taken."""
        return float(self.vocab * self.hidden)

    @property
    def lookup_params(self) -> float:
        """An untied input embedding table: read one row per token, no matmul (0 when tied)."""
        return 0.0 if self.tied_embeddings else self.head_params

    @property
    def body_params(self) -> float:
        """Active parameters every token multiplies through, the head and the table left out."""
        return self.params_active - self.lookup_params - self.head_params

    @property
    def attention_pair_flops(self) -> float:
        """QK^T and AV of one query over one key, all layers."""
        return 4.0 * self.layers * self.q_dim

    def attention_flops(self, tokens: float, positions: float) -> float:
        """QK^T and AV of ``tokens`` queries over ``positions`` keys each, all layers."""
        return self.attention_pair_flops * tokens * positions

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
        per_token = expert = 0
        if experts:
            per_token = int(c["num_experts_per_tok"])
            expert = 3 * hidden * int(c.get("moe_intermediate_size") or c["intermediate_size"])
            shared = 3 * hidden * int(c.get("shared_expert_intermediate_size") or 0)
            shared += int(c.get("n_shared_experts") or 0) * expert
            router = hidden * experts
            per_layer_total = attn + experts * expert + shared + router
            per_layer_active = attn + per_token * expert + shared + router
        else:
            per_layer_total = per_layer_active = attn + 3 * hidden * int(c["intermediate_size"])
        norms = 2 * hidden * layers + hidden
        embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
        return cls(name=str(c.get("model_type", "hf")),
                   params_total=layers * per_layer_total + norms + embeddings,
                   params_active=layers * per_layer_active + norms + embeddings,
                   layers=layers, q_dim=heads * head_dim, hidden=hidden, experts=experts,
                   experts_per_token=per_token, expert_params=float(expert), vocab=vocab,
                   tied_embeddings=bool(c.get("tie_word_embeddings", False)),
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
