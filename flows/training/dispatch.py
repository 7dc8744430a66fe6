"""Ready turns to Dask: each placed on its workers, grouped into cohorts, submitted.

:class:`TurnDispatch` is the submitting half of :class:`flows.training.rollout.RolloutDriver`.
For every trajectory whose next turn is ready it places the environment of a fresh trajectory
(on the least-loaded ``CPU_ENV`` worker), draws the turn's virtual lengths
(:func:`flows.training.workload.turn_shape`) and places its prefill and decode
(:mod:`flows.training.turn_placement`); turns that share their workers, and a fresh start or
not, go as cohorts of at most ``rollout.cohort_max`` (:mod:`flows.training.turn_tasks` submits
them). It continues the members a stage left running, submits the look-ahead turns
(:mod:`flows.training.lookahead` chooses them), and counts each worker's turns in flight
(:class:`flows.training.orchestration.PoolWorkers`), which placement reads. The driver decides
what is ready; this decides where it runs.
"""

from __future__ import annotations

from distributed import Future

from flows.config import TrainConfig
from flows.training.episode import RolloutRecord
from flows.training.lookahead import LookAheads
from flows.training.orchestration import PoolWorkers
from flows.training.turn_placement import TurnPlacer, TurnPlan
from flows.training.turn_tasks import Cohort, CohortKey, Resume, TurnTasks
from flows.training.workload import turn_shape
from resources.pools import Tag
from tasks.cohort import Phase
from tasks.records import EnvHandle, EnvObservation, SamplingParams, TurnShape

# the members a stage left running, by (stage, handle), each with its index under the handle
Resumes = dict[tuple[Phase, str], list[tuple[RolloutRecord, int]]]


def workers_of(rec: RolloutRecord) -> set[str]:
    """The workers a trajectory's turn runs on."""
    return {rec.decode_worker, rec.prefill_worker, rec.env_worker}


class TurnDispatch:
    """Places and submits the turns of one driver's trajectories; registers each cohort in
    ``cohorts`` (by the key of its env_step), which the driver shares."""

    def __init__(self, cfg: TrainConfig, pool_workers: PoolWorkers, placer: TurnPlacer,
                 tasks: TurnTasks, ahead: LookAheads, live: dict[int, RolloutRecord],
                 cohorts: dict[str, Cohort], run_id: str,
                 sampling: dict[str, SamplingParams], eval_sampling: dict[str, SamplingParams]):
        self.cfg, self.pool_workers, self.placer, self.tasks = cfg, pool_workers, placer, tasks
        self.ahead, self.live, self.cohorts, self.run_id = ahead, live, cohorts, run_id
        # each env task's sampling; evaluation decodes greedily: the policy's best answer
        self.sampling, self.eval_sampling = sampling, eval_sampling

    def placeable(self, rec: RolloutRecord) -> bool:
        """Every pool the turn needs has a worker (else it waits for one to join)."""
        need = [Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH] + ([Tag.CPU_ENV] if rec.handle is None
                                                       else [])
        return all(self.pool_workers.has(str(t)) for t in need)

    def flush(self, ready: list[RolloutRecord], resumes: Resumes,
              stopping: bool) -> tuple[list[Future], list[RolloutRecord]]:
        """Submit the ``ready`` turns as cohorts of trajectories that share their workers, the
        continuations of ``resumes`` and the look-ahead turns
        (:meth:`flows.training.lookahead.LookAheads.chosen`; none once training is over,
        ``stopping``): the futures to wait on (one env_step per cohort), and the ready turns
        left waiting for a pool's worker."""
        waiting = []
        groups: dict[CohortKey, list[tuple[RolloutRecord, TurnShape | None]]] = {}
        for rec in ready:
            if not self.placeable(rec):
                waiting.append(rec)
                continue
            if rec.handle is None:  # a fresh environment, on the least-loaded CPU worker
                rec.env_worker = self.pool_workers.choose(Tag.CPU_ENV)
                rec.handle = EnvHandle(rec.env_worker, f"{self.run_id}.{rec.traj_id}.{rec.attempt}")
            shape = turn_shape(rec.env_task.shape, self.cfg.seed, rec.traj_id, rec.turn,
                               rec.attempt)
            rec.last_shape = shape
            plan = self._plan(rec, shape)
            rec.prefill_worker, rec.decode_worker = plan.prefill_worker, plan.decode_worker
            self.started(rec)
            env_task = rec.env_task.name if self.cfg.rollout.cohort_per_env_task else None
            key = CohortKey(rec.next_obs is None, env_task, rec.env_worker, plan.prefill_worker,
                            plan.prefill_tag, plan.decode_worker, plan.decode_tag)
            groups.setdefault(key, []).append((rec, shape))
        futures = self._continue(resumes)
        submitted = []
        for cohort in self._submit(groups):
            futures.append(cohort.step)
            submitted += [self.live[tid] for tid in cohort.traj_ids]
        ahead = self._submit({key: [(rec, None) for rec in recs] for key, recs in
                              self.ahead.chosen(submitted, stopping).items()}, ahead=True)
        self.ahead.submitted(ahead)
        return futures + [cohort.step for cohort in ahead], waiting

    def started(self, rec: RolloutRecord) -> None:
        """``rec``'s turn is in flight on its workers."""
        for w in workers_of(rec):
            self.pool_workers.started(w)

    def finished(self, rec: RolloutRecord) -> None:
        """``rec``'s turn in flight came back (or was given up)."""
        for w in workers_of(rec):
            self.pool_workers.finished(w)

    def _submit(self, groups: dict[CohortKey, list[tuple[RolloutRecord, TurnShape | None]]],
                ahead: bool = False) -> list[Cohort]:
        """Each group's members as cohorts of at most ``rollout.cohort_max``, registered;
        ``ahead``: their next turns (:meth:`TurnTasks.cohort`)."""
        size, cohorts = self.cfg.rollout.cohort_max, []
        for key, members in groups.items():
            for i in range(0, len(members), size):
                recs = [rec for rec, _ in members[i:i + size]]
                cohort = self.tasks.cohort(key, recs, [s for _, s in members[i:i + size]],
                                           self.params(recs), ahead=ahead)
                self.cohorts[cohort.step.key] = cohort
                cohorts.append(cohort)
        return cohorts

    def _continue(self, resumes: Resumes) -> list[Future]:
        """Submit the continuations of the members stages left running, on their workers."""
        futures = []
        for (phase, handle), members in resumes.items():
            recs = [rec for rec, _ in members]
            cohort = self.tasks.cohort(recs[0].turn_key, recs, [r.last_shape for r in recs],
                                       self.params(recs),
                                       Resume(phase, handle, [i for _, i in members]))
            self.cohorts[cohort.step.key] = cohort
            futures.append(cohort.step)
        return futures

    def params(self, recs: list[RolloutRecord]) -> list[SamplingParams]:
        """Each member's sampling: its env task's, greedy for an evaluation episode."""
        return [(self.eval_sampling if r.evaluation else self.sampling)[r.env_task.name]
                for r in recs]

    def _plan(self, rec: RolloutRecord, shape: TurnShape | None) -> TurnPlan:
        """Where the turn's prefill and decode run (:mod:`flows.training.turn_placement`); a
        reset's prompt is not known here, so the first turn splits."""
        prompt = (shape.prompt_tokens if shape is not None else len(rec.next_obs.input_ids)
                  if isinstance(rec.next_obs, EnvObservation) else None)
        context = rec.virtual_tokens if rec.env_task.shape is not None else len(rec.tokens)
        return self.placer.place(self.pool_workers, rec.env_task.name, rec.decode_worker,
                                 rec.decode_worker if rec.last_decode is not None else None,
                                 prompt, context)
