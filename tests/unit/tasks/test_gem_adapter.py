"""GEM environments behind the TextEnv Protocol (tasks.envs.gem_adapter), on offline GEM games."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest

gem = pytest.importorskip("gem", reason="extra 'gem' not installed: pip install -e '.[gem]'")
if not callable(getattr(gem, "make", None)):
    pytest.skip("the installed 'gem' is not gem-llm: pip install -e '.[gem]'",
                allow_module_level=True)

from tasks.envs.base import TextEnv  # noqa: E402
from tasks.envs.gem_adapter import GemEnv  # noqa: E402
from tasks.tiny_tokenizer import build_tokenizer, spell  # noqa: E402

HARD = "game:GuessTheNumber-v0-hard"  # 1..50 in 7 turns: binary search always wins
EASY = "game:GuessTheNumber-v0-easy"  # 1..10 in 4 turns
GAME2048 = "game:Game2048-v0-easy"
FORMAT_PENALTY = -0.1  # gem.utils.constants.LanguageGameReward.format_error_reward

_RANGE_RE = re.compile(r"between\s+(-?\d+)\s+and\s+(-?\d+)", re.IGNORECASE)
_HINT_RE = re.compile(r"\b(higher|lower)\s+than\s+(-?\d+)", re.IGNORECASE)
_WIN_RE = re.compile(r"correct number\s+(-?\d+)", re.IGNORECASE)


def boxed(n: int) -> str:
    return f"I will guess \\boxed{{{n}}}."


def play_binary_search(env: GemEnv, seed: int):
    """Play one episode by bisecting the range GEM states, narrowed by its higher/lower hints.
    Returns the transcript of (action, step result) and the last step."""
    obs, _ = env.reset(seed=seed)
    m = _RANGE_RE.search(obs)
    assert m, obs
    low, high = int(m.group(1)), int(m.group(2))
    transcript = []
    for _ in range(env.max_turns):
        guess = (low + high) // 2
        result = env.step(boxed(guess))
        transcript.append((guess, result))
        obs, _, terminated, truncated, _ = result
        if terminated or truncated:
            break
        hint = _HINT_RE.search(obs)
        assert hint and int(hint.group(2)) == guess, obs
        if hint.group(1).lower() == "higher":
            low = guess + 1
        else:
            high = guess - 1
    return transcript, transcript[-1][1]


def secret_of(seed: int, env_id: str = HARD) -> int:
    """The number GEM draws for this seed, learnt by winning an episode."""
    _, (obs, *_) = play_binary_search(GemEnv(env_id), seed)
    m = _WIN_RE.search(obs)
    assert m, obs
    return int(m.group(1))


def test_follows_protocol_with_gem_defaults():
    env = GemEnv(HARD)
    assert isinstance(env, TextEnv)
    assert env.max_turns == 7  # GEM's own limit for the hard level
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and "Guess The Number" in obs
    assert obs.rstrip().endswith("Enter your next guess.")  # GEM's per-turn suffix is appended
    assert info["success"] is False and info["format_errors"] == 0 and info["turns"] == 0
    assert info["format_error"] is False
    assert info["gem"] == {"suffix": "Enter your next guess."}
    assert GemEnv(HARD, max_turns=3).max_turns == 3
    assert GemEnv(HARD, include_suffix=False).reset(seed=0)[0].rstrip().endswith("the game.")


def test_reset_is_deterministic_per_seed():
    a, b = GemEnv(HARD), GemEnv(HARD)
    assert a.reset(seed=11) == b.reset(seed=11)
    assert play_binary_search(a, 11)[0] == play_binary_search(b, 11)[0]
    secrets = {secret_of(seed) for seed in range(8)}
    assert len(secrets) > 1  # the seed draws the number
    assert secret_of(5) == secret_of(5)


def test_interleaved_instances_match_solo_runs():
    """2048 draws each new tile from the global RNG: other instances and other code drawing from
    it between steps must not change an episode."""
    moves = [f"\\boxed{{{m}}}" for m in ("up", "left", "down", "right") * 4]

    def run(envs_and_seeds, meddle):
        transcripts = []
        for env, seed in envs_and_seeds:
            transcripts.append([env.reset(seed=seed)])
        for move in moves:
            for env, transcript in zip((e for e, _ in envs_and_seeds), transcripts, strict=True):
                if meddle:
                    random.random()
                transcript.append(env.step(move))
        return transcripts

    solo = [run([(GemEnv(GAME2048), seed)], meddle=False)[0] for seed in (1, 2)]
    together = run([(GemEnv(GAME2048), 1), (GemEnv(GAME2048), 2)], meddle=True)
    assert together == solo
    assert solo[0][1:] != solo[1][1:]


def test_reset_leaves_the_callers_random_state_alone():
    np = pytest.importorskip("numpy")
    random.seed(123)
    np.random.seed(123)
    expected = (random.random(), np.random.random())
    random.seed(123)
    np.random.seed(123)
    env = GemEnv(HARD)
    env.reset(seed=7)
    env.step(boxed(25))
    assert (random.random(), np.random.random()) == expected


@pytest.mark.parametrize("action", [
    "", "25", "no box here", "\\boxed{}", "\\boxed{twenty}", "\\boxed{-3}", "\\boxed{25",
    "x" * 100_000, "\\boxed{" * 1000, "\x00\ud800\n<unk>", "\\boxed{0}",
])
def test_malformed_action_is_a_counted_format_error(action):
    env = GemEnv(HARD)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(action)
    assert isinstance(obs, str)
    # GEM ends a game on a reply it cannot parse, with its format penalty
    assert reward == pytest.approx(FORMAT_PENALTY)
    assert terminated and not truncated
    assert info["format_error"] is True and info["format_errors"] == 1
    assert info["success"] is False and info["turns"] == 1
    json.dumps(info)


def test_non_string_and_post_episode_actions_never_raise():
    env = GemEnv(HARD)
    obs, _, terminated, _, info = env.step(boxed(25))  # before any reset
    assert terminated and "reset" in obs and info["turns"] == 0
    env.reset(seed=0)
    _, _, terminated, _, info = env.step(None)  # type: ignore[arg-type]
    assert terminated and info["format_error"]
    obs, reward, terminated, truncated, info = env.step(boxed(25))  # after the episode ended
    assert terminated and not truncated and reward == 0.0 and "reset" in obs
    assert info["format_error"] is False and info["success"] is False


def test_illegal_but_parsable_move_is_not_a_format_error():
    env = GemEnv(HARD)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(boxed(99))
    assert "outside the range" in obs
    assert reward == 0.0 and not terminated and not truncated
    assert info["format_error"] is False and info["format_errors"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 2**40, -5])
def test_binary_search_wins(seed):
    env = GemEnv(HARD)
    transcript, (obs, reward, terminated, truncated, info) = play_binary_search(env, seed)
    assert terminated and not truncated
    assert info["success"] is True and reward == 1.0 and "Congratulations" in obs
    assert info["format_errors"] == 0 and info["turns"] == len(transcript) <= env.max_turns
    assert all(not step[1][4]["success"] for step in transcript[:-1])
    json.dumps(info)


def test_our_max_turns_truncates():
    env = GemEnv(HARD, max_turns=2)
    env.reset(seed=0)
    _, _, terminated, truncated, info = env.step(boxed(99))
    assert not terminated and not truncated and info["turns"] == 1
    obs, _, terminated, truncated, info = env.step(boxed(98))
    assert truncated and not terminated
    assert info["success"] is False and info["turns"] == 2 and info["format_errors"] == 0
    assert not obs.endswith("Enter your next guess.")  # no per-turn suffix once it has ended
    assert env.step(boxed(1))[2] is True  # ended: no further GEM step


def test_gem_turn_limit_is_a_truncation_and_cannot_be_extended():
    env = GemEnv(EASY, max_turns=10)
    assert env.max_turns == 10
    env.reset(seed=0)
    results = [env.step(boxed(11 + i)) for i in range(4)]  # out of range: the game goes on
    assert all(not (r[2] or r[3]) for r in results[:3])
    obs, _, terminated, truncated, info = results[3]
    assert "maximum number of turns" in obs
    assert truncated and not terminated and info["success"] is False and info["turns"] == 4


def test_success_reward_threshold_counts_partial_credit():
    seed = 2
    secret = secret_of(seed, EASY)
    near = secret + 1 if secret < 10 else secret - 1
    outcomes = {}
    for threshold in (None, 0.5):
        env = GemEnv(EASY, success_reward=threshold)
        env.reset(seed=seed)
        for i in range(3):
            env.step(boxed(11 + i))
        outcomes[threshold] = env.step(boxed(near))  # GEM's last turn: partial credit
    _, reward, terminated, truncated, info = outcomes[None]
    assert 0.5 < reward < 1.0
    assert info["success"] is False and truncated and not terminated
    _, reward2, terminated, truncated, info = outcomes[0.5]
    assert reward2 == reward and info["success"] is True and terminated and not truncated


def test_single_turn_reasoning_gym_task():
    env = GemEnv("rg:basic_arithmetic")
    obs, _ = env.reset(seed=1)
    assert isinstance(obs, str) and obs
    answer = env.gem_env.data["answer"]
    _, reward, terminated, truncated, info = env.step(f"The answer is \\boxed{{{answer}}}")
    assert terminated and not truncated and reward == 1.0 and info["success"] is True
    env.reset(seed=1)
    _, reward, terminated, truncated, info = env.step("\\boxed{not a number}")
    assert terminated and not truncated and info["success"] is False and reward < 1.0


def test_tiny_policy_can_read_and_write_a_gem_game():
    """The tiny tokenizer reads GEM's observations and can spell its answer format."""
    tok = build_tokenizer()
    env = GemEnv(EASY)
    obs, _ = env.reset(seed=0)
    assert tok.unk_token_id not in tok.encode(obs, add_special_tokens=False)
    sampled = spell(tok, "\\boxed{5}") + [tok.eos_token_id]  # a response stopped on <|end|>
    action = tok.decode(sampled[:-1], skip_special_tokens=True)  # as generation decodes it
    assert action == "\\boxed{5}"
    obs, reward, terminated, truncated, info = env.step(action)
    assert info["format_error"] is False and info["format_errors"] == 0 and info["turns"] == 1
    assert reward != pytest.approx(FORMAT_PENALTY)
    assert tok.unk_token_id not in tok.encode(obs, add_special_tokens=False)


class _OddGemEnv(gem.Env):
    """A GEM env with non-string observations, non-JSON info, an explicit flag and a crash."""

    max_turns = 5

    def __init__(self, **_):
        super().__init__()
        self.closed = 0

    def reset(self, seed=None):
        super().reset(seed)
        return ["not", "a", "string"], {"suffix": "go", "blob": object()}

    def step(self, action):
        if "crash" in action:
            raise KeyError("boom")
        won = "win" in action
        return 42, 0.0, won, False, {"correct": won, "n": 1, "bad": {1, 2}}

    def close(self):
        self.closed += 1


def _odd_env() -> GemEnv:
    from gem.envs.registration import ENV_REGISTRY

    if "test:Odd-v0" not in ENV_REGISTRY:
        gem.register("test:Odd-v0", _OddGemEnv)
    return GemEnv("test:Odd-v0")


def test_odd_gem_outputs_are_normalised():
    env = _odd_env()
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and obs.endswith("go") and info["gem"] == {"suffix": "go"}
    obs, reward, terminated, truncated, info = env.step("hello")
    assert obs == "42" and reward == 0.0 and not terminated and not truncated
    assert info["gem"] == {"correct": False, "n": 1} and info["success"] is False
    json.dumps(info)
    _, _, terminated, _, info = env.step("win")  # GEM's explicit flag decides success
    assert terminated and info["success"] is True


def test_gem_env_raising_is_a_format_error_and_close_is_idempotent():
    env = _odd_env()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("please crash")
    assert "could not process" in obs and reward == pytest.approx(FORMAT_PENALTY)
    assert terminated and not truncated and info["format_error"] and info["format_errors"] == 1
    env.close()
    env.close()
    assert env.gem_env.closed == 1


def test_missing_gem_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gem", None)  # makes `import gem` raise ImportError
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[gem\]\""):
        GemEnv(HARD)
