"""The tiny policy's tokenizer: whole words for fast learning, characters for everything else.

Every word of the built-in environments is one token, so a policy trained from scratch learns their
tasks quickly; every printable ASCII character is a token too, plain and as a ``##`` continuation,
so any other environment's text is read without ``<unk>`` and any answer format (``\\boxed{5}``)
can be written (:func:`spell`). Ids only ever grow at the end: a token keeps its id, and text the
earlier word-level vocabulary could read is tokenized exactly as before. Environments added
later bring their words as an opt-in word set (:data:`WORD_SETS`, ``policy.word_sets``).

The environments' words are listed here rather than imported, so the policy depends on no
environment; tests check that each environment's ``VOCAB`` stays covered.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

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

# The words of tasks.envs.word_answer, sokoban and tool_use (their VOCAB, in that order).
WORD_ANSWER_WORDS = (
    "what color is sky grass snow animal barks says meow frozen water shines day opposite of "
    "hot blue green white dog cat ice sun cold apple fruit red puppy kitten yellow black night "
    "moon warm fish bird tree banana"
).split()
SOKOBAN_WORDS = (
    "sokoban : push every box B onto a target T . move left down right up "
    "moved blocked invalid action solved W F P X Q /"
).split()
TOOL_USE_WORDS = (
    "tool use answer the question call calculator with calc then reply as "
    "what is plus minus times divided by "
    "result error invalid action correct wrong "
    "division zero expression too long many tokens deep number large unknown symbol bad"
).split()
ENV_WORDS = [*WORD_ANSWER_WORDS, *SOKOBAN_WORDS, *TOOL_USE_WORDS]

PREFIX = "##"  # marks a piece that continues the previous one without a space
# Printable ASCII plus tab and newline: with the continuation forms, any such text can be written.
CHARACTERS = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n"]
# Whole words added from now on (a new environment's) go in a word set, after the characters: no
# id moves. A set is opt-in (policy.word_sets), so adding one leaves every other config's
# vocabulary, and with it its tiny policy's initialisation and sampling, exactly as it was.
WORD_SETS: dict[str, tuple[str, ...]] = {
    # tasks.envs.hc_pinn's words (its VOCAB less the words above)
    "hc_pinn": tuple((
        "hc pinn problem propose boundary function family power families erank cond top modes "
        "best common healthy collapsed poly sine dist rfun exp tanh poisson1d poisson2d heat1d"
    ).split()),
}
# Longer runs of word characters are cut into pieces of this size before the (greedy, cubic in
# the length) character fallback, so no word is too long to read.
MAX_PIECE_CHARS = 64

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}<|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def check_word_sets(word_sets: Sequence[str]) -> None:
    """Raises ValueError naming any word set that :data:`WORD_SETS` lacks."""
    unknown = [w for w in word_sets if w not in WORD_SETS]
    if unknown:
        raise ValueError(f"unknown word sets {unknown}; known: {sorted(WORD_SETS)}")


def vocabulary(word_sets: Sequence[str] = ()) -> dict[str, int]:
    """Token -> id in the order the tokens were introduced, so every id stays as it was: the
    word-level vocabulary, the characters, their continuation forms, then the words of
    ``word_sets`` (names in :data:`WORD_SETS`), in the order given."""
    check_word_sets(word_sets)
    vocab: dict[str, int] = {}
    for tok in (SPECIAL_TOKENS + WORDS + NUMBERS + ENV_WORDS + CHARACTERS
                + [PREFIX + c for c in CHARACTERS]
                + [w for name in word_sets for w in WORD_SETS[name]]):
        vocab.setdefault(tok, len(vocab))
    return vocab


def build_tokenizer(word_sets: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """The shipped tokenizer (see module docstring) with a compact chat template, plus the
    whole words of ``word_sets``."""
    # transformers is imported here, not above: the word sets are checked when a config is
    # loaded, which must not pay for importing transformers and torch
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(vocab=vocabulary(word_sets), unk_token="<unk>",
                                     continuing_subword_prefix=PREFIX,
                                     max_input_chars_per_word=MAX_PIECE_CHARS))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Whitespace(),
        pre_tokenizers.Split(Regex(f".{{1,{MAX_PIECE_CHARS}}}"), behavior="isolated"),
    ])
    # Pieces are joined by one space unless they continue the previous one, as the word-level
    # tokenizer decoded; no clean-up, so " ." stays as written.
    tok.decoder = decoders.WordPiece(prefix=PREFIX, cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>",
        additional_special_tokens=SPECIAL_TOKENS[2:], clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


_GAP_AND_WORD = re.compile(r"(\s*)(\S*)")


def spell(tokenizer, text: str) -> list[int]:
    """Token ids that decode (``skip_special_tokens=True``) to exactly ``text``: whole-word tokens
    where they fit, characters elsewhere. A decoder puts one space before each piece but the first,
    except before a continuation piece; so a word after a space starts with a plain piece and
    everything else is written as continuations (e.g. an answer in an environment's format)."""
    vocab = tokenizer.get_vocab()
    banned = set(tokenizer.all_special_tokens)
    longest = max(map(len, vocab))
    ids: list[int] = []

    def write(s: str, plain: bool) -> None:
        start = 0
        while start < len(s):
            for end in range(min(len(s), start + longest), start, -1):
                piece = s[start:end] if plain and start == 0 else PREFIX + s[start:end]
                if piece in vocab and piece not in banned and \
                        not (plain and start == 0 and piece.startswith(PREFIX)):
                    break
            else:
                raise ValueError(f"the tokenizer cannot write {s[start]!r}")
            ids.append(vocab[piece])
            start = end

    for gap, word in _GAP_AND_WORD.findall(text):
        if ids and gap.endswith(" ") and word:
            write(gap[:-1], plain=False)  # the decoder's space before a plain piece ends the gap
            write(word, plain=True)
        else:
            write(gap + word, plain=not ids)  # the first piece is written as it is
    return ids
