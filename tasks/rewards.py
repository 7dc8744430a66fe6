"""Rule-based reward functions: pure, one JSON-able trajectory item in, a score and details out.

An item is what :class:`tasks.records.ScoreRequest` sends over the Lambda boundary: ``id``,
``idempotency_key``, ``reward_fn``, ``env_name``, ``env_rewards``, ``responses`` (the agent's
text per turn) and ``info`` (the environment's final info). The verifiers replay the agent's
answers against the task itself instead of trusting the environment's own return; they import
nothing heavier than the parsers, so they ship in the zip-packaged Lambda function
(``resources/lambda/template.yaml``). The model-based rewards live in :mod:`tasks.reward_models`.
"""

from __future__ import annotations

from typing import Any

from tasks.envs.frozenlake import ACTIONS, parse_action
from tasks.envs.guess_number import parse_guess
from tasks.envs.tool_use import verify as _verify_tool_use
from tasks.hc_pinn.grammar import parse_replies

Item = dict[str, Any]
RewardOutput = tuple[float, dict[str, Any]]

_MOVES = {ACTIONS["left"]: (0, -1), ACTIONS["down"]: (1, 0), ACTIONS["right"]: (0, 1),
          ACTIONS["up"]: (-1, 0)}


def env_return(item: Item) -> RewardOutput:
    """The environment's own return (success pays 1, format errors cost their penalty)."""
    rewards = [float(r) for r in item["env_rewards"]]
    return sum(rewards), {"success": bool(item["info"].get("success", False)),
                          "format_errors": int(item["info"].get("format_errors", 0))}


def success_only(item: Item) -> RewardOutput:
    """1 for success, 0 otherwise; ignores format penalties."""
    ok = bool(item["info"].get("success", False))
    return float(ok), {"success": ok}


def frozenlake_verifier(item: Item) -> RewardOutput:
    """Replay the agent's moves on the episode's map: 1 for reaching G without entering a hole,
    minus the format penalty per unparseable answer. Needs ``info.map`` (rows of S/F/H/G)."""
    info = item["info"]
    grid: list[str] = info["map"]
    if not grid or any(len(row) != len(grid[0]) for row in grid):
        raise ValueError("info.map must be non-empty rows of equal length")
    penalty = float(info.get("format_penalty", 0.0))
    starts = [(r, c) for r, row in enumerate(grid) for c, ch in enumerate(row) if ch == "S"]
    if len(starts) != 1:
        raise ValueError("info.map must hold exactly one start S")
    (row, col), success, format_errors = starts[0], False, 0
    for text in item["responses"]:
        action = parse_action(text, info.get("action_format", "compact"))
        if action is None:
            format_errors += 1
            continue
        dr, dc = _MOVES[action]
        row = min(max(row + dr, 0), len(grid) - 1)
        col = min(max(col + dc, 0), len(grid[0]) - 1)
        if grid[row][col] in "HG":
            success = grid[row][col] == "G"
            break
    return float(success) - penalty * format_errors, {
        "success": success, "format_errors": format_errors,
        "agrees_with_env": success == bool(info.get("success", False))}


def guess_number_verifier(item: Item) -> RewardOutput:
    """1 if an answer names the secret, minus the format penalty per answer that is not a number
    in range. Needs ``info.secret``, ``info.low`` and ``info.high``."""
    info = item["info"]
    secret, low, high = int(info["secret"]), int(info["low"]), int(info["high"])
    penalty = float(info.get("format_penalty", 0.0))
    success, format_errors = False, 0
    for text in item["responses"]:
        guess = parse_guess(text, info.get("action_format", "compact"))
        if guess is None or not low <= guess <= high:
            format_errors += 1
        elif guess == secret:
            success = True
            break
    return float(success) - penalty * format_errors, {
        "success": success, "format_errors": format_errors,
        "agrees_with_env": success == bool(info.get("success", False))}


def tool_use_verifier(item: Item) -> RewardOutput:
    """Re-parse the replies: 1 for a final answer equal to ``info.answer``, minus the format
    penalty per malformed reply and the tool cost per call (:func:`tasks.envs.tool_use.verify`)."""
    return _verify_tool_use(item)


def sokoban_verifier(item: Item) -> RewardOutput:
    """Rebuild the level from ``info.level_seed`` and ``info.env_kwargs`` and replay the replies:
    the replay's return (1 for every box on a target, minus penalties) and success."""
    from tasks.envs.sokoban import Sokoban

    info = item["info"]
    env = Sokoban(**info["env_kwargs"])
    env.reset(seed=int(info["level_seed"]))
    score, success, format_errors = 0.0, False, 0
    for text in item["responses"][: env.max_turns]:
        _, reward, terminated, truncated, step_info = env.step(text)
        score += reward
        success, format_errors = step_info["success"], step_info["format_errors"]
        if terminated or truncated:
            break
    return score, {"success": success, "format_errors": format_errors,
                   "agrees_with_env": success == bool(info.get("success", False))}


def hc_pinn_spectral(item: Item) -> RewardOutput:
    """The hc_pinn environment's cheap spectral score of the agent's last valid proposal (its
    effective rank over the best commonly used boundary function's, at most 1), minus the
    format penalty per reply that named no boundary function. The proposals are re-parsed from
    the replies and must match the ones the environment scored (``info.proposals``); the
    spectrum itself is the environment's, as recomputing it needs torch. Training the proposal
    instead is :func:`tasks.hc_pinn.verify.hc_pinn_convergence`."""
    info = item["info"]
    penalty = float(info.get("format_penalty", 0.0))
    specs, format_errors = parse_replies(item["responses"])
    valid = [str(s) for s in specs]
    proposals = info.get("proposals") or []
    if valid != [p["spec"] for p in proposals]:
        raise ValueError(f"the replies propose {valid}, the environment scored "
                         f"{[p['spec'] for p in proposals]}")
    score = float(proposals[-1]["score"]) if proposals else 0.0
    success = bool(proposals) and score >= 1.0 - float(info.get("tolerance", 0.0))
    return score - penalty * format_errors, {
        "success": success, "format_errors": format_errors,
        "spec": valid[-1] if valid else None,
        "agrees_with_env": success == bool(info.get("success", False))}
