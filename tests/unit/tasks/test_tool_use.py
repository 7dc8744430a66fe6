"""Tool-use environment: the calculator's parser and bounds, action parsing in both formats,
episodes, truncation, the observation vocabulary, and the rule-based verifier."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from tasks.envs.base import TextEnv
from tasks.envs.tool_use import (
    EVAL_SEED_OFFSET,
    PUNCTUATION,
    TAGGED_HINT,
    VOCAB,
    CalculatorError,
    ToolUse,
    calculate,
    eval_seed,
    parse_action,
    verify,
)

_QUESTION_RE = re.compile(r"what is (\d+) (plus|minus|times|divided by) (\d+) \?")
_NUMBER_RE = re.compile(r"^-?\d+(\.\d+)?$")


def _question_expr(question: str) -> str:
    m = _QUESTION_RE.search(question)
    assert m, question
    return f"{m.group(1)} {m.group(2)} {m.group(3)}"


def test_follows_protocol_and_reset_is_deterministic():
    env = ToolUse()
    assert isinstance(env, TextEnv) and env.max_turns == 4
    assert env.reset(seed=3) == ToolUse().reset(seed=3)
    obs, info = env.reset(seed=7)
    assert obs.startswith("tool use : answer the question . call the calculator with calc")
    assert info["success"] is False and obs.endswith(info["question"])
    questions = {ToolUse().reset(seed=s)[1]["question"] for s in range(50)}
    assert len(questions) > 10  # seeds do vary the question


def test_eval_seeds_are_held_out():
    assert eval_seed(0) == EVAL_SEED_OFFSET == 10**9 and eval_seed(5) == 10**9 + 5


def test_questions_stay_in_range_and_answers_match():
    env = ToolUse(max_operand=10, ops=("plus", "minus", "times", "divided by"))
    for seed in range(300):
        _, info = env.reset(seed=seed)
        a, op, b = _QUESTION_RE.search(info["question"]).groups()
        assert 0 <= int(a) <= 10 and 0 <= int(b) <= 10
        _, _, _, _, step_info = env.step("answer 0")
        assert step_info["answer"] == calculate(f"{a} {op} {b}") >= 0


@pytest.mark.parametrize("expr,expected", [
    ("17 * 23", 391), ("17 times 23", 391), ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20),
    ("10 - 4 - 3", 3), ("-3 + 5", 2), ("-(2 + 3)", -5), ("2 * -3", -6), ("- - 4", 4),
    ("8 / 2", 4), ("7 / 2", 3.5), ("1.5 * 2", 3), ("0.1 + 0.2", 0.3), ("7 divided by 2", 3.5),
    ("3 plus 4 times 2", 11), ("9 minus 2 minus 1", 6), ("7 Divided  By 7", 1),
    ("((1 + 2) * (3 + 4))", 21), ("1000000 * 1000000", 10**12), ("  5  ", 5),
])
def test_calculator_is_correct(expr, expected):
    value = calculate(expr)
    assert value == pytest.approx(expected)
    assert isinstance(value, int) == isinstance(expected, int)  # whole results print as integers


@pytest.mark.parametrize("expr,reason", [
    ("__import__('os')", "unknown symbol"), ("2**100", "bad expression"),
    ("1/0", "division by zero"), ("5 / (2 - 2)", "division by zero"), ("x + 1", "unknown symbol"),
    ("abs(3)", "unknown symbol"), ("pi", "unknown symbol"), ("1e3", "unknown symbol"),
    ("1" + " + 1" * 8, "too many tokens"), ("1 +" + " " * 70 + "1", "expression too long"),
    ("((((1))))", "too deep"), ("1000001 + 1", "number too large"),
    ("1000000 * 1000000 * 2", "result too large"), ("", "bad expression"),
    ("   ", "bad expression"), ("1 +", "bad expression"), ("(1 + 2", "bad expression"),
    ("1 2", "bad expression"), ("()", "bad expression"), ("3 plus", "bad expression"),
    ("3 plusplus 4", "unknown symbol"),
])
def test_calculator_rejects(expr, reason):
    with pytest.raises(CalculatorError) as err:
        calculate(expr)
    assert isinstance(err.value, ValueError) and err.value.reason == reason and str(err.value)


def test_calculator_depth_three_is_allowed():
    assert calculate("(((1 + 2)))") == 3


@pytest.mark.parametrize("text,expected", [
    ("calc 17 * 23", ("calc", "17 * 23")), ("calc 17 times 23", ("calc", "17 times 23")),
    ("  Calc 1 + 2 ", ("calc", "1 + 2")), ("answer 391", ("answer", "391")),
    ("answer  391.0 ", ("answer", "391.0")), ("answer -4", ("answer", "-4")),
    ("calc banana", ("calc", "banana")),  # a legal call; the calculator reports the error
    ("", None), ("   ", None), ("calc", None), ("answer", None), ("answer banana", None),
    ("answer 3 4", None), ("please answer 3", None), ("calculate 3", None), ("answers 3", None),
    ("<answer>391</answer>", None), ("answer " + "1" * 300, None), ("calc " + "1" * 260, None),
])
def test_parse_compact(text, expected):
    assert parse_action(text, "compact") == expected


@pytest.mark.parametrize("text,expected", [
    ("<tool>calc(17*23)</tool>", ("calc", "17*23")),
    ("let me compute <tool>calc((1+2)*3)</tool> first", ("calc", "(1+2)*3")),
    ("<answer>391</answer>", ("answer", "391")), ("so <answer> 391 </answer>.", ("answer", "391")),
    ("<tool>calc(1+2)</tool> then <answer>3</answer>", ("calc", "1+2")),
    ("<answer>3</answer> or <tool>calc(1+2)</tool>", ("answer", "3")),
    ("<TOOL>calc(2)</TOOL>", ("calc", "2")),
    ("", None), ("391", None), ("answer 391", None), ("calc 1+2", None),
    ("<answer>banana</answer>", None), ("<answer></answer>", None), ("<tool>calc()</tool>", None),
    ("<tool>calc(1+2</tool>", None), ("<tool>search(x)</tool>", None),
    ("<answer>" + "1" * 250 + "</answer>", None),
])
def test_parse_tagged(text, expected):
    assert parse_action(text, "tagged") == expected


@pytest.mark.parametrize("action_format,call,answer", [
    ("compact", "calc {expr}", "answer {value}"),
    ("tagged", "<tool>calc({expr})</tool>", "thus <answer>{value}</answer>"),
])
def test_full_episode_succeeds(action_format, call, answer):
    env = ToolUse(action_format=action_format, tool_cost=0.05)
    for seed in range(20):
        _, info = env.reset(seed=seed)
        obs, r, term, trunc, info = env.step(call.format(expr=_question_expr(info["question"])))
        assert obs.startswith("tool result : ") and r == -0.05 and not term and not trunc
        result = obs.split(":")[1].strip()
        assert float(result) == info["answer"] and info["tool_calls"] == 1
        obs, r, term, trunc, info = env.step(answer.format(value=result))
        assert term and not trunc and r == 1.0 and info["success"] and obs == "correct"
        assert info["turns"] == 2 and info["format_errors"] == 0 and info["question"]


@pytest.mark.parametrize("value", ["{a}", "{a}.0", " {a} ", "{a}.000"])
def test_answers_compare_numerically(value):
    env = ToolUse()
    env.reset(seed=11)
    _, _, _, _, info = env.step("calc 0")
    _, r, term, _, info = env.step("answer " + value.format(a=info["answer"]))
    assert term and r == 1.0 and info["success"]


def test_wrong_answer_ends_with_zero():
    env = ToolUse()
    _, info = env.reset(seed=2)
    _, _, _, _, info = env.step("calc 1")
    obs, r, term, trunc, info = env.step(f"answer {info['answer'] + 1}")
    assert term and not trunc and r == 0.0 and not info["success"] and obs == "wrong answer"


def test_tool_errors_are_legal_turns():
    env = ToolUse(format_penalty=0.3, tool_cost=0.01)
    env.reset(seed=0)
    for expr, reason in [("1 / 0", "division by zero"), ("__import__('os')", "unknown symbol"),
                         ("2 ** 100", "bad expression")]:
        obs, r, term, trunc, info = env.step(f"calc {expr}")
        assert obs == f"tool error : {reason}" and r == -0.01 and not term and not trunc
        assert not info["format_error"] and info["format_errors"] == 0
    assert info["tool_calls"] == 3


def test_malformed_reply_is_format_error_and_truncation_at_max_turns():
    env = ToolUse(max_turns=3, format_penalty=0.25)
    _, info0 = env.reset(seed=4)
    obs, r, term, trunc, info = env.step("hello")
    assert obs == f"invalid action . {info0['question']}" and r == -0.25
    assert info["format_error"] and info["format_errors"] == 1 and not term and not trunc
    _, r, term, trunc, info = env.step("answer banana")  # an unparsable answer is malformed too
    assert r == -0.25 and not term and not trunc and info["format_errors"] == 2
    _, r, term, trunc, info = env.step("calc 1 + 1")
    assert trunc and not term and info["turns"] == 3 and not info["success"] and r == 0.0


def _random_reply(rng: random.Random, question: str, answer: int, action_format: str) -> str:
    kind = rng.choice(["calc", "calc_bad", "right", "wrong", "junk", "empty", "bad_answer"])
    expr = _question_expr(question)
    compact = {"calc": f"calc {expr}", "calc_bad": "calc 1 / 0", "right": f"answer {answer}",
               "wrong": f"answer {answer + rng.randint(1, 3)}", "junk": "move left",
               "empty": "", "bad_answer": "answer seven"}
    tagged = {"calc": f"<tool>calc({expr})</tool>", "calc_bad": "<tool>calc(x)</tool>",
              "right": f"<answer>{answer}</answer>",
              "wrong": f"<answer>{answer - rng.randint(1, 3)}</answer>", "junk": "hmm",
              "empty": "", "bad_answer": "<answer>?</answer>"}
    return (compact if action_format == "compact" else tagged)[kind]


def test_verifier_agrees_with_env_return():
    rng = random.Random(0)
    outcomes = set()
    for episode in range(300):
        action_format = "compact" if episode % 2 else "tagged"
        env = ToolUse(max_turns=rng.randint(1, 5), action_format=action_format,
                      format_penalty=rng.choice([0.0, 0.1, 0.25]),
                      tool_cost=rng.choice([0.0, 0.05]))
        _, info = env.reset(seed=rng.randrange(10**6))
        question, responses, rewards = info["question"], [], []
        answer = calculate(_question_expr(question))
        term = trunc = False
        while not (term or trunc):
            reply = _random_reply(rng, question, answer, action_format)
            _, r, term, trunc, info = env.step(reply)
            responses.append(reply)
            rewards.append(r)
        item = {"responses": responses, "env_rewards": rewards, "info": info}
        score, details = verify(item)
        assert score == pytest.approx(sum(rewards))
        assert details["agrees_with_env"] and details["success"] == info["success"]
        assert details["format_errors"] == info["format_errors"]
        outcomes.add((info["success"], term, trunc))
    assert len(outcomes) == 3  # successes, failures and truncations were all exercised


def test_verifier_checks_the_reference_not_the_env_claim():
    info = {"answer": 56, "format_penalty": 0.1, "success": True, "action_format": "compact"}
    score, details = verify({"responses": ["bad", "answer 55"], "env_rewards": [], "info": info})
    assert score == pytest.approx(-0.1) and not details["success"]
    assert not details["agrees_with_env"] and details["format_errors"] == 1


@pytest.mark.parametrize("action_format", ["compact", "tagged"])
def test_observation_words_are_in_vocab(action_format):
    rng = random.Random(1)
    env = ToolUse(action_format=action_format, max_turns=6,
                  ops=("plus", "minus", "times", "divided by"))
    known = set(VOCAB) | set(PUNCTUATION)
    # the tagged format's instructions show the tag syntax, meant for pretrained tokenizers
    allowed_extra = set(TAGGED_HINT.split()) if action_format == "tagged" else set()
    exprs = ["1 + 2", "7 / 2", "1 / 0", "x", "2**3", "((((1))))", "1000001", "1 - 9",
             "1000000 * 1000000 * 9", "1" + " + 1" * 9, "1 +" + " " * 70 + "1", "-(3)"]
    for seed in range(200):
        obs, info = env.reset(seed=seed)
        observations = [obs]
        for _ in range(env.max_turns):
            kind = rng.random()
            if kind < 0.5:
                expr = rng.choice(exprs)
                reply = f"calc {expr}" if action_format == "compact" else \
                    f"<tool>calc({expr})</tool>"
            elif kind < 0.7:
                reply = "nonsense"
            else:
                value = rng.choice([info.get("answer", 0), 999])
                reply = f"answer {value}" if action_format == "compact" else \
                    f"<answer>{value}</answer>"
            obs, _, term, trunc, info = env.step(reply)
            observations.append(obs)
            if term or trunc:
                break
        for text in observations:
            for word in text.split():
                assert word in known or word in allowed_extra or _NUMBER_RE.match(word), \
                    (word, text)


def test_default_numbers_stay_small():
    # results up to 10 * 10: small numbers are known tokens of the tiny policy
    for seed in range(200):
        _, info = ToolUse().reset(seed=seed)
        a, _, b = _QUESTION_RE.search(info["question"]).groups()
        assert int(a) <= 10 and int(b) <= 10


def test_constructor_validates():
    for kwargs in [dict(max_turns=0), dict(max_operand=0), dict(ops=()), dict(ops=("modulo",)),
                   dict(action_format="json")]:
        with pytest.raises(ValueError):
            ToolUse(**kwargs)


def test_module_imports_nothing_heavy():
    code = ("import sys, tasks.envs.tool_use; "
            "print(sorted(m for m in ('numpy', 'torch', 'gymnasium') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
