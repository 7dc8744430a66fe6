"""Policy loading: the tiny default, and any Hugging Face causal-LM directory with its template;
``policy.device`` and ``policy.dtype``."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from flows.config import ConfigError, load_config
from tasks.policy import (
    PolicySpec,
    assistant_suffix,
    build_tokenizer,
    encode_first_turn,
    encode_next_turn,
    load_policy,
    save_policy,
    stop_token_ids,
    torch_device,
    torch_dtype,
)
from tasks.tiny_tokenizer import ENV_WORDS, WORDS
from tests import ROOT

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>'"
    " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_tiny_policy_is_a_real_architecture(policy):
    model, tok = policy
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    ids = encode_first_turn(tok, "you are at row 0 col 0")
    assert tok.unk_token_id not in ids
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_turn_encoding_closes_unfinished_response():
    tok = build_tokenizer()
    guess = tok.convert_tokens_to_ids("4")
    open_ids = encode_next_turn(tok, "higher", [guess])
    closed_ids = encode_next_turn(tok, "higher", [guess, tok.eos_token_id])
    assert open_ids[0] == tok.eos_token_id and open_ids[1:] == closed_ids
    assert tok.decode(closed_ids) == "<|user|> higher <|assistant|>"


def test_hf_checkpoint_round_trip_with_chat_template(tmp_path):
    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128)
    torch.manual_seed(0)
    src = LlamaForCausalLM(cfg).eval()
    save_policy(src, tok, tmp_path / "ckpt")
    model, loaded_tok = load_policy(PolicySpec(path=str(tmp_path / "ckpt"), device="cpu"))
    assert model.config.model_type == "llama" and loaded_tok.chat_template
    ids = encode_first_turn(loaded_tok, "guess number between 1 and 8")
    assert ids == encode_first_turn(tok, "guess number between 1 and 8")
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, src(x).logits)


def test_checkpoint_without_template_uses_plain_text(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = None
    ids = encode_first_turn(tok, "you are at row 1 col 2")
    assert tok.decode(ids) == "you are at row 1 col 2"
    nxt = encode_next_turn(tok, "higher", [tok.convert_tokens_to_ids("4"), tok.eos_token_id])
    assert tok.decode(nxt) == "higher"


def test_policy_does_not_import_the_environments():
    code = ("import sys, tasks.policy; tasks.policy.build_tokenizer(); "
            "assert not [m for m in sys.modules if m.startswith('tasks.envs')], sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_tiny_template_ends_an_assistant_message_with_its_end_token():
    tok = build_tokenizer()
    assert assistant_suffix(tok) == [tok.convert_tokens_to_ids("<|end|>")]


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory):
    """A byte-level BPE tokenizer with ChatML special tokens and template, eos <|endoftext|> (as a
    base Qwen), saved with a tiny random Qwen2; then loaded back as the trainer would."""
    path = tmp_path_factory.mktemp("qwen")
    rng = random.Random(0)
    words = WORDS + ENV_WORDS
    sentences = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(300)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    save_policy(Qwen2ForCausalLM(cfg).eval(), tok, path)
    return load_policy(PolicySpec(path=str(path)))


def test_chatml_turns_match_the_rendered_conversation(qwen_style):
    model, tok = qwen_style
    assert model.config.model_type == "qwen2"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    newline = tok.encode("\n", add_special_tokens=False)
    assert {im_end, tok.eos_token_id} <= set(stop_token_ids(tok))
    assert assistant_suffix(tok) == [im_end, *newline]
    system = "reply with one word"
    observations = ["guess number between 1 and 8", "higher", "lower"]
    responses = ["4", "the answer is 6"]
    msgs = [{"role": "system", "content": system}]
    for obs, resp in zip(observations, responses + [None], strict=True):
        msgs.append({"role": "user", "content": obs})
        if resp is not None:
            msgs.append({"role": "assistant", "content": resp})
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    ids = encode_first_turn(tok, observations[0], system)
    for resp, obs in zip(responses, observations[1:], strict=True):
        sampled = tok.encode(resp, add_special_tokens=False) + [im_end]  # stopped on <|im_end|>
        ids += sampled + encode_next_turn(tok, obs, sampled)
    assert ids == rendered, (tok.decode(ids), tok.decode(rendered))


def test_chatml_unfinished_response_is_closed_by_the_template_end(qwen_style):
    _, tok = qwen_style
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    response = tok.encode("move left", add_special_tokens=False)
    closed = encode_next_turn(tok, "higher", response + [im_end])
    unfinished = encode_next_turn(tok, "higher", response)
    assert unfinished == [im_end] + closed
    assert closed[0] == tok.encode("\n", add_special_tokens=False)[0]
    assert tok.eos_token_id not in unfinished
    assert tok.decode(unfinished) == "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n" \
        "<|im_start|>assistant\n"


def test_device_and_dtype_auto_resolve_on_the_loading_machine():
    spec = load_config(None, []).policy
    assert (spec.device, spec.dtype) == ("auto", "auto")
    if torch.cuda.is_available():
        assert torch_device(spec).type == "cuda"
    else:  # float32 on the CPU: the weights and the tokens of a CPU run stay as they were
        assert torch_device(spec) == torch.device("cpu") and torch_dtype(spec) == torch.float32
        model, _ = load_policy(spec)
        assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.float32)}
    spec = load_config(None, ["policy.device=cpu", "policy.dtype=bfloat16"]).policy
    assert torch_device(spec) == torch.device("cpu") and torch_dtype(spec) == torch.bfloat16


@pytest.mark.parametrize("override,key", [("policy.device=gpu", "policy.device"),
                                          ("policy.device=cuda:x", "policy.device"),
                                          ("policy.dtype=fp8", "policy.dtype")])
def test_a_bad_device_or_dtype_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: must be one of"):
        load_config(None, [override])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="policy.device is 'cuda:1' but torch sees no CUDA"):
        load_policy(PolicySpec(device="cuda:1"))


def test_a_bfloat16_policy_is_the_float32_one_rounded():
    full, _ = load_policy(PolicySpec(device="cpu"))
    half, _ = load_policy(PolicySpec(device="cpu", dtype="bfloat16"))
    master, _ = load_policy(PolicySpec(device="cpu", dtype="bfloat16"), dtype=torch.float32)
    for (name, f), h, m in zip(full.named_parameters(), half.parameters(), master.parameters(),
                               strict=True):
        assert h.dtype == torch.bfloat16 and m.dtype == torch.float32, name
        assert torch.equal(h, f.to(torch.bfloat16)) and torch.equal(m, f), name


def test_a_turn_encoded_again_is_the_same_fresh_list_and_follows_a_changed_template(qwen_style):
    _, tok = qwen_style
    first = encode_next_turn(tok, "higher", [])
    first.append(-1)  # a caller's list is its own: the next encoding is untouched
    assert encode_next_turn(tok, "higher", []) == first[:-1]
    start = encode_first_turn(tok, "guess", "sys")
    start.clear()
    assert encode_first_turn(tok, "guess", "sys")
    template = tok.chat_template
    try:  # the same tokenizer with another template renders anew
        tok.chat_template = template.replace("m['role']", "(m['role'] | upper)")
        assert "USER" in tok.decode(encode_next_turn(tok, "higher", []))
    finally:
        tok.chat_template = template
    assert encode_next_turn(tok, "higher", []) == first[:-1]
