"""The policy: a causal LM of a real transformers architecture, and its tokenizer.

The embedded default is a tiny Qwen2 initialised at random from config, with the tokenizer of
:mod:`tasks.tiny_tokenizer` (whole words and characters, no download). ``policy.path`` loads any
Hugging Face causal-LM directory instead, and its chat template is applied when it has one.

``policy.device`` and ``policy.dtype`` say where the model runs and in what precision
(:func:`torch_device`, :func:`torch_dtype`); both resolve on the worker that loads the model, so
one config serves CPU and GPU workers alike. The weights are always built or read in float32 on
the CPU first, so a seeded initialisation is the same on every device.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from tasks.specs import PolicySpec
from tasks.tiny_tokenizer import (  # noqa: F401  (build_tokenizer, spell re-exported)
    build_tokenizer,
    spell,
)


def load_tokenizer(spec: PolicySpec) -> PreTrainedTokenizerFast:
    if spec.path:
        return AutoTokenizer.from_pretrained(spec.path)
    return build_tokenizer(spec.word_sets)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_device(spec: PolicySpec) -> torch.device:
    """``policy.device`` on this worker: auto is the current CUDA device if torch sees one,
    else the CPU."""
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"policy.device is {spec.device!r} but torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"policy.device is {spec.device!r} but torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def torch_dtype(spec: PolicySpec) -> torch.dtype:
    """``policy.dtype`` on this worker: auto is bfloat16 on a CUDA device that supports it,
    float32 otherwise."""
    if spec.dtype != "auto":
        return _DTYPES[spec.dtype]
    if torch_device(spec).type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_policy(spec: PolicySpec, dtype: torch.dtype | None = None
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build or load the model (eval mode) on ``policy.device`` and its tokenizer; its weights
    in ``dtype``, by default ``policy.dtype`` (the trainer asks for float32)."""
    tokenizer = load_tokenizer(spec)
    if spec.path:
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32)
    else:
        cfg = AutoConfig.for_model(
            spec.model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **spec.architecture,
        )
        with torch.random.fork_rng():
            torch.manual_seed(spec.init_seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to(device=torch_device(spec), dtype=dtype or torch_dtype(spec))
    model.eval()
    return model, tokenizer


def kv_geometry(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's cache."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def stop_token_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    for t in ("<|im_end|>", "<|end|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(t)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def encode_first_turn(tokenizer, observation: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of the conversation's start, ending with the generation prompt."""
    if tokenizer.chat_template:
        return list(_first_turn(tokenizer, tokenizer.chat_template, observation, system_prompt))
    text = (system_prompt + "\n" if system_prompt else "") + observation + "\n"
    return tokenizer.encode(text, add_special_tokens=False)


# Environments repeat their observations (a board's few positions, the same hints), so each
# turn's encoding is rendered once per tokenizer, template and text: the template and the
# tokenizer are deterministic, and rendering costs an environment step's time many times over
TURN_CACHE = 4096


@functools.lru_cache(maxsize=TURN_CACHE)
def _first_turn(tokenizer, chat_template: str, observation: str,
                system_prompt: str | None) -> tuple[int, ...]:
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    return tuple(_render(tokenizer, msgs + [{"role": "user", "content": observation}], True))


_BASE_TURN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


@functools.lru_cache(maxsize=16)
def _template_turn(tokenizer, chat_template: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What every turn's encoding reuses, rendered once per tokenizer and template: a
    one-exchange conversation, and the ids the template writes after an assistant message's
    content (the common tail of two renderings that differ only in that content)."""
    a = _render(tokenizer, _BASE_TURN, False)
    b = _render(tokenizer, [_BASE_TURN[0], {"role": "assistant", "content": "z"}], False)
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return tuple(a), tuple(a[len(a) - n:])


@functools.lru_cache(maxsize=TURN_CACHE)
def _user_turn(tokenizer, chat_template: str, observation: str) -> tuple[int, ...]:
    """The ids the template adds after a one-exchange conversation for a user message
    ``observation``, with the generation prompt."""
    before = _template_turn(tokenizer, chat_template)[0]
    after = _render(tokenizer, _BASE_TURN + [{"role": "user", "content": observation}], True)
    if tuple(after[: len(before)]) != before:
        raise ValueError("chat template is not prefix-stable; cannot encode turns incrementally")
    return tuple(after[len(before):])


def assistant_suffix(tokenizer) -> list[int]:
    """The ids the chat template writes after an assistant message's content (ChatML:
    ``<|im_end|>`` ``\\n``)."""
    return list(_template_turn(tokenizer, tokenizer.chat_template)[1])


def encode_next_turn(tokenizer, observation: str, response_ids: list[int]) -> list[int]:
    """Ids appended after a response (its sampled ``response_ids``), so the conversation stays
    token for token what the chat template renders: the rest of the template's end of an assistant
    message (all of it if the response did not stop on its first token), then the delta the
    template adds for a new user message and the generation prompt. Without a template: the eos
    token if the response did not stop, then the observation and a newline."""
    last = response_ids[-1] if response_ids else None
    if tokenizer.chat_template:
        _before, suffix = _template_turn(tokenizer, tokenizer.chat_template)
        closing = list(suffix[1:] if suffix and last == suffix[0] else suffix)
        return closing + list(_user_turn(tokenizer, tokenizer.chat_template, observation))
    closing = [] if last in stop_token_ids(tokenizer) else [tokenizer.eos_token_id]
    return closing + tokenizer.encode(observation + "\n", add_special_tokens=False)


def save_policy(model: PreTrainedModel, tokenizer, path: str | Path) -> None:
    from transformers.utils import logging as hf_logging

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # a one-shard tiny policy needs no bar in the logs
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
