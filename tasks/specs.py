"""What a policy and its trainer are built from, as typed settings: plain data, no torch, so
that a config is checked without importing the model code (:mod:`tasks.policy` and
:mod:`tasks.trainer` build from these)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.tiny_tokenizer import check_word_sets

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class PolicySpec(BaseModel):
    """How to build the policy on any worker."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(default=None, description="Hugging Face model directory; null = tiny")
    model_type: str = Field(default="qwen2", description="transformers model_type of the tiny policy")
    architecture: dict = Field(
        default_factory=lambda: dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=512, tie_word_embeddings=True),
        description="Config kwargs of the tiny policy (vocab_size comes from the tokenizer)",
    )
    word_sets: list[str] = Field(
        default_factory=list, description="Whole-word sets added to the tiny policy's tokenizer "
        "(tasks.tiny_tokenizer.WORD_SETS, e.g. [hc_pinn]); ignored with path")
    init_seed: int = Field(default=0, description="Seed of the random initialisation")
    max_context: int = Field(default=256, ge=8, description="Context limit in tokens")
    system_prompt: str | None = Field(default=None, description="Optional system message")
    device: str = Field(
        default="auto", description="Where the policy runs: auto (cuda if torch sees a GPU, else "
        "cpu), cpu, cuda or cuda:N")
    dtype: str = Field(
        default="auto", description="Inference weights and the trainer's autocast: auto (bfloat16 "
        "on a GPU that supports it, else float32), float32, bfloat16 or float16; the trainer "
        "keeps float32 weights and autocasts to bfloat16 only")

    @field_validator("word_sets")
    @classmethod
    def _known_word_sets(cls, v: list[str]) -> list[str]:
        check_word_sets(v)
        return v

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not DEVICE_PATTERN.fullmatch(v):
            raise ValueError("must be one of auto, cpu, cuda, cuda:N")
        return v

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"must be one of {', '.join(DTYPES)}")
        return v


class TrainerHParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=3e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm")
    ppo_epochs: int = Field(default=1, ge=1, description="Passes over each batch")
    minibatches: int = Field(default=4, ge=1, description="Optimiser steps per pass")
    clip_eps: float = Field(default=0.2, gt=0, description="PPO ratio clip")
    tis_cap: float = Field(default=2.0, gt=0, description="Truncation of the behaviour IS weight")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature (log-probs)")
    entropy_coef: float = Field(default=0.0, ge=0, description="Entropy bonus coefficient")
    lr_final_ratio: float = Field(default=1.0, gt=0, le=1,
                                  description="Linear decay of the lr to this fraction")
    total_steps: int | None = Field(default=None, ge=1,
                                    description="Steps the decay spans (the flow sets max_steps)")
