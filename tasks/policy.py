"""The policy: a causal LM of a real transformers architecture, and its tokenizer.

The embedded default is a tiny Qwen2 initialised at random from config, with a word-level
tokenizer built here from the environments' vocabulary (no download). ``policy.path`` loads any
Hugging Face causal-LM directory instead, and its chat template is applied when it has one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Words of the built-in environments' observations and actions, plus digits: every observation is
# tokenised to known ids, while the policy still samples from the whole vocabulary.
WORDS = (
    "you are at row col on a frozen lake reach the goal G without falling into hole H "
    "move left down right up reply with one word fell in reached invalid action turn turns "
    "guess number between and it is higher lower correct out of game over S F P / "
    "cell yes no ok stop start wall box push solved answer think , . : ?"
).split()
NUMBERS = [str(i) for i in range(0, 33)]


def env_words() -> list[str]:
    """The words of the environments that declare a ``VOCAB``, appended after the digits in this
    order (a new environment goes last), so earlier ids stay as they were."""
    from tasks.envs import sokoban, tool_use, word_answer

    return [*word_answer.VOCAB, *sokoban.VOCAB, *tool_use.VOCAB]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}<|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


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
    init_seed: int = Field(default=0, description="Seed of the random initialisation")
    max_context: int = Field(default=256, ge=8, description="Context limit in tokens")
    system_prompt: str | None = Field(default=None, description="Optional system message")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The shipped word-level tokenizer with a compact chat template."""
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + WORDS + NUMBERS + env_words():
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(spec: PolicySpec) -> PreTrainedTokenizerFast:
    if spec.path:
        return AutoTokenizer.from_pretrained(spec.path)
    return build_tokenizer()


def load_policy(spec: PolicySpec) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build or load the model (float32, eval mode) and its tokenizer."""
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
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        return _render(tokenizer, msgs + [{"role": "user", "content": observation}], True)
    text = (system_prompt + "\n" if system_prompt else "") + observation + "\n"
    return tokenizer.encode(text, add_special_tokens=False)


def encode_next_turn(tokenizer, observation: str, response_stopped: bool) -> list[int]:
    """Ids appended after a response: the end-of-message token if the policy did not emit it, then
    the delta the chat template adds for a new user message and the generation prompt."""
    closing = [] if response_stopped else [tokenizer.eos_token_id]
    if tokenizer.chat_template:
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = _render(tokenizer, base, False)
        after = _render(tokenizer, base + [{"role": "user", "content": observation}], True)
        if after[: len(before)] != before:
            raise ValueError("chat template is not prefix-stable; cannot encode turns incrementally")
        delta = after[len(before):]
        # The template closes the assistant message itself; keep only what follows its end token.
        return closing + delta
    return closing + tokenizer.encode(observation + "\n", add_special_tokens=False)


def save_policy(model: PreTrainedModel, tokenizer, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
