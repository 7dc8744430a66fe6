"""Policy loading: the tiny default, and any Hugging Face causal-LM directory with its template."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.policy import (
    PolicySpec,
    build_tokenizer,
    encode_first_turn,
    encode_next_turn,
    load_policy,
    save_policy,
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
    open_ids = encode_next_turn(tok, "higher", response_stopped=False)
    closed_ids = encode_next_turn(tok, "higher", response_stopped=True)
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
    model, loaded_tok = load_policy(PolicySpec(path=str(tmp_path / "ckpt")))
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
    nxt = encode_next_turn(tok, "higher", response_stopped=True)
    assert tok.decode(nxt) == "higher"
