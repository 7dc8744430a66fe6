"""The tiny policy's tokenizer: earlier ids and tokenizations kept, any ASCII text read and written."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from tasks.envs import hc_pinn, sokoban, tool_use, word_answer
from tasks.envs.frozenlake import FrozenLakeText
from tasks.envs.guess_number import GuessNumber
from tasks.envs.sokoban import Sokoban
from tasks.envs.tool_use import ToolUse
from tasks.envs.word_answer import WordAnswer
from tasks.policy import encode_first_turn
from tasks.tiny_tokenizer import (
    CHARACTERS,
    NUMBERS,
    SPECIAL_TOKENS,
    WORD_SETS,
    WORDS,
    build_tokenizer,
    spell,
)

ASCII = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def word_level_vocab() -> dict[str, int]:
    """The vocabulary of the word-level tokenizer this one extends, by its construction rule."""
    vocab: dict[str, int] = {}
    for t in SPECIAL_TOKENS + WORDS + NUMBERS + [*word_answer.VOCAB, *sokoban.VOCAB,
                                                 *tool_use.VOCAB]:
        vocab.setdefault(t, len(vocab))
    return vocab


def word_level_tokenizer() -> Tokenizer:
    old = Tokenizer(models.WordLevel(vocab=word_level_vocab(), unk_token="<unk>"))
    old.pre_tokenizer = pre_tokenizers.Whitespace()
    return old


def test_earlier_ids_are_unchanged_and_new_tokens_come_after(tok):
    old = word_level_vocab()
    vocab = tok.get_vocab()
    by_id = sorted(vocab, key=vocab.get)
    assert len(old) == 181 and by_id[:181] == list(old)
    assert [vocab[w] for w in ("<pad>", "<|end|>", "you", "?", "0", "32", "what", "sokoban", "bad")] \
        == [0, 5, 6, 72, 73, 105, 106, 142, 180]
    assert by_id[181:] == [c for c in CHARACTERS if c not in old] + ["##" + c for c in CHARACTERS]
    assert len(tok) == len(vocab) and tok.eos_token == "<|end|>" and tok.pad_token_id == 0


def test_a_word_set_adds_whole_words_after_every_earlier_id(tok):
    with_set = build_tokenizer(["hc_pinn"]).get_vocab()
    vocab = tok.get_vocab()
    assert {w: i for w, i in with_set.items() if w in vocab} == vocab
    added = sorted((w for w in with_set if w not in vocab), key=with_set.get)
    assert added == [w for w in WORD_SETS["hc_pinn"] if w not in vocab]
    assert [with_set[w] for w in added] == list(range(len(vocab), len(with_set)))
    with pytest.raises(ValueError, match="unknown word sets"):
        build_tokenizer(["no_such_set"])


@pytest.mark.parametrize("module", [word_answer, sokoban, tool_use, hc_pinn])
def test_every_environment_word_is_a_whole_word_token(tok, module):
    if module is hc_pinn:  # its words are an opt-in set (policy.word_sets)
        tok = build_tokenizer(["hc_pinn"])
    vocab = tok.get_vocab()
    words = [*module.VOCAB, *getattr(module, "PUNCTUATION", ())]
    for w in words:
        assert tok.encode(w, add_special_tokens=False) == [vocab[w]], w


def _builtin_observations():
    rng = random.Random(0)
    envs = [FrozenLakeText(observation=o) for o in ("position", "cell", "grid")]
    envs += [FrozenLakeText(map_name="random", observation="grid", size=6), GuessNumber(),
             GuessNumber(low=1, high=32), Sokoban(boxes=2, width=7, height=6), WordAnswer(),
             ToolUse(ops=("plus", "minus", "times", "divided by"))]
    envs += [FrozenLakeText(action_format="tagged"), GuessNumber(action_format="tagged"),
             Sokoban(action_format="tagged"), WordAnswer(answer_style="tagged"),
             ToolUse(action_format="tagged")]
    actions = ["left", "down", "right", "up", "4", "7", "calc 3 plus 4", "calc 9 times 9",
               "calc 1 / 0", "answer 7", "dog", "nonsense", "<answer>left</answer>",
               "<answer>4</answer>", "<tool>calc(3+4)</tool>", ""]
    for env in envs:
        for seed in range(6):
            obs, _ = env.reset(seed=seed)
            yield obs
            for _ in range(env.max_turns):
                obs, _, terminated, truncated, _ = env.step(rng.choice(actions))
                yield obs
                if terminated or truncated:
                    break


def test_builtin_environment_text_is_tokenized_as_before(tok):
    """Text the word-level tokenizer read without <unk> gets the same ids and decodes the same;
    what it could not read (tags, numbers above 32) now reads without <unk>."""
    old = word_level_tokenizer()
    compared = 0
    for obs in _builtin_observations():
        ids = tok.encode(obs, add_special_tokens=False)
        assert tok.unk_token_id not in ids, obs
        before = old.encode(obs).ids
        if tok.unk_token_id not in before:
            compared += 1
            assert ids == before, obs
            assert tok.decode(ids) == old.decode(before)
            first = encode_first_turn(tok, obs)
            assert first[1:-1] == before and tok.decode(first) == f"<|user|> {obs} <|assistant|>"
    assert compared > 100


def _random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 8)):
        parts.append("".join(rng.choices(ASCII, k=rng.randint(0, 12))))
        parts.append(rng.choice([" ", " ", "  ", "\n", "", "\t "]))
    return "".join(parts)


def test_any_ascii_text_reads_without_unk_and_can_be_written(tok):
    rng = random.Random(0)
    texts = [_random_text(rng) for _ in range(500)]
    texts += ["\\boxed{5}", "I will guess \\boxed{5}.", "<answer>left</answer>", " lead",
              "trail \n", "##a", "<|end|>", "x" * 300, "".join(ASCII), "a" + "!?" * 100]
    for text in texts:
        assert tok.unk_token_id not in tok.encode(text, add_special_tokens=False), text
        ids = spell(tok, text)
        assert tok.decode(ids, skip_special_tokens=True) == text
        # as generation decodes a response that stopped on the end token
        assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_spelling_prefers_whole_words(tok):
    text = "you are at row 1 col 2 ."
    assert spell(tok, text) == tok.encode(text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(spell(tok, "guess \\boxed{5}")) == \
        ["guess", "\\", "##b", "##o", "##x", "##e", "##d", "##{", "##5", "##}"]


def test_checkpoint_round_trip_keeps_reading_and_writing(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Guess The Number: I will guess \\boxed{5}.\n  ok"
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(spell(tok, text), skip_special_tokens=True) == text
    assert loaded.chat_template == tok.chat_template
