"""A turn's Dask tasks: ``env_reset`` (a fresh trajectory) -> ``prefill`` -> ``decode`` ->
``env_step`` for a cohort of trajectories that share their workers, each pinned to its worker
with one slot of its stage's resource; and the environment closes of ended trajectories.

Futures are the tasks' arguments, so the cache handle moves worker to worker and never through
the driver, which waits on the cohort's ``env_step`` alone. Keys are
``"{stage}-{trajectory}-{turn}-{attempt}"`` for a single trajectory and
``"{stage}-c{cohort}-{members}-0"`` for a cohort, each ending with the run's key tag.
:class:`flows.training.rollout.RolloutDriver` decides what to submit; this submits it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from distributed import Client, Future, wait

from flows.monitoring.monitor import StageSpans
from flows.training.episode import RolloutRecord
from flows.training.orchestration import decode_seed
from resources.pools import Stage, Tag, submit_on
from resources.worker import with_backend, with_envs, with_registry
from tasks.cohort import close_after, decode_many, env_reset_many, env_step_many, prefill_many
from tasks.records import SamplingParams, TurnShape
from tasks.stages import Stages

logger = logging.getLogger(__name__)

MIXED_SPAN = "mixed"  # the span of a cohort holding several env tasks


@dataclass(frozen=True)
class CohortKey:
    """What the members of one cohort share: a fresh start or not, and their workers."""
    fresh: bool
    env_task: str | None  # with rollout.cohort_per_env_task
    env_worker: str
    prefill_worker: str
    prefill_tag: Tag
    decode_worker: str
    decode_tag: Tag


@dataclass
class Cohort:
    """One cohort's turn in flight."""
    traj_ids: list[int]
    suffix: str  # of its tasks' keys
    submitted: float  # wall clock
    step: Future  # its env_step: what the driver waits on
    decode: Future
    workers: frozenset[str]  # every worker it runs on or reads a cache from
    env_task: str


class TurnTasks:
    """Submits the turns' and the closes' tasks of one rollout driver; counts them by stage."""

    def __init__(self, client: Client, stages: Stages, spans: StageSpans, key_tag: str,
                 run_seed: int, system_prompt: str | None, env_specs: dict[str, dict]):
        """``env_specs``: each env task's environment (the driver's table, which
        ``replace_env`` changes in place)."""
        self.client, self.stages, self.spans, self.key_tag = client, stages, spans, key_tag
        self.run_seed, self.system_prompt, self.env_specs = run_seed, system_prompt, env_specs
        self.submitted: dict[str, int] = {}  # tasks by stage
        self._next_cohort = 0
        self._closing: list[Future] = []  # env closes, held until done
        self._close_worker: dict[str, str] = {}  # close key -> its worker

    def _submit(self, stage: Stage, adapter, fn, *args, worker: str, key: str, env_task: str,
                tag: Tag | None = None) -> Future:
        self.submitted[stage.value] = self.submitted.get(stage.value, 0) + 1
        with self.spans(env_task, stage.value):
            return submit_on(self.client, worker, stage, adapter, fn, *args, key=key, tag=tag)

    def cohort(self, key: CohortKey, recs: list[RolloutRecord], shapes: list[TurnShape | None],
               params: list[SamplingParams]) -> Cohort:
        """env_reset (new trajectories) -> prefill -> decode -> env_step, for the members."""
        # the span of the cohort's tasks: its env task, or "mixed" when it holds several
        env_task = recs[0].env_task.name
        if any(r.env_task.name != env_task for r in recs):
            env_task = MIXED_SPAN
        if len(recs) == 1:
            r = recs[0]
            suffix = f"{r.traj_id}-{r.turn}-{r.attempt}{self.key_tag}"
        else:
            suffix = f"c{self._next_cohort}-{len(recs)}-0{self.key_tag}"
        self._next_cohort += 1
        st = self.stages
        reset = None
        if key.fresh:
            reset = self._submit(
                Stage.ENV_RESET, with_envs, env_reset_many, st.env_reset,
                [self.env_specs[r.env_task.name] for r in recs], [r.seed for r in recs],
                [r.handle.instance_id for r in recs], self.system_prompt,
                worker=key.env_worker, key=f"env_reset-{suffix}", env_task=env_task)
            observations = [(reset, i) for i in range(len(recs))]
        else:
            observations = [r.next_obs for r in recs]
        pasts = [r.last_decode for r in recs]
        pre = self._submit(Stage.PREFILL, with_backend, prefill_many, st.prefill, pasts,
                           observations, shapes, worker=key.prefill_worker, tag=key.prefill_tag,
                           key=f"prefill-{suffix}", env_task=env_task)
        seeds = [decode_seed(self.run_seed, r.traj_id, r.turn, r.attempt) for r in recs]
        dec = self._submit(Stage.DECODE, with_backend, decode_many, st.decode, pre, pasts,
                           params, seeds, shapes, worker=key.decode_worker, tag=key.decode_tag,
                           key=f"decode-{suffix}", env_task=env_task)
        step = self._submit(Stage.ENV_STEP, with_envs, env_step_many, st.env_step, st.response,
                            observations, dec, worker=key.env_worker, key=f"env_step-{suffix}",
                            env_task=env_task)
        # the workers holding the members' caches so far are needed too
        workers = {key.env_worker, key.prefill_worker, key.decode_worker} | {
            r.kv_worker for r in recs if r.kv_worker}
        for i, r in enumerate(recs):
            r.last_decode = (dec, i)  # the member's cache: element i of the cohort's decode
            r.kv_worker = key.decode_worker
            r.env_reset = reset  # until the turn comes back, a close must wait for it
        return Cohort([r.traj_id for r in recs], suffix, time.time(), step, dec,
                      frozenset(workers), env_task)

    # -- environment closes ------------------------------------------------------------------
    def close_env(self, rec: RolloutRecord) -> Future:
        """Close the live environment instance of an ended or dropped trajectory (after its
        reset, if that is still running)."""
        fut = self._submit(Stage.ENV_CLOSE, with_registry, close_after, self.stages.env_close,
                           rec.handle, rec.env_reset, worker=rec.handle.worker,
                           env_task=rec.env_task.name,
                           key=f"env_close-{rec.traj_id}-{rec.turn}-{rec.attempt}"
                               f"{self.key_tag}")
        self._closing.append(fut)  # held until done: a released future may never run
        self._close_worker[fut.key] = rec.handle.worker
        return fut

    def closing_on(self, worker: str) -> bool:
        return any(w == worker for w in self._close_worker.values())

    def forget_closes_on(self, worker: str) -> None:
        """``worker`` left: closes aimed at it will never run, and the end of the run must not
        wait for them."""
        self._closing = [f for f in self._closing if self._close_worker.get(f.key) != worker]

    def prune_closing(self) -> None:
        """Forget closes that ran."""
        self._closing = [f for f in self._closing if not f.done()]
        self._close_worker = {f.key: self._close_worker[f.key] for f in self._closing}

    def wait_closing(self, timeout: float = 60) -> None:
        try:
            wait(self._closing, timeout=timeout)
        except TimeoutError:
            logger.warning("%d environment closes did not finish", len(self._closing))
        failed = [f for f in self._closing if f.status == "error"]
        if failed:
            logger.warning("%d environment closes failed, the first with %r", len(failed),
                           failed[0].exception())


class TurnLog:
    """The turns that came back: running totals always, each turn only with
    ``metrics.task_stream`` (a long run's log would grow without end)."""

    def __init__(self, keep_each: bool, time_scale: float):
        self.keep_each, self.time_scale = keep_each, time_scale
        # per turn: its tasks' key suffix, (submitted, answered) wall-clock times, the emulated
        # waits within, and "trajectory-attempt": the benchmark subtracts the tasks' compute
        # intervals to get the orchestration overhead
        self.each: list[tuple[str, float, float, float, str]] = []
        self.totals = [0, 0.0, 0.0]  # turns, wall seconds, emulated-wait seconds
        self.env_seconds = 0.0  # environment step time, summed

    def record(self, rec: RolloutRecord, obs, cohort: Cohort, now: float) -> None:
        """``obs``: the member's :class:`tasks.records.EnvObservation` of this turn."""
        self.env_seconds += obs.step_seconds
        remote = float(obs.info.get("remote_latency_s", 0.0)) * self.time_scale
        waited = obs.sample.emulated_wait_s + remote
        self.totals[0] += 1
        self.totals[1] += now - cohort.submitted
        self.totals[2] += waited
        if self.keep_each:
            self.each.append((cohort.suffix, cohort.submitted, now, waited,
                              f"{rec.traj_id}-{rec.attempt}"))
