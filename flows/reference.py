"""The reference loop: RollArc's training recipe in one process, synchronously, without Dask.

Read this file first. It is the whole algorithm, top to bottom: draw groups from the mix, roll
each trajectory out turn by turn (prefill, decode, environment step), score the finished ones,
turn rewards into group-relative advantages, train one step, load the new weights, repeat. It
calls the very functions the Dask flow submits as tasks (:class:`tasks.stages.Stages`), the same
inference backend, trainer, loss, collector and seeds, so for the same config and seed it
produces the same tokens, rewards and losses as ``flows/train.py`` with ``mode=sync`` (tested on
a greedy policy by ``tests/integration/test_seams.py::test_reference_loop_is_the_oracle_of_the_dask_flow``).
What the Dask flow adds is *where* and *when*: pools, trajectory-level asynchrony, bounded
staleness, serverless reward.

Departures from the flow: rewards are scored in-process (the ``local`` reward backend, the
Lambda handler's own core, which gives the same scores as the deployed function), every
trajectory is one attempt, and there is no evaluation round (the flow's evaluation episodes
have ids of their own, so they do not change the training episodes). The engine here runs one
request at a time, the flow's batches concurrent ones: greedy tokens agree, sampled ones can in
principle differ where two tokens' probabilities tie to the last bits.

    python flows/reference.py trainer.max_steps=20
    python flows/reference.py --config config/mix.yaml trainer.max_steps=5
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time

from flows.config import ConfigError, TrainConfig, load_config, reward_callables, validate
from flows.config.derived import (
    batch_trajectories,
    effective_pools,
    emulation,
    pool_hardware,
    reward_client_settings,
    reward_name,
    trainer_hparams,
)
from flows.monitoring.metrics import batch_metrics
from flows.training.episode import (
    RolloutRecord,
    sampling_params,
    score_requests,
    turn_ends,
)
from flows.training.orchestration import GroupCollector, GroupDraw, decode_seed
from flows.training.workload import turn_shape
from resources.catalog import HardwareProfile
from resources.engine import backend_context
from resources.reward_backends import build_reward_client
from tasks.components import COMPONENT, bind, instantiate, resolve
from tasks.env_steps import EnvRegistry
from tasks.policy import load_tokenizer
from tasks.records import TrainBatch, Trajectory
from tasks.stages import Stages

logger = logging.getLogger(__name__)


def run_reference(cfg: TrainConfig, stages: Stages | None = None) -> list[dict]:
    """Train ``cfg.trainer.max_steps`` steps; one metrics row per step (as ``metrics.jsonl``),
    each also holding the step's trajectories under ``"trajectories"``."""
    cfg = validate(cfg)
    st = stages or Stages()
    # -- the parts: one inference backend, one trainer, environments, a reward client ---------
    pools = effective_pools(cfg)
    profile, gpus = pool_hardware(cfg)[pools[0].name]
    backend = instantiate(cfg.engine.backend, policy=cfg.policy, max_batch=1, **backend_context(
        resolve(cfg.engine.backend[COMPONENT]), HardwareProfile(**profile), gpus,
        emulation(cfg.engine) or {}, "reference"))
    trainer = instantiate(cfg.trainer.backend, policy=cfg.policy, hparams=trainer_hparams(cfg),
                          seed=cfg.seed, loss=bind(cfg.trainer.loss))
    tokenizer = load_tokenizer(cfg.policy)
    envs = EnvRegistry("reference")
    reward_client = build_reward_client(reward_client_settings(cfg.reward, None) | {"backend": "local"},
                                        cfg.reward.lambda_function, reward_callables(cfg))
    reward_fns = {t.name: reward_name(t) for t in cfg.env_tasks}
    sampling = sampling_params(cfg)
    draw = GroupDraw(cfg.env_tasks, random.Random(cfg.seed))
    batch_size = batch_trajectories(cfg)
    st.load_weights(backend, st.publish_weights(trainer))  # the engine starts on v0
    version, next_id, rows, t0 = 0, 0, [], time.perf_counter()

    while version < cfg.trainer.max_steps:
        # 1. admit one batch of whole groups (as sync admission does)
        collector = GroupCollector()
        admitted = []
        for gid, env_task, seed in draw.take(batch_size):
            collector.open_group(gid, env_task.name, env_task.group_size)
            for _ in range(env_task.group_size):
                admitted.append(RolloutRecord(next_id, gid, env_task, seed))
                next_id += 1

        # 2. roll every trajectory out, turn by turn
        finished: list[Trajectory] = []
        for rec in admitted:
            obs = st.env_reset(envs, tokenizer, rec.env_task.env, rec.seed,
                               f"reference.{rec.traj_id}.0", cfg.policy.system_prompt)
            past = None
            while True:
                shape = turn_shape(rec.env_task.shape, cfg.seed, rec.traj_id, rec.turn,
                                   rec.attempt)
                prefilled = st.prefill(backend, past, obs, shape=shape)
                past = st.decode(backend, prefilled, past, sampling[rec.env_task.name],
                                 decode_seed(cfg.seed, rec.traj_id, rec.turn, rec.attempt),
                                 shape=shape)
                nxt = st.env_step(envs, tokenizer, obs, st.response(past))
                rec.record_turn(nxt)
                over, context_limited = turn_ends(rec, nxt, sampling[rec.env_task.name]
                                                  .max_new_tokens, cfg.policy.max_context)
                if over:
                    if context_limited and not nxt.done:
                        st.env_close(envs, nxt.handle)
                    finished.append(rec.to_trajectory(nxt, context_limited))
                    break
                obs = nxt

        # 3. score the finished trajectories; a failed score drops the trajectory
        scored = st.score(reward_client, score_requests(finished, reward_fns, "reference"))
        for traj, res in zip(finished, scored.results, strict=True):
            if res.score is None:
                logger.warning("trajectory %s not scored: %s", traj.traj_id, res.error)
                collector.drop_member(traj.group_id)
            else:
                traj.reward, traj.reward_details = res.score, res.details
                collector.add(traj)

        # 4. group-relative advantages, one train step, new weights for the engine
        decision = collector.take_batch(collector.ready_groups, version,
                                        cfg.rollout.max_staleness)
        if not decision.samples:
            raise RuntimeError(f"step {version}: no group of two or more scored trajectories")
        stats = st.train_step(trainer, TrainBatch(decision.samples, version))
        version = stats.policy_version
        st.load_weights(backend, st.publish_weights(trainer))
        rows.append({"train/step": version, **stats.log("train"),
                     **batch_metrics(decision.trajectories, decision.staleness,
                                     len(decision.stale)),
                     "perf/elapsed_s": time.perf_counter() - t0,
                     "trajectories": decision.trajectories})
    backend.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML config (default: config/default.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, [*args.overrides, "reward.backend=local"])
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for row in run_reference(cfg):
        row.pop("trajectories")
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()
                          if k.startswith(("train/step", "train/loss", "reward/mean", "env/"))}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
