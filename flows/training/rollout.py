"""Trajectory graphs: each trajectory is a dynamic Dask graph, one turn's sub-graph at a time.

A turn is ``prefill -> decode -> env_step``, submitted together with futures as arguments, so
the cache handle moves worker to worker (decode -> prefill -> decode) and never through the
driver; the driver waits only for env_step's small result, and hands it by value to the next
turn's tasks. env_step extracts the response from the decode output itself
(``Stages.response``): three tasks per turn.

Turns that are ready at the same moment on the same workers go as one *cohort*
(:mod:`tasks.cohort`, at most ``rollout.cohort_max`` trajectories): one task per stage for all of
them, their members run side by side inside it. A Dask task costs about a millisecond of
orchestration whatever it computes, so this is what lets the embedded default's millisecond
turns run at the speed of a single-process loop; ``cohort_max: 1`` submits every trajectory's
turn on its own. A cohort is no barrier: a stage returns with the members done, the others go
on in the background and the driver continues them as soon as the stage's answer reaches it
(``rollout.cohort_barrier: true`` makes every stage wait for all its members instead).
With ``rollout.lookahead`` each trajectory's next turn is submitted while its turn is in flight,
reading that turn's results as futures: the driver's round trip between two turns is off the
trajectory's path (:mod:`flows.training.lookahead` keeps those turns and decides who goes
ahead). Where each turn runs and which turns share a cohort is :mod:`flows.training.dispatch`;
the tasks and their keys are :mod:`flows.training.turn_tasks`: the dashboard groups
them by stage and a restarted trajectory never picks up an old key's result. Every change of a
trajectory's state goes through the :class:`flows.training.lifecycle.TrajectoryLedger`. What a
fault does (a worker lost, a turn overdue, a member failed: restart or drop) is decided by
:mod:`flows.training.rollout_faults`; the driver carries it out on its records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from distributed import Client, Future

from flows.config import EnvTaskConfig, TrainConfig
from flows.config.derived import with_env_faults
from flows.monitoring.monitor import StageSpans
from flows.monitoring.step_timings import TurnTimings, trajectory_key
from flows.training.dispatch import Resumes, TurnDispatch
from flows.training.episode import RolloutRecord, TrajectoryIds, sampling_params, turn_ends
from flows.training.lifecycle import DropReason, TrajectoryLedger, TrajState
from flows.training.lookahead import LookAheads
from flows.training.orchestration import PoolWorkers
from flows.training.rollout_faults import RolloutFaults, strands_resume, strands_waiting
from flows.training.turn_placement import TurnPlacer
from flows.training.turn_tasks import Cohort, TurnLog, TurnTasks
from resources.device_model import DeviceModel
from tasks.cohort import Deferred, Ended, MemberError
from tasks.records import EnvObservation, Trajectory
from tasks.stages import Stages


@dataclass
class TurnOutcome:
    """What one cohort's turn did to its members."""

    finished: list[tuple[RolloutRecord, Trajectory]] = field(default_factory=list)
    dropped: list[RolloutRecord] = field(default_factory=list)  # reasons are in the ledger


class RolloutDriver:
    """Submits and advances trajectories; reports finished and dropped ones.

    ``start`` admits a trajectory and a finished turn readies the next one; ``flush`` submits
    every ready turn, in cohorts (:class:`flows.training.dispatch.TurnDispatch` places them),
    and returns the futures to wait on; ``on_turn`` takes a
    cohort's results (or its failure) back; ``worker_lost`` and ``overdue`` give up on the
    cohorts a fault hit (:class:`flows.training.rollout_faults.RolloutFaults` decides)."""

    def __init__(self, client: Client, cfg: TrainConfig, pool_workers: PoolWorkers,
                 ledger: TrajectoryLedger, stages: Stages, run_id: str = "run",
                 devices: dict[str, DeviceModel] | None = None,
                 spans: StageSpans | None = None, key_tag: str = "",
                 env_specs: dict[str, dict] | None = None):
        self.cfg, self.pool_workers, self.ledger = cfg, pool_workers, ledger
        # ends every key: runs sharing a cluster never share a key (nor an old key's result)
        self.key_tag = key_tag
        # devices: each inference worker's device model (None: rollout.turn_placement=split)
        self.placer = TurnPlacer(cfg, devices)
        self.run_id = run_id
        self.spans = spans or StageSpans(run_id)  # Fine Performance Metrics by env task, stage
        self.sampling = sampling_params(cfg)
        # each env task's environment, with the faults of faults.env injected; rollout shards
        # pass the first shard's table, so that replace_env reaches them all
        self.env_specs = env_specs if env_specs is not None else {
            t.name: with_env_faults(cfg.faults, t.env) for t in cfg.env_tasks}
        self.live: dict[int, RolloutRecord] = {}
        self._ready: list[RolloutRecord] = []  # next turn to submit (rec.next_obs; None: reset)
        self._cohorts: dict[str, Cohort] = {}  # by the key of its env_step
        self.tasks = TurnTasks(client, stages, self.spans, key_tag, cfg.seed,
                               cfg.policy.system_prompt, self.env_specs,
                               None if cfg.rollout.cohort_barrier else cfg.rollout.cohort_grace_s)
        # members a stage left running, to continue with the next flush: by (stage, handle),
        # each with its index under the handle
        self._resumes: Resumes = {}
        self.truncated: dict[str, int] = {"context": 0, "max_turns": 0}
        self.faults = RolloutFaults(cfg)
        self.ids = TrajectoryIds()
        self.stopping = False  # training is over (stop): no turn of training goes on
        self.turns = TurnLog(cfg.metrics.task_stream, cfg.engine.time_scale)
        self.timings = TurnTimings()  # each trajectory's turns, for its step's critical path
        # rollout.env_barrier: training trajectories whose next turn waits for the others'
        self._held: list[RolloutRecord] = []
        self.ahead = LookAheads(cfg.rollout.lookahead and not cfg.rollout.env_barrier,
                                self.live, self._cohorts, self.faults)
        # places and submits the turns; evaluation episodes decode greedily (their best answer)
        self.dispatch = TurnDispatch(cfg, pool_workers, self.placer, self.tasks, self.ahead,
                                     self.live, self._cohorts, run_id, self.sampling,
                                     sampling_params(cfg, greedy=True))

    @property
    def waiting(self) -> int:
        """Trajectories whose next turn is ready and not yet submitted (a pool without a
        worker holds them back)."""
        return len(self._ready)

    def state(self) -> dict:
        """The trajectory ids to continue from (a checkpoint's driver state)."""
        return self.ids.state()

    def restore(self, state: dict) -> None:
        self.ids.restore(state)

    def stop(self, reason: DropReason = DropReason.RUN_ENDED) -> None:
        """Training is over: every rolling-out training trajectory ends after its current turn
        (evaluation episodes run to their end); those waiting for their next turn (a restart
        waiting for a pool's worker included) end now with ``reason``, their environments
        closed."""
        self.stopping = True
        for waiting in (self._ready, self._held):
            ended = [rec for rec in waiting if not rec.evaluation]
            waiting[:] = [rec for rec in waiting if rec.evaluation]
            for rec in ended:
                self.close_env(rec)
                self._drop(rec, reason, "training ended before its next turn")

    # -- submission -------------------------------------------------------------------------
    def replace_env(self, env_task: str, env_spec: dict) -> None:
        """The environment (a component spec, faults included) of ``env_task``'s trajectories
        started from now on."""
        if env_task not in self.env_specs:
            raise KeyError(f"no env task {env_task!r}; env tasks: {sorted(self.env_specs)}")
        self.env_specs[env_task] = env_spec

    def start(self, group_id: str, env_task: EnvTaskConfig, seed: int,
              eval_round: int | None = None, traj_id: int | None = None) -> None:
        """Admit a new trajectory; its first turn goes with the next :meth:`flush`.
        ``traj_id``: one taken from another driver's ``ids`` (the rollout shards number their
        trajectories from shard 0's driver, so that ids never repeat)."""
        tid = self.ids.take(eval_round is not None) if traj_id is None else traj_id
        rec = RolloutRecord(tid, group_id, env_task, seed, eval_round=eval_round)
        self.ledger.admit(rec.traj_id, rec.evaluation)
        self.live[rec.traj_id] = rec
        self._restart(rec)

    def _restart(self, rec: RolloutRecord) -> None:
        """From a fresh environment: a reset, then the first turn."""
        self.ledger.transition(rec.traj_id, TrajState.ROLLING_OUT)
        rec.env_worker = rec.handle = rec.next_obs = None  # placed when submitted
        self._ready.append(rec)

    def flush(self) -> list[Future]:
        """Submit every ready turn, the continuations of members a stage left running and the
        look-ahead turns (:meth:`flows.training.dispatch.TurnDispatch.flush`); the futures (one
        env_step per cohort) are what to wait on."""
        self._release_barrier()  # the one place: whatever ended or dropped since counts
        ready, self._ready = self._ready, []
        resumes, self._resumes = self._resumes, {}
        futures, self._ready = self.dispatch.flush(ready, resumes, self.stopping)
        return futures

    # -- faults -----------------------------------------------------------------------------
    def worker_lost(self, worker: str) -> tuple[list[Future], TurnOutcome]:
        """``worker`` left the cluster: the cohorts that needed it are abandoned (their
        futures, returned, are for the caller to cancel; their members restart or drop when
        they come back), and the waiting trajectories whose environment or cache lived there
        restart now (or drop, in the outcome)."""
        detail, lost = self.faults.worker_lost(worker, self._cohorts)
        self.tasks.forget_closes_on(worker)
        out = TurnOutcome()
        for phase_handle, members in list(self._resumes.items()):
            if strands_resume(worker, members[0][0]):
                del self._resumes[phase_handle]
                for rec, _ in members:
                    self.dispatch.finished(rec)
                    self._member_failed(rec, detail, out, DropReason.WORKER_LOST)
        waiting, self._ready = self._ready, []
        held, self._held = self._held, []
        for recs, keep in ((waiting, self._ready), (held, self._held)):
            for rec in recs:
                if strands_waiting(worker, rec):
                    self._member_failed(rec, detail, out, DropReason.WORKER_LOST)
                else:
                    keep.append(rec)
        return lost, out

    def overdue(self, timeout_s: float | None) -> list[Future]:
        """The cohorts whose turn has not answered within ``timeout_s`` (the watchdog): each
        is abandoned with a warning naming the environment or stage that stopped answering;
        their futures are for the caller to cancel."""
        return self.faults.overdue(self._cohorts, self.live, timeout_s)

    # -- completion -------------------------------------------------------------------------
    def on_turn(self, fut: Future, results: list | None) -> TurnOutcome:
        """A cohort's env_step finished: ``results`` holds each member's observation or
        :class:`tasks.cohort.MemberError` (None: the whole cohort failed or was lost)."""
        cohort = self._cohorts.pop(fut.key)
        now = time.time()
        for rec in self.ahead.closes_due(fut.key):
            self._close_now(rec)
        results, reason = self.faults.results(fut, results, len(cohort.traj_ids))
        out = TurnOutcome()
        for tid, res in zip(cohort.traj_ids, results, strict=True):
            rec = self.live.get(tid)
            if rec is None or rec.turn_step is None or rec.turn_step[0].key != fut.key:
                # a look-ahead turn: its answer waits for the turn before, or is ignored
                self.ahead.answered(cohort, tid, res, reason)
                continue
            self._member_result(rec, cohort, res, reason, now, out)
        return out

    def _member_result(self, rec: RolloutRecord, cohort: Cohort, res: object,
                       reason: DropReason, now: float, out: TurnOutcome) -> None:
        """The answer of ``rec``'s turn in flight (a member of ``cohort``)."""
        if isinstance(res, Deferred):  # still running there: continued with the next flush
            self.ahead.void(rec)
            self._resumes.setdefault((res.phase, res.handle), []).append((rec, res.index))
            self.timings.deferred(trajectory_key(rec.traj_id, rec.attempt), cohort.suffix,
                                  res.phase.value)
            return
        self.dispatch.finished(rec)
        if isinstance(res, Ended):  # cannot happen: it went ahead only as the episode went on
            res = MemberError("Ended: a turn ran after the end of its episode")
        if isinstance(res, MemberError):
            self._member_failed(rec, res.error, out, reason)
            return
        rec.env_reset = None
        timing = self.timings.turn(
            trajectory_key(rec.traj_id, rec.attempt), rec.turn, cohort.submitted, now,
            (rec.env_worker, rec.prefill_worker, rec.decode_worker), cohort.suffix, res)
        self.turns.record(rec, res, cohort, now, [leg for leg, _stage in timing.legs])
        self.placer.turn_done(rec.env_task.name, res, rec.last_shape, rec.turn == 0)
        self._member_stepped(rec, res, out, now)

    def _promote(self, rec: RolloutRecord, now: float, out: TurnOutcome) -> None:
        """``rec``'s look-ahead turn becomes its turn in flight; its answer, if it came back
        first, is taken now."""
        cohort, early = self.ahead.promote(rec, now)
        self.dispatch.started(rec)
        if early is not None:
            self._member_result(rec, cohort, *early, now, out)

    def _member_stepped(self, rec: RolloutRecord, obs: EnvObservation, out: TurnOutcome,
                        now: float) -> None:
        self.faults.stepped()
        rec.record_turn(obs)
        over, context_limited = turn_ends(rec, obs, self.sampling[rec.env_task.name]
                                          .max_new_tokens, self.cfg.policy.max_context)
        if over:
            self.placer.lengths.finished(rec.env_task.name, rec.turn)
            if context_limited and not obs.done:
                self.close_env(rec)
            self.ahead.void(rec)
            if context_limited:
                self.truncated["context"] += 1
            elif obs.truncated:
                self.truncated["max_turns"] += 1
            del self.live[rec.traj_id]
            self.ledger.transition(rec.traj_id, TrajState.EVALUATED if rec.evaluation
                                   else TrajState.AWAITING_SCORE)
            out.finished.append((rec, rec.to_trajectory(obs, context_limited)))
        elif self.stopping and not rec.evaluation:  # run over: this turn was the last
            self.close_env(rec)
            self._drop(rec, DropReason.RUN_ENDED)
            out.dropped.append(rec)
        else:
            rec.next_obs = obs
            if rec.ahead is not None:  # its next turn is on its way already
                self._promote(rec, now, out)
            else:
                (self._held if self.cfg.rollout.env_barrier and not rec.evaluation
                 else self._ready).append(rec)

    def _release_barrier(self) -> None:
        """Batch-level environment handling (a baseline): the held turns go on together once
        every live training trajectory is held, none with a turn in flight, continuing, or
        still to submit (a restart from its first turn, a turn waiting for a pool's worker)."""
        if self._held and len(self._held) == sum(not r.evaluation for r in self.live.values()):
            self._ready.extend(self._held)
            self._held = []

    def _member_failed(self, rec: RolloutRecord, error: str, out: TurnOutcome,
                       reason: DropReason = DropReason.ROLLOUT_ERROR) -> None:
        """A turn failed (task error, worker lost, timed out). Restart the trajectory from a
        fresh environment while attempts remain, else drop it with ``reason`` (the faults
        decide, :meth:`flows.training.rollout_faults.RolloutFaults.failed`)."""
        self.close_env(rec)
        self.ahead.void(rec)
        if self.faults.failed(rec, error, reason, self.stopping):
            rec.attempt += 1
            rec.reset_record()
            self._restart(rec)
            return
        self._drop(rec, reason, error[:200])
        out.dropped.append(rec)

    def _drop(self, rec: RolloutRecord, reason: DropReason, detail: str = "") -> None:
        self.ahead.void(rec)
        del self.live[rec.traj_id]
        self.ledger.drop(rec.traj_id, reason, detail)

    def holds(self, worker: str) -> bool:
        """Live trajectories have environment instances on ``worker`` (or closes pending)."""
        return (any(r.env_worker == worker for r in self.live.values())
                or self.ahead.holds(worker)
                or self.tasks.closing_on(worker))

    def close_env(self, rec: RolloutRecord) -> Future | None:
        """Close the live environment instance of an ended or dropped trajectory."""
        if self.ahead.close_after(rec):  # after its look-ahead turn, which may still step it
            return None
        return self._close_now(rec)

    def _close_now(self, rec: RolloutRecord) -> Future | None:
        if rec.handle is None or self.faults.is_lost(rec.handle.worker):
            return None  # never placed, or lost with its worker
        return self.tasks.close_env(rec)

    def close_all(self) -> None:
        """An aborted run: close every live trajectory's environment instance; nothing more is
        submitted."""
        self._ready, self._held, self._resumes = [], [], {}
        for rec in self.ahead.clear() + list(self.live.values()):
            self.ahead.void(rec)
            self._close_now(rec)
            rec.handle = None
