"""The TRL baseline (flows/benchmarks/trl_baseline.py): its multi-turn rollout encodes turns as
RollArc does and scores them as the reward service does, a short TRL run writes RollArc's metric
rows (the figures and the comparison that read them: tests/unit/flows/test_trl_compare.py).
Skipped without the ``trl`` extra."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from flows.benchmarks import trl_baseline as tb  # noqa: E402
from flows.config import load_config  # noqa: E402
from tasks.components import instantiate  # noqa: E402
from tasks.policy import encode_first_turn, encode_next_turn, load_policy  # noqa: E402

# they seed the process-wide RNGs: leave them as they were
pytestmark = pytest.mark.usefixtures("restore_global_rngs")


def _cfg(*overrides: str):
    return load_config(None, ["policy.device=cpu", "trainer.groups_per_step=2", *overrides])


def _turns(ids: list[int], mask: list[int]) -> list[tuple[list[int], list[int]]]:
    """A completion cut into (sampled tokens, environment tokens after them) per turn."""
    turns: list[tuple[list[int], list[int]]] = []
    for tok, m in zip(ids, mask, strict=True):
        if m and (not turns or turns[-1][1]):
            turns.append(([], []))
        turns[-1][1 - m].append(tok)
    return turns


def test_rollout_is_rollarcs_turn_encoding_and_reward():
    cfg = _cfg()
    model, tokenizer = load_policy(cfg.policy, dtype=torch.float32)
    rollout = tb.MultiTurnRollout(cfg, tokenizer)
    trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    groups = tb.group_prompts(cfg, steps=1)
    prompts = [p for p in groups for _ in range(cfg.env_tasks[0].group_size)]
    torch.manual_seed(0)
    out = rollout(prompts, trainer)
    scores = tb.reward_scorer(cfg)(prompts, None, score_request=out["score_request"])
    tasks = {t.name: t for t in cfg.env_tasks}
    assert len(out["prompt_ids"]) == len(prompts) == len(scores)
    for i, prompt in enumerate(prompts):
        group = json.loads(prompt)
        env = instantiate(tasks[group["env_task"]].env)
        text, _ = env.reset(seed=group["seed"])
        assert out["prompt_ids"][i] == encode_first_turn(tokenizer, text)
        expected, returns = [], 0.0
        for sampled, env_ids in _turns(out["completion_ids"][i], out["env_mask"][i]):
            text, reward, terminated, truncated, _ = env.step(tokenizer.decode(
                [t for t in sampled if t != tokenizer.eos_token_id], skip_special_tokens=True))
            returns += reward
            done = terminated or truncated
            expected += sampled + ([] if done else encode_next_turn(tokenizer, text, sampled))
            assert (env_ids == []) == done
        assert out["completion_ids"][i] == expected
        assert scores[i] == pytest.approx(returns)  # the verifier replays what the env paid
        # the sampler's log-probs are what the policy gives its tokens at the temperature
        ids = torch.tensor([out["prompt_ids"][i] + out["completion_ids"][i]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1] / rollout.sampling.temperature
        logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(out["env_mask"][i], dtype=torch.bool)
        got = torch.tensor(out["logprobs"][i])[mask]
        assert torch.allclose(got, logp[len(out["prompt_ids"][i]) - 1:][mask], atol=1e-4)
    assert {json.loads(p)["group_id"] for p in prompts} == {json.loads(g)["group_id"] for g in groups}


def test_groups_follow_rollarcs_draw_and_lr_decays_by_policy_version():
    cfg = _cfg("trainer.max_steps=10")
    rows = [json.loads(p) for p in tb.group_prompts(cfg, steps=10)]
    assert len(rows) == 20 and len({r["group_id"] for r in rows}) == 20
    assert {r["env_task"] for r in rows} <= {t.name for t in cfg.env_tasks}
    assert rows == [json.loads(p) for p in tb.group_prompts(cfg, steps=10)]  # seeded
    factor, mb = tb.lr_factor(cfg), cfg.trainer.hparams.minibatches
    assert [factor(k) for k in range(mb)] == [1.0] * mb  # one lr per policy version
    assert factor(10 * mb) == pytest.approx(cfg.trainer.hparams.lr_final_ratio)
    assert factor(5 * mb) == pytest.approx(1 - (1 - cfg.trainer.hparams.lr_final_ratio) / 2)
    with pytest.raises(ValueError, match="one group size"):
        tb.group_prompts(_cfg("env_tasks.0.group_size=4"), steps=1)


def test_a_short_trl_run_writes_rollarcs_metric_rows(tmp_path):
    cfg = _cfg("trainer.max_steps=2", "seed=1")
    figures = tb.run_baseline(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in rows] == [1, 2]
    assert 0 < rows[0]["perf/elapsed_s"] < rows[1]["perf/elapsed_s"]
    assert all(0 <= v <= 1 for r in rows for k, v in r.items() if k.endswith("/success"))
    assert all(r["rollout/batch_trajectories"] == 16 and r["rollout/sequence_tokens"] > 0
               for r in rows)
    saved = json.loads((tmp_path / "trl_baseline.json").read_text())
    assert saved == figures and saved["steps"] == 2 and len(saved["step_s"]) == 2
    assert saved["trl_version"].startswith("1.")

