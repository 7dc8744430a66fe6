"""The seams, used as a user would through the Python API on real local Dask clusters: the
reference loop is the oracle of the Dask flow, the trajectory accounts hold at every event, and a
reward, an environment and a stage defined right here replace the package's own."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from flows.api import run_training
from flows.config import ConfigError, load_config, validate
from flows.monitoring.metrics import read_metrics
from flows.reference import run_reference
from flows.training.lifecycle import RunFailing, TrajState
from tasks.env_steps import env_step
from tasks.envs.frozenlake import FrozenLakeText
from tasks.stages import Stages
from tasks.trainer import train_step
from tests import QUIET, ROOT

pytestmark = pytest.mark.integration


# train batches as the trainer received them; the oracle test runs in-process workers, so a
# module-level function (pickled by reference) appends to this very list
TRAIN_BATCHES: list = []


def recording_train_step(trainer, batch):
    TRAIN_BATCHES.append(batch)
    return train_step(trainer, batch)


def test_reference_loop_is_the_oracle_of_the_dask_flow(tmp_path):
    """Same seed, greedy policy, sync mode: the Dask flow and the single-process reference loop
    produce the same trajectories (tokens, advantages), rewards and losses."""
    overrides = [*QUIET, "mode=sync", "trainer.max_steps=2", "trainer.groups_per_step=2",
                 "rollout.sampling.greedy=true", "reward.backend=local",
                 "cluster.processes=false"]
    TRAIN_BATCHES.clear()
    # the flow also evaluates after every step: evaluation episodes must not shift anything
    summary = run_training(load_config(overrides=[*overrides, "eval.every_steps=1",
                                                  "eval.episodes=1"]), tmp_path / "dask",
                           stages=Stages(train_step=recording_train_step),
                           dashboard=lambda line: None)
    flow_rows = read_metrics(tmp_path / "dask")
    ref_rows = run_reference(load_config(overrides=overrides))
    assert summary["policy_version"] == 2 and len(TRAIN_BATCHES) == 2
    assert summary["evaluation"]["episodes_started"] == 2 * 2
    for step, (batch, flow, ref) in enumerate(zip(TRAIN_BATCHES, flow_rows, ref_rows,
                                                  strict=True)):
        # the same episodes, in the same order (a batch is ordered by admission, not by timing,
        # so the trainer's seeded minibatches match too)
        got = [(tuple(s.token_ids.tolist()), round(s.advantage, 6)) for s in batch.samples]
        ref_samples = ref["trajectories"]
        want = [(tuple(t.token_ids.tolist()), round(a, 6)) for t, a in zip(
            ref_samples, _advantages(ref_samples), strict=True)]
        assert got == want, f"step {step + 1}: the trajectories differ"
        assert len(got) == 16
        for key in ("reward/mean", "train/loss", "train/entropy", "train/kl_behaviour",
                    "rollout/response_tokens"):
            assert flow[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (step, key)


def _advantages(trajs):
    from tasks.losses import group_advantages

    out = {}
    for gid in {t.group_id for t in trajs}:
        members = [t for t in trajs if t.group_id == gid]
        for t, a in zip(members, group_advantages([t.reward for t in members]), strict=True):
            out[id(t)] = a
    return [out[id(t)] for t in trajs]


def test_accounts_hold_at_every_event_of_a_run(tmp_path):
    events = []

    def watch(t, ledger):
        acc = ledger.training
        events.append((t.new, acc.started, acc.trained, acc.dropped_total, acc.in_flight))

    # an env task may be called "eval": evaluation episodes are known by their own flag
    cfg = load_config(overrides=[*QUIET, "trainer.max_steps=3", "trainer.groups_per_step=2",
                                 "reward.backend=local", "eval.every_steps=2",
                                 "eval.episodes=2", "env_tasks.0.name=eval",
                                 "cluster.processes=false"])
    summary = run_training(cfg, tmp_path / "run", on_transition=watch,
                           dashboard=lambda line: None)
    evals = read_metrics(tmp_path / "run", "eval")
    assert [r["eval/step"] for r in evals] == [2, 3]
    assert {"eval/eval/success", "eval/guess_number/success"} <= set(evals[0])
    # the oldest weights the round's tokens came from: the requested version or the one before
    assert all(r["eval/step"] - 1 <= r["eval/policy_version_oldest"] <= r["eval/step"]
               for r in evals)
    assert "env/eval/success" in read_metrics(tmp_path / "run")[-1] or any(
        "env/eval/success" in r for r in read_metrics(tmp_path / "run"))
    assert len(events) > 100
    # counts only grow: no trajectory is un-started or un-trained by a later event
    for column in (1, 2, 3):
        counts = [e[column] for e in events]
        assert counts == sorted(counts), column
    assert {e[0] for e in events} >= {TrajState.ROLLING_OUT, TrajState.AWAITING_SCORE,
                                      TrajState.SCORING, TrajState.IN_GROUP, TrajState.TRAINED,
                                      TrajState.EVALUATED, TrajState.DROPPED}
    t = summary["trajectories"]
    # nothing left in flight at the end: every trajectory trained or dropped with its reason
    assert events[-1][4] == 0 and t["started"] == t["trained"] + sum(t["dropped"].values())
    # evaluation after step 2 and after the last: 2 rounds of 2 episodes per env task
    assert summary["evaluation"]["episodes_started"] == 2 * 2 * len(cfg.env_tasks)


def test_a_reward_an_environment_and_a_stage_defined_here_replace_the_packages(tmp_path):
    class SayYes:
        """Defined inside the test: no module path reaches it, Dask ships it by value."""

        max_turns = 2

        def __init__(self, max_turns: int = 2):
            self.max_turns, self.turn = max_turns, 0

        def reset(self, seed=None):
            self.turn = 0
            return "reply yes or no", {"seed": seed}

        def step(self, action):
            self.turn += 1
            done = self.turn >= self.max_turns
            return "again", float(action.strip() == "yes"), done, False, {"said": action}

        def close(self):
            pass

    def marked_env_step(registry, tokenizer, prev, sample):
        obs = env_step(registry, tokenizer, prev, sample)
        obs.info = {**obs.info, "through_custom_step": True}
        return obs

    def custom_reward(item):  # 10 + the environment's return: visibly not the env's own
        assert item["info"]["through_custom_step"]
        return 10.0 + sum(item["env_rewards"]), {"custom": True}

    def labelled_backend(policy, max_batch):  # the inference seam: any InferenceBackend
        from resources.engine import hf_backend

        backend = hf_backend(policy, max_batch)
        stats = backend.stats
        backend.stats = lambda: {**stats(), "label": "from-the-test"}
        return backend

    cfg = load_config(overrides=[*QUIET, "trainer.max_steps=2", "trainer.groups_per_step=2",
                                 "reward.backend=local"])
    cfg.engine.backend = {"_component_": labelled_backend}
    cfg.env_tasks = [cfg.env_tasks[1].model_copy(update={
        "name": "say_yes", "env": {"_component_": SayYes, "max_turns": 2},
        "reward_fn": custom_reward, "weight": 1.0})]
    summary = run_training(cfg, tmp_path / "run", stages=Stages(env_step=marked_env_step),
                           dashboard=lambda line: None)
    rows = read_metrics(tmp_path / "run")
    assert [r["train/step"] for r in rows] == [1, 2]
    assert all(10.0 <= r["env/say_yes/reward"] <= 12.0 for r in rows)
    assert all(r["env/say_yes/turns"] == 2.0 for r in rows)
    assert summary["reward"]["lost"] == {} and summary["trajectories"]["trained"] > 0
    engines = [w["engine"] for w in summary["workers"].values() if "engine" in w]
    assert len(engines) == 2 and all(e["label"] == "from-the-test" for e in engines)
    assert "<python: tests.integration.test_seams." in (tmp_path / "run" / "config.yaml").read_text()

    # the lambda backend cannot run a function that was never deployed: refused before any
    # cluster starts, with one line that says why
    cfg.reward.backend = "lambda"
    with pytest.raises(ConfigError) as exc:
        run_training(cfg, tmp_path / "refused", dashboard=lambda line: None)
    assert "deploy" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "refused").exists()


def test_reference_loop_learns_frozenlake():
    """The default suite's learning guard: seeded and single-process, so deterministic (the
    Dask flow's full-length learning runs vary from run to run and are marked slow)."""
    cfg = load_config(overrides=["reward.backend=local", "trainer.max_steps=40",
                                 "trainer.groups_per_step=4"])
    cfg.env_tasks = cfg.env_tasks[:1]
    success = [r["env/frozenlake/success"] for r in run_reference(validate(cfg))]
    assert max(success[:5]) <= 0.05, success
    assert np.mean(success[-3:]) >= 0.25, success


def test_a_run_whose_every_trajectory_fails_stops_with_one_line(tmp_path):
    class Broken:
        max_turns = 1

        def reset(self, seed=None):
            raise OSError("sandbox unreachable")

        def step(self, action):
            raise AssertionError("never reached")

        def close(self):
            pass

    cfg = load_config(overrides=[*QUIET, "trainer.max_steps=2", "reward.backend=local",
                                 "rollout.max_in_flight=16", "trainer.groups_per_step=2",
                                 "cluster.processes=false"])
    cfg.env_tasks = [cfg.env_tasks[0].model_copy(update={"env": {"_component_": Broken}})]
    with pytest.raises(RunFailing) as exc:
        run_training(cfg, tmp_path / "run", dashboard=lambda line: None)
    assert "OSError: sandbox unreachable" in str(exc.value) and "\n" not in str(exc.value)


def test_batch_level_environment_handling_holds_each_turn_for_the_whole_batch(tmp_path):
    """rollout.env_barrier (the baseline of trajectory-level handling): no trajectory's turn t+1
    is submitted before every trajectory still running has answered turn t; without it they are.

    The times are the driver's own (when it submitted a turn, when the turn's answer reached
    it): one clock. The task stream's compute times come from several workers, each shifted by
    Dask's estimate of its clock's offset from the scheduler's (``Worker.scheduler_delay``,
    measured over a heartbeat's round trip), which on a busy machine differs between two
    workers by a good part of a second even when they share one process and one clock."""
    import json

    def turn_submissions_and_answers(env_barrier: bool) -> tuple[dict, dict]:
        run_dir = tmp_path / f"barrier-{env_barrier}"
        cfg = load_config(overrides=[*QUIET, "mode=sync", "trainer.max_steps=1",
                                     "trainer.groups_per_step=2", "reward.backend=local",
                                     "cluster.processes=false", "metrics.task_stream=true",
                                     "rollout.cohort_max=1",  # a task per trajectory and turn
                                     f"rollout.env_barrier={str(env_barrier).lower()}"])
        run_training(cfg, run_dir, dashboard=lambda line: None)
        turns = json.loads((run_dir / "task_stream.json").read_text())["turns"]
        submitted, answered = {}, {}
        seen: dict[str, int] = {}
        for _legs, sent, back, _waited, trajectory in turns:
            # a trajectory's turns are recorded in order
            turn = seen[trajectory] = seen.get(trajectory, -1) + 1
            submitted.setdefault(turn, []).append(sent)
            answered.setdefault(turn, []).append(back)
        return submitted, answered

    submitted, answered = turn_submissions_and_answers(True)
    assert len(submitted) > 2  # several turns
    for turn in sorted(submitted)[1:]:
        assert min(submitted[turn]) >= max(answered[turn - 1])
    submitted, answered = turn_submissions_and_answers(False)
    assert any(min(submitted[t]) < max(answered[t - 1]) for t in sorted(submitted)[1:])


def test_the_flow_and_the_simulator_take_their_decisions_from_one_run_core(tmp_path,
                                                                           monkeypatch):
    """Replacing one decision of the run core (how many groups a batch takes) changes the Dask
    flow and the simulator alike: neither keeps a copy of it."""
    from flows.simulation.settings import load as load_simulation
    from flows.simulation.simulator import simulate as run_sim
    from flows.training import core

    def one_group(mode, ready_groups, groups_per_step, *rest):
        return 1 if ready_groups else None

    monkeypatch.setattr(core, "groups_to_cut", one_group)
    run_training(load_config(overrides=[*QUIET, "trainer.max_steps=2", "reward.backend=local",
                                        "trainer.groups_per_step=2", "cluster.processes=false"]),
                 tmp_path / "run", dashboard=lambda line: None)
    assert [r["rollout/batch_trajectories"] for r in read_metrics(tmp_path / "run")] == [8, 8]
    cfg, sim = load_simulation(ROOT / "config" / "bench" / "long_tail.yaml",
                               ["trainer.max_steps=3"])  # 4 groups of 8 a step, unpatched
    result = run_sim(cfg, sim)
    assert result.steps == 3 and result.trajectories["trained"] == 3 * 8


class SlowOnes(FrozenLakeText):
    """FrozenLake where every fourth instance's steps take a quarter of a second (a sandbox
    that answers slowly): the stragglers of a cohort."""

    made = itertools.count()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.slow = next(SlowOnes.made) % 4 == 0

    def step(self, action):
        if self.slow:
            time.sleep(0.25)
        return super().step(action)


def test_a_cohorts_straggler_holds_no_one_unless_the_barrier_baseline_is_asked_for(tmp_path):
    """Members of one cohort come back as each finishes: a fast member's turn answers before
    its slow mate's. With rollout.cohort_barrier every member of a cohort answers at once."""
    import json

    def answers_per_cohort_turn(barrier: bool) -> list[int]:
        run_dir = tmp_path / f"barrier-{barrier}"
        cfg = load_config(overrides=[*QUIET, "mode=sync", "trainer.max_steps=1",
                                     "trainer.groups_per_step=2", "reward.backend=local",
                                     "cluster.processes=false", "metrics.task_stream=true",
                                     f"rollout.cohort_barrier={str(barrier).lower()}"])
        task = cfg.env_tasks[0]
        cfg.env_tasks = [task.model_copy(update={
            "env": {**task.env, "_component_": SlowOnes, "max_turns": 3}, "weight": 1.0})]
        summary = run_training(cfg, run_dir, dashboard=lambda line: None)
        assert summary["trajectories"]["trained"] == 16
        stream = json.loads((run_dir / "task_stream.json").read_text())
        # a cohort's turn: its members share the time it was submitted
        done: dict[float, set[float]] = {}
        for _suffix, submitted, answered, _waited, _traj in stream["turns"]:
            done.setdefault(submitted, set()).add(answered)
        return [len(times) for times in done.values()]

    assert all(n == 1 for n in answers_per_cohort_turn(barrier=True))
    assert any(n > 1 for n in answers_per_cohort_turn(barrier=False))


def _look_ahead_run(tmp_path, lookahead: bool, *overrides: str) -> tuple[dict, dict]:
    run_dir = tmp_path / f"lookahead-{lookahead}"
    cfg = load_config(overrides=[*QUIET, "mode=sync", "trainer.max_steps=1",
                                 "trainer.groups_per_step=2", "reward.backend=local",
                                 "cluster.processes=false", "metrics.task_stream=true",
                                 f"rollout.lookahead={str(lookahead).lower()}", *overrides])
    summary = run_training(cfg, run_dir, dashboard=lambda line: None)
    import json
    return summary, json.loads((run_dir / "task_stream.json").read_text())


def _in_flight_when_the_turn_before_answered(stream: dict) -> list[bool]:
    """Per turn after a trajectory's first (the driver's clock): whether it was the
    trajectory's turn in flight from the moment the turn before answered (a look-ahead turn
    made the trajectory's own then) rather than submitted by a later pass of the driver."""
    last: dict[str, float] = {}
    out = []
    for _legs, submitted, answered, _waited, trajectory in stream["turns"]:
        if trajectory in last:
            out.append(submitted == last[trajectory])
        last[trajectory] = answered
    return out


def test_a_trajectorys_next_turn_goes_ahead_of_the_drivers_round_trip(tmp_path):
    """rollout.lookahead: a trajectory's next turn is submitted with its turn in flight, so
    it is on its way when the turn's answer reaches the driver; the look-ahead turns after an
    episode's end do nothing, and every instance is closed. (The task stream cannot show it
    starting before the driver took the answer: its workers' clocks are shifted by Dask's
    estimate of their offsets, which differ by more than a turn.)"""
    ahead, stream = _look_ahead_run(tmp_path, True)
    plain, plain_stream = _look_ahead_run(tmp_path, False)
    for summary in (ahead, plain):
        assert summary["trajectories"]["trained"] == 16
        assert summary["live_env_instances_at_end"] == 0
    # (a member a stage left running goes on with a continuation, then a turn submitted anew)
    went_ahead = _in_flight_when_the_turn_before_answered(stream)
    assert went_ahead and sum(went_ahead) > len(went_ahead) / 2
    assert not any(_in_flight_when_the_turn_before_answered(plain_stream))
    # per ended trajectory one turn after its last went ahead and did nothing: more prefill
    # tasks for the same turns
    assert (ahead["rollout_tasks_submitted"]["prefill"]
            > plain["rollout_tasks_submitted"]["prefill"])


def test_a_look_ahead_turn_after_a_context_cut_steps_before_the_instance_closes(tmp_path):
    """A trajectory cut by the context limit ends in the driver, not in its environment: its
    look-ahead turn runs, and the instance is closed only after it (none is left, and no
    look-ahead turn fails on a closed instance)."""
    summary, _stream = _look_ahead_run(tmp_path, True, "policy.max_context=64")
    t = summary["trajectories"]
    assert t["trained"] == 16 and t["started"] == 16
    assert summary["final_metrics"]["rollout/truncated"] > 0
    assert summary["live_env_instances_at_end"] == 0


def test_a_look_ahead_turn_answering_with_its_turn_before_steps_each_environment_once(
        tmp_path, monkeypatch):
    """Finished turns reach the driver in batches of any size, in no promised order. Here every
    batch waits until all that is in flight finished, a look-ahead turn with the turn before
    it, and is taken newest first: the look-ahead answer comes first. Each trajectory's next
    turn still goes ahead once: no environment is stepped twice (a replayed step fails its
    trajectory) or after its close."""
    from flows.training import events

    finished = events.EventLoop._finished

    def all_at_once_newest_first(loop):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with loop.condition:
                done = {f.key for f in loop._done}
            if all(key in done for key in loop._tracked):
                break
            time.sleep(0.01)
        return finished(loop)[::-1]

    monkeypatch.setattr(events.EventLoop, "_finished", all_at_once_newest_first)
    summary, _stream = _look_ahead_run(tmp_path, True, "rollout.max_attempts=1")
    assert summary["drop_details"] == []
    assert summary["trajectories"]["trained"] == 16
    assert summary["live_env_instances_at_end"] == 0
