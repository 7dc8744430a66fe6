"""Play a fixed list of replies through an environment, for the verifier tests."""

from __future__ import annotations


def play(env, actions) -> dict:
    """Step ``env`` (already reset) through ``actions`` until it ends; return the episode as the
    item a reward function scores (``responses``, ``env_rewards``, final ``info``)."""
    rewards, responses, info = [], [], {}
    for a in actions:
        _, r, term, trunc, info = env.step(a)
        rewards.append(r)
        responses.append(a)
        if term or trunc:
            break
    return {"id": "0", "idempotency_key": "k", "reward_fn": "", "env_name": "",
            "env_rewards": rewards, "responses": responses, "info": info}
