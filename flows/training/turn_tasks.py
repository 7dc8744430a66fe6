"""A turn's Dask tasks: ``env_reset`` (a fresh trajectory) -> ``prefill`` -> ``decode`` ->
``env_step`` for a cohort of trajectories that share their workers, each pinned to its worker
with one slot of its stage's resource; and the environment closes of ended trajectories.

Futures are the tasks' arguments, so the cache handle moves worker to worker and never through
the driver, which waits on the cohort's ``env_step`` alone. A *look-ahead* cohort is the members'
next turn, submitted while their turn is in flight: it reads that turn's ``env_step`` and
``decode`` results as futures, so Dask starts it the moment they exist, without the driver's
round trip; a member whose episode that turn ended does nothing in it
(:class:`tasks.cohort.Ended`). Members a stage left running in the
background (:mod:`tasks.cohort`) come back as markers; :meth:`TurnTasks.cohort` with a
:class:`Resume` continues them: a ``collect`` on the worker running them (its key carries the
stage's name, so the dashboard shows it as that stage), then the later stages. Keys are
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
from flows.monitoring.step_timings import joined_legs, trajectory_key
from flows.training.episode import RolloutRecord
from flows.training.orchestration import decode_seed
from resources.pools import Stage, Tag, submit_on
from resources.worker import plain, with_backend, with_envs, with_registry
from tasks.cohort import (
    Phase,
    by_source,
    close_after,
    collect,
    decode_many,
    env_reset_many,
    env_step_many,
    prefill_many,
)
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


@dataclass(frozen=True)
class Resume:
    """A continuation of members a stage left running: ``phase`` under ``handle`` on its
    worker, each member at its index there."""
    phase: Phase
    handle: str
    indices: list[int]


# a turn's stages in order, with the Dask stage of each
PHASES = (Phase.ENV_RESET, Phase.PREFILL, Phase.DECODE, Phase.ENV_STEP)
PHASE_STAGE = {Phase.ENV_RESET: Stage.ENV_RESET, Phase.PREFILL: Stage.PREFILL,
               Phase.DECODE: Stage.DECODE, Phase.ENV_STEP: Stage.ENV_STEP}


@dataclass
class Cohort:
    """One cohort's turn in flight (or the continuation of some of its members)."""
    traj_ids: list[int]
    suffix: str  # of its tasks' keys
    submitted: float  # wall clock, of the turn (a continuation keeps its members' turn's)
    step: Future  # its env_step: what the driver waits on
    decode: Future | None  # None: a continuation past its decode
    workers: frozenset[str]  # every worker it runs on or reads a cache from
    env_task: str
    key: CohortKey | None = None
    # a look-ahead turn's prefill, held: cancelling the turn before also cancels its dependent
    # tasks, and Dask's scheduler (distributed 2026.8) fails on a dependent no client wants
    # (``assert ts.who_wants`` in ``Scheduler.stimulus_cancel``), which ends the client's
    # connection
    prefill: Future | None = None
    # a look-ahead turn, not yet any member's turn in flight (the driver makes it theirs when
    # the turn before comes back; the watchdog leaves it alone until then)
    ahead: bool = False


def _workers(key: CohortKey, recs: list[RolloutRecord]) -> frozenset[str]:
    """Every worker a cohort runs on, and those holding its members' caches so far."""
    return frozenset({key.env_worker, key.prefill_worker, key.decode_worker}
                     | {r.kv_worker for r in recs if r.kv_worker})


class TurnTasks:
    """Submits the turns' and the closes' tasks of one rollout driver; counts them by stage."""

    def __init__(self, client: Client, stages: Stages, spans: StageSpans, key_tag: str,
                 run_seed: int, system_prompt: str | None, env_specs: dict[str, dict],
                 grace_s: float | None = None):
        """``env_specs``: each env task's environment (the driver's table, which
        ``replace_env`` changes in place); ``grace_s``: how long a stage holds a finished
        member for its mates (None: until every member is done, a barrier)."""
        self.client, self.stages, self.spans, self.key_tag = client, stages, spans, key_tag
        self.grace_s = grace_s
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
               params: list[SamplingParams], resume: Resume | None = None,
               ahead: bool = False) -> Cohort:
        """env_reset (new trajectories) -> prefill -> decode -> env_step, for the members; or,
        with ``resume``, a ``collect`` of the stage they were left running, then the rest;
        or, ``ahead``, prefill -> decode -> env_step of the turn after the members' turn in
        flight, reading its results (the members' records are left as they are: the driver
        makes it their turn when the one before comes back)."""
        # the span of the cohort's tasks: its env task, or "mixed" when it holds several
        env_task = recs[0].env_task.name
        if any(r.env_task.name != env_task for r in recs):
            env_task = MIXED_SPAN
        if len(recs) == 1 and resume is None and not ahead:
            r = recs[0]
            suffix = f"{r.traj_id}-{r.turn}-{r.attempt}{self.key_tag}"
        else:  # (a look-ahead turn may be given up and its turn submitted again: a key of its own)
            suffix = f"c{self._next_cohort}-{len(recs)}-0{self.key_tag}"
        self._next_cohort += 1
        if ahead:
            return self._ahead(key, recs, shapes, params, suffix, env_task)
        if resume is None:  # a new turn: what it reads, kept for its continuations
            now = time.time()
            for r in recs:
                r.turn_key, r.turn_past, r.turn_submitted = key, r.last_decode, now
                r.turn_obs = r.next_obs
        first = (resume.phase if resume else Phase.ENV_RESET if key.fresh else Phase.PREFILL)
        runs = set(PHASES[PHASES.index(first):])
        workers = {Phase.ENV_RESET: (key.env_worker, None),
                   Phase.PREFILL: (key.prefill_worker, key.prefill_tag),
                   Phase.DECODE: (key.decode_worker, key.decode_tag),
                   Phase.ENV_STEP: (key.env_worker, None)}

        def submit(phase: Phase, adapter, fn, *args) -> Future:
            worker, tag = workers[phase]
            stage = PHASE_STAGE[phase]
            if resume is not None and phase is resume.phase:
                adapter, fn, args = plain, collect, (resume.handle, resume.indices, phase,
                                                     self.grace_s or 0.0)
            else:
                args = (*args, self.grace_s)
            return self._submit(stage, adapter, fn, *args, worker=worker, tag=tag,
                                key=f"{stage}-{suffix}", env_task=env_task)

        st = self.stages
        if Phase.ENV_RESET in runs:
            reset = submit(Phase.ENV_RESET, with_envs, env_reset_many, st.env_reset,
                           [self.env_specs[r.env_task.name] for r in recs],
                           [r.seed for r in recs], [r.handle.instance_id for r in recs],
                           self.system_prompt)
            for i, r in enumerate(recs):
                r.turn_obs = (reset, i)
                r.env_reset = reset  # until the turn comes back, a close must wait for it
        observations = by_source([r.turn_obs for r in recs])
        pasts = by_source([r.turn_past for r in recs])
        dec = None
        if Phase.DECODE in runs:
            pre = None
            if Phase.PREFILL in runs:
                pre = submit(Phase.PREFILL, with_backend, prefill_many, st.prefill, pasts,
                             observations, shapes)
            seeds = [decode_seed(self.run_seed, r.traj_id, r.turn, r.attempt) for r in recs]
            dec = submit(Phase.DECODE, with_backend, decode_many, st.decode, pre, pasts,
                         params, seeds, shapes)
            for i, r in enumerate(recs):
                r.last_decode = (dec, i)  # the member's cache: element i of the decode
                r.kv_worker = key.decode_worker
        step = submit(Phase.ENV_STEP, with_envs, env_step_many, st.env_step, st.response,
                      observations, dec)
        for i, r in enumerate(recs):
            r.turn_step = (step, i)
        return Cohort([r.traj_id for r in recs], suffix, recs[0].turn_submitted, step, dec,
                      _workers(key, recs), env_task, key)

    def _ahead(self, key: CohortKey, recs: list[RolloutRecord], shapes: list[TurnShape | None],
               params: list[SamplingParams], suffix: str, env_task: str) -> Cohort:
        """The members' next turn, on the workers of their turn in flight, reading its
        observation (``turn_step``) and cache (``last_decode``)."""
        st = self.stages

        def submit(stage: Stage, adapter, fn, *args, worker: str, tag: Tag | None = None):
            return self._submit(stage, adapter, fn, *args, self.grace_s, worker=worker, tag=tag,
                                key=f"{stage}-{suffix}", env_task=env_task)

        observations = by_source([r.turn_step for r in recs])
        pasts = by_source([r.last_decode for r in recs])
        pre = submit(Stage.PREFILL, with_backend, prefill_many, st.prefill, pasts, observations,
                     shapes, worker=key.prefill_worker, tag=key.prefill_tag)
        seeds = [decode_seed(self.run_seed, r.traj_id, r.turn + 1, r.attempt) for r in recs]
        dec = submit(Stage.DECODE, with_backend, decode_many, st.decode, pre, pasts, params,
                     seeds, shapes, worker=key.decode_worker, tag=key.decode_tag)
        step = submit(Stage.ENV_STEP, with_envs, env_step_many, st.env_step, st.response,
                      observations, dec, worker=key.env_worker)
        return Cohort([r.traj_id for r in recs], suffix, time.time(), step, dec,
                      _workers(key, recs), env_task, key, prefill=pre, ahead=True)

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


@dataclass(frozen=True)
class TurnWork:
    """What one finished turn asked of the devices and the environment, in the lengths the
    driver submitted (a :class:`tasks.records.TurnShape`'s virtual tokens; the real ones
    without a shape): the work a benchmark's lower bound prices."""

    trajectory: str  # "trajectory-attempt"
    turn: int
    env_task: str
    prompt_tokens: int  # new tokens the prefill read
    cached_tokens: int  # context before them (the trajectory's earlier turns)
    response_tokens: int  # tokens the decode generated
    env_latency_s: float  # the environment step's remote latency, emulated (unscaled) seconds

    @classmethod
    def of(cls, rec: RolloutRecord, obs) -> TurnWork:
        """The turn ``rec`` just finished with ``obs`` (before ``rec`` records it)."""
        shape: TurnShape | None = rec.last_shape
        if shape is not None:
            prompt, response, cached = (shape.prompt_tokens, shape.response_tokens,
                                        rec.virtual_tokens)
        else:
            prompt, response = len(obs.consumed_ids), len(obs.sample.token_ids)
            cached = len(rec.tokens)
        return cls(trajectory_key(rec.traj_id, rec.attempt), rec.turn, rec.env_task.name, prompt,
                   cached, response, float(obs.info.get("remote_latency_s", 0.0)))


class TurnLog:
    """The turns that came back: running totals always, each turn only with
    ``metrics.task_stream`` (a long run's log would grow without end)."""

    def __init__(self, keep_each: bool, time_scale: float):
        self.keep_each, self.time_scale = keep_each, time_scale
        # per turn: its cohorts' key suffixes (step_timings.joined_legs), (submitted, answered)
        # wall-clock times, the emulated waits within, and "trajectory-attempt": the benchmark
        # subtracts the tasks' compute intervals to get the orchestration overhead
        self.each: list[tuple[str, float, float, float, str]] = []
        self.work: list[TurnWork] = []  # per turn, in the order of ``each``
        self.totals = [0, 0.0, 0.0]  # turns, wall seconds, emulated-wait seconds
        self.env_seconds = 0.0  # environment step time, summed

    def record(self, rec: RolloutRecord, obs, cohort: Cohort, now: float,
               suffixes: list[str]) -> None:
        """``obs``: the member's :class:`tasks.records.EnvObservation` of this turn;
        ``suffixes``: the key suffixes of every cohort it went through in this turn."""
        self.env_seconds += obs.step_seconds
        remote = float(obs.info.get("remote_latency_s", 0.0)) * self.time_scale
        waited = obs.sample.emulated_wait_s + remote
        self.totals[0] += 1
        self.totals[1] += now - cohort.submitted
        self.totals[2] += waited
        if self.keep_each:
            self.each.append((joined_legs(suffixes), cohort.submitted, now, waited,
                              trajectory_key(rec.traj_id, rec.attempt)))
            self.work.append(TurnWork.of(rec, obs))
