"""LookAheads' decisions (flows/training/lookahead.py) on real records and config, no cluster:
who goes ahead with a flush (once each), a look-ahead answer that came back before the turn
before it, and the environment closes that wait for a look-ahead turn."""

from __future__ import annotations

import time

from distributed import Future

from flows.config import TrainConfig, load_config
from flows.training.episode import RolloutRecord
from flows.training.lifecycle import DropReason
from flows.training.lookahead import LookAheads
from flows.training.rollout_faults import RolloutFaults
from flows.training.turn_tasks import Cohort, CohortKey
from flows.training.workload import LengthDist, TurnShapeConfig
from resources.pools import Tag
from tasks.records import EnvHandle

KEY = CohortKey(False, None, "env-0", "compute-0", Tag.GPU_COMPUTE, "bandwidth-0",
                Tag.GPU_BANDWIDTH)


def _cohort(name: str, traj_ids: list[int], ahead: bool = False) -> Cohort:
    # unbound futures (no client): the class only reads their keys and hands them back
    return Cohort(traj_ids=traj_ids, suffix=name, submitted=0.0,
                  step=Future(f"env_step-{name}"), decode=Future(f"decode-{name}"),
                  workers=frozenset({"env-0", "compute-0", "bandwidth-0"}), env_task="frozenlake",
                  key=KEY, ahead=ahead)


class Driver:
    """What a driver gives its look-aheads: its trajectories and cohorts in flight."""

    def __init__(self):
        self.cfg: TrainConfig = load_config()
        self.live: dict[int, RolloutRecord] = {}
        self.cohorts: dict[str, Cohort] = {}
        self.faults = RolloutFaults(self.cfg)
        self.ahead = LookAheads(True, self.live, self.cohorts, self.faults)

    def in_flight(self, cohort: Cohort, task: int = 0) -> list[RolloutRecord]:
        """``cohort``'s members, each with it as its turn in flight."""
        self.cohorts[cohort.step.key] = cohort
        recs = []
        for i, tid in enumerate(cohort.traj_ids):
            rec = self.live.setdefault(tid, RolloutRecord(tid, f"g{tid}",
                                                          self.cfg.env_tasks[task], seed=tid))
            rec.handle, rec.env_worker = EnvHandle("env-0", f"inst-{tid}"), "env-0"
            rec.turn_key, rec.turn_step = KEY, (cohort.step, i)
            rec.last_decode, rec.kv_worker = (cohort.decode, i), "bandwidth-0"
            recs.append(rec)
        return recs


def _members(groups: dict[CohortKey, list[RolloutRecord]]) -> list[int]:
    return sorted(rec.traj_id for recs in groups.values() for rec in recs)


def test_a_trajectory_promoted_and_submitted_again_before_a_flush_goes_ahead_once():
    """Its look-ahead turn became its turn in flight, came back, and its next turn was
    submitted: both lists name it, and it goes ahead once (twice, its environment would be
    stepped twice)."""
    d = Driver()
    [rec] = d.in_flight(_cohort("t0", [0]))
    ahead = _cohort("a0", [0], ahead=True)
    d.cohorts[ahead.step.key] = ahead
    d.ahead.submitted([ahead])
    assert rec.ahead == (ahead, 0)
    cohort, early = d.ahead.promote(rec, time.time())
    assert (cohort, early) == (ahead, None)
    d.in_flight(_cohort("t1", [0]))  # it came back, and the next turn went
    groups = d.ahead.chosen([rec], stopping=False)
    assert list(groups) == [KEY] and _members(groups) == [0]


def test_only_trajectories_with_a_turn_in_flight_real_lengths_and_their_workers_go_ahead():
    d = Driver()
    eight = LengthDist(median=8)
    d.cfg.env_tasks[0] = d.cfg.env_tasks[0].model_copy(update={"shape": TurnShapeConfig(
        prompt_tokens=eight, turn_tokens=eight, response_tokens=eight)})
    shaped = d.in_flight(_cohort("s", [0]))  # an emulated env task: lengths drawn per turn
    real = d.in_flight(_cohort("r", [1, 2, 3, 4]), task=1)
    real[1].ahead = (_cohort("x", [2]), 0)  # one ahead already
    real[2].turn_step = (Future("env_step-gone"), 0)  # its turn came back
    d.faults.lost_workers.add("nowhere")
    real[3].kv_worker = "nowhere"  # its cache's worker left
    assert _members(d.ahead.chosen(shaped + real, stopping=False)) == [1]
    assert _members(d.ahead.chosen([real[0]], stopping=True)) == []  # training is over
    real[0].eval_round = 0
    assert _members(d.ahead.chosen([real[0]], stopping=True)) == [1]  # an evaluation goes on


def test_a_look_ahead_answer_before_the_turn_before_waits_for_it():
    """The order of a batch's events is not promised: the look-ahead answer is kept and
    handed out with the promotion; one for a look-ahead turn given up is ignored."""
    d = Driver()
    a, b = d.in_flight(_cohort("t", [0, 1]))
    ahead = _cohort("a", [0, 1], ahead=True)
    d.cohorts[ahead.step.key] = ahead
    d.ahead.submitted([ahead])
    d.ahead.void(b)  # its episode ended
    for tid in (0, 1):
        d.ahead.answered(ahead, tid, f"obs{tid}", DropReason.ROLLOUT_ERROR)
    now = time.time()
    cohort, early = d.ahead.promote(a, now)
    assert cohort is ahead and early == ("obs0", DropReason.ROLLOUT_ERROR)
    # the record reads the look-ahead turn as its turn in flight, which counts from now
    assert a.turn_step == (ahead.step, 0) and a.last_decode == (ahead.decode, 0)
    assert a.turn_obs[0].key == "env_step-t" and a.ahead is None
    assert not ahead.ahead and ahead.submitted == now


def test_a_close_waits_for_the_look_ahead_turn_that_may_still_step_the_environment():
    d = Driver()
    [rec] = d.in_flight(_cohort("t", [0]))
    assert not d.ahead.close_after(rec)  # none ahead: it closes now
    ahead = _cohort("a", [0], ahead=True)
    d.cohorts[ahead.step.key] = ahead
    d.ahead.submitted([ahead])
    assert d.ahead.close_after(rec) and d.ahead.holds("env-0")
    rec.attempt += 1  # a restart reuses the record: the close keeps the instance it had
    [closed] = d.ahead.closes_due(ahead.step.key)
    assert closed.attempt == 0 and closed.handle.instance_id == "inst-0"
    assert not d.ahead.holds("env-0") and d.ahead.closes_due(ahead.step.key) == []
    assert d.ahead.close_after(rec) and len(d.ahead.clear()) == 1 and not d.ahead.holds("env-0")
