"""Rollout sharded over several Dask schedulers (``cluster.shards``): a scale remedy.

One scheduler caps how many tasks per second the rollout can generate (each task costs about a
millisecond of scheduler time, whatever it computes). With ``cluster.shards: N`` the run has N
local clusters, each with its own scheduler. Shard 0 is the run's cluster as without shards
(every pool: inference, environments, trainer, reward bursts); each further shard holds its
own copy of the rollout pools only (the inference pools and the environment pool, tagged by
the same affinity routing, with the same worker plugin). One driver process spreads whole
groups over the shards (:func:`flows.training.orchestration.pick_shard`: the most free room).

- one of each, in the driver: the trajectory ledger, the group draw and collector, reward
  bursts (shard 0's SERVERLESS pool), the trainer (shard 0), admission control (its pool
  slots are the sum over shards; the ledger counts every shard's trajectories);
- per shard: a client, a :class:`~flows.training.orchestration.PoolWorkers`, a
  :class:`~flows.training.rollout.RolloutDriver` (trajectory ids all taken from shard 0's, task keys
  tagged with the shard) and an :class:`~flows.training.events.EventLoop`; the loops share one wake-up
  condition, so the driver waits on all of them at once;
- weights: after a train step the snapshot is published on the trainer (shard 0) as without
  shards; the driver gathers it once (a ``PUBLISH`` event), scatters it to one inference worker
  of each further shard, and every inference worker there loads it from that worker. These
  loads count as loads in flight (``mode=sync`` waits for them).

Workers leaving and joining a further shard are handled as on shard 0: a departed worker's
turns are abandoned and their trajectories restarted or dropped with the reason, its weight
loads given up; a joining inference worker loads the newest weights there before it gets work
(or with the next version, when those weights were lost with their worker); a rollout pool of
a further shard left empty for ``cluster.pool_empty_timeout_s`` stops the run. Not handled
beyond shard 0 yet: workers that advertise hardware instead of tags, the adaptive environment
pool, colocated time-sharing (``placement=monolithic`` on emulated devices),
evaluation episodes, the dashboard page, Dask spans and the performance report. Several
``--scheduler`` addresses are not supported: shards are local clusters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from distributed import Future

from flows.config import EnvTaskConfig, TrainConfig
from flows.config.derived import effective_pools, tls_security
from flows.monitoring.monitor import StageSpans
from flows.training.events import Event, EventLoop, FutureKind, next_batch_of
from flows.training.lifecycle import TrajectoryLedger
from flows.training.orchestration import PoolWorkers, pick_shard
from flows.training.rollout import RolloutDriver
from resources.cluster import ClusterHandle, start_local_cluster
from resources.device_model import DeviceModel
from resources.hardware import PoolRouter
from resources.membership import Change, MembershipWatch, WorkerChange
from resources.placement import install_recorder, placement_snapshot
from resources.pools import Stage, Tag, submit_on
from resources.worker import with_backend, worker_report
from tasks.records import WeightsSnapshot
from tasks.stages import Stages

logger = logging.getLogger(__name__)

# the pools a further shard holds a copy of: what a rolling-out trajectory's turns use
ROLLOUT_TAGS = (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH, Tag.CPU_ENV)
INFERENCE_TAGS = (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH)


def rollout_slots(cluster: ClusterHandle) -> int:
    """Slots of a cluster's smallest rollout pool (at least 1): a rolling-out trajectory holds
    at most one task of each at a time."""
    return max(1, min(cluster.slots(t) for t in ROLLOUT_TAGS))


def start_rollout_shards(cfg: TrainConfig, tags_for: PoolRouter) -> list[ClusterHandle]:
    """The further shards of ``cluster.shards`` (none when it is 1): local clusters of the
    rollout pools of ``cfg``, tagged as shard 0's (the same affinity routing over the same
    pools, the trainer and reward tags left out). On a failure the ones started are closed."""
    if cfg.cluster.shards == 1:
        return []
    pools = effective_pools(cfg)
    routed = tags_for(pools)
    tags = {name: [t for t in ts if t in ROLLOUT_TAGS] for name, ts in routed.items()}
    pools = [p for p in pools if tags[p.name]]
    c, security = cfg.cluster, tls_security(cfg.cluster.tls)
    started: list[ClusterHandle] = []
    try:
        for k in range(1, c.shards):
            handle = start_local_cluster(pools, tags, c.dashboard_port, c.processes,
                                         c.startup_timeout_s, host=c.host, security=security,
                                         lost_worker_timeout_s=c.pool_empty_timeout_s,
                                         worker_ttl_s=c.worker_ttl_s,
                                         stall_dump_s=c.stall_dump_s,
                                         heap_keep_mb=c.heap_keep_mb)
            logger.info("rollout shard %d: scheduler %s, dashboard %s", k,
                        handle.client.scheduler.address, handle.dashboard_link)
            started.append(handle)
    except BaseException:
        close_shards(started)
        raise
    return started


def close_shards(clusters: list[ClusterHandle]) -> None:
    """Close every shard's cluster, each even if another fails to close."""
    for handle in clusters:
        try:
            handle.close()
        except Exception as exc:  # the others go anyway
            logger.warning("rollout shard %s did not close cleanly: %s",
                           handle.dashboard_link, exc)


@dataclass
class RolloutShard:
    """One further shard: its cluster and the driver's parts that work on it."""

    index: int
    cluster: ClusterHandle
    driver: RolloutDriver
    events: EventLoop
    inference_workers: dict[str, Tag]  # worker -> the tag its weight loads take a slot of
    membership: MembershipWatch
    weights: Future | None = None  # the newest weights scattered here (held until replaced)
    weights_on: str | None = None  # the worker they were scattered to
    weights_version: int = 0
    # inference workers that joined, with their tags: they get work once they loaded weights
    joining: dict[str, list[str]] = field(default_factory=dict)


class RolloutShards:
    """Shard 0's rollout parts (the run's own driver and event loop) and the further shards'
    (none without ``cluster.shards``: then every call is shard 0's alone).

    The run asks it where a group goes (:meth:`start_group`), flushes and waits on every shard
    at once (:meth:`flush`, :meth:`next_batch`) and hands it published weights
    (:meth:`load_weights`)."""

    def __init__(self, clusters: list[ClusterHandle], cfg: TrainConfig, ledger: TrajectoryLedger,
                 stages: Stages, run_id: str, key_tag: str, primary: RolloutDriver,
                 primary_events: EventLoop, primary_cluster: ClusterHandle,
                 devices_of: Callable[[ClusterHandle], dict[str, DeviceModel] | None],
                 spans: StageSpans):
        self.primary, self.primary_events, self.primary_cluster = primary, primary_events, \
            primary_cluster
        self.stages, self.key_tag = stages, key_tag
        self.further: list[RolloutShard] = []
        for k, cluster in enumerate(clusters, start=1):
            for tag in ROLLOUT_TAGS:
                if not cluster.workers_with(tag):
                    raise RuntimeError(f"rollout shard {k}: no worker advertises {tag}")
            pool_workers = PoolWorkers({str(t): cluster.workers_with(t) for t in ROLLOUT_TAGS})
            # one table of environments for every shard: Run.update_env reaches them all
            driver = RolloutDriver(cluster.client, cfg, pool_workers, ledger, stages, run_id,
                                   devices=devices_of(cluster), spans=spans,
                                   key_tag=f"{key_tag}.s{k}", env_specs=primary.env_specs)
            compute = set(cluster.workers_with(Tag.GPU_COMPUTE))
            inference = {w: (Tag.GPU_COMPUTE if w in compute else Tag.GPU_BANDWIDTH)
                         for w in sorted(compute | set(cluster.workers_with(Tag.GPU_BANDWIDTH)))}
            events = EventLoop(cluster.client, shard=k, condition=primary_events.condition)
            self.further.append(RolloutShard(k, cluster, driver, events, inference,
                                            MembershipWatch(cluster.client)))
        self.groups = [0] * (len(self.further) + 1)  # groups started, per shard
        if clusters:
            logger.info("rollout over %d shards (schedulers): %s", len(self),
                        [c.client.scheduler.address for c in (primary_cluster, *clusters)])
            if cfg.cluster.adaptive_env.enabled:
                logger.warning("cluster.adaptive_env scales shard 0's environment pool only")

    def __len__(self) -> int:
        """How many shards: shard 0 and the further ones."""
        return 1 + len(self.further)

    @property
    def drivers(self) -> list[RolloutDriver]:
        """Every shard's rollout driver, shard 0's first."""
        return [self.primary] + [s.driver for s in self.further]

    @property
    def loops(self) -> list[EventLoop]:
        return [self.primary_events] + [s.events for s in self.further]

    def driver(self, shard: int) -> RolloutDriver:
        return self.primary if shard == 0 else self.further[shard - 1].driver

    def slots(self) -> int:
        """Pool slots over every shard: what admission control may fill."""
        return rollout_slots(self.primary_cluster) + sum(rollout_slots(s.cluster)
                                                         for s in self.further)

    # -- rollout ----------------------------------------------------------------------------
    def start_group(self, group_id: str, env_task: EnvTaskConfig, seed: int) -> int:
        """Start a whole group on the shard with the most free room; that shard's index."""
        # a shard missing a rollout pool has no room: its turns would wait for a worker
        slots = [rollout_slots(c) if all(d.pool_workers.has(str(t)) for t in ROLLOUT_TAGS) else 0
                 for c, d in zip([self.primary_cluster] + [s.cluster for s in self.further],
                                 self.drivers, strict=True)]
        k = pick_shard([len(d.live) for d in self.drivers], slots)
        self.groups[k] += 1
        driver = self.driver(k)
        for _ in range(env_task.group_size):
            driver.start(group_id, env_task, seed,
                         traj_id=None if k == 0 else self.primary.ids.take())
        return k

    def flush(self) -> None:
        """Submit every further shard's ready turns (shard 0's are the run's to flush)."""
        for s in self.further:
            for fut in s.driver.flush():
                s.events.track(fut, FutureKind.TURN)

    def empty(self) -> bool:
        return all(loop.empty() for loop in self.loops)

    def next_batch(self, wake: Callable[[], bool]) -> list[Event]:
        return next_batch_of(self.loops, wake=wake)

    def pending(self) -> list[Future]:
        return [f for loop in self.loops for f in loop.pending()]

    # -- workers leaving ---------------------------------------------------------------------
    def changes_pending(self) -> bool:
        return any(s.membership.pending() for s in self.further)

    def membership_changes(self) -> list[tuple[RolloutShard, WorkerChange]]:
        """The further shards' workers that left or joined since (the run's, and those with
        rollout tags), already on or off their shard's cluster: one that left is off its
        pool workers; one that joined is on them, or, an inference worker, waits for weights
        (:meth:`load_on`, :meth:`loaded`)."""
        out = []
        for s in self.further:
            for change in s.membership.take():
                worker = change.address
                if change.change is Change.LEFT:
                    if not s.cluster.remove_worker(worker):
                        continue  # not one of the run's workers
                    s.driver.pool_workers.remove(worker)
                    s.inference_workers.pop(worker, None)
                    s.joining.pop(worker, None)
                    if s.weights_on == worker:  # lost with it: the next version brings more
                        s.weights = s.weights_on = None
                else:
                    tags = {t: n for t, n in change.tags.items()
                            if n > 0 and t in {str(r) for r in ROLLOUT_TAGS}}
                    if not tags or worker in s.cluster.worker_tags:
                        continue
                    s.cluster.add_worker(worker, change.name, tags)
                    inference = next((t for t in INFERENCE_TAGS if str(t) in tags), None)
                    if inference is None:
                        s.driver.pool_workers.add(worker, list(tags))
                    else:
                        s.inference_workers[worker] = inference
                        s.joining[worker] = list(tags)
                out.append((s, change))
        return out

    def loaded(self, worker: str) -> RolloutShard | None:
        """``worker`` loaded weights: a joining inference worker gets work from now on (its
        shard), others change nothing (None)."""
        for s in self.further:
            tags = s.joining.pop(worker, None)
            if tags is not None:
                s.driver.pool_workers.add(worker, tags)
                return s
        return None

    def missing_pools(self) -> dict[int, list[Tag]]:
        """Each further shard's rollout tags that no serving worker carries now."""
        return {s.index: [t for t in ROLLOUT_TAGS if not s.driver.pool_workers.has(str(t))]
                for s in self.further}

    def close(self) -> None:
        """The run ends: stop following the further shards' workers."""
        for s in self.further:
            s.membership.close()

    # -- weights ----------------------------------------------------------------------------
    def setup(self, worker_plugin, snapshot: Future, timeout: float) -> dict[str, int]:
        """Install the run's worker plugin (and a placement recorder) on every further shard
        and load the weights of ``snapshot`` (published on shard 0's trainer) there: the
        version each inference worker loaded."""
        if not self.further:
            return {}
        for s in self.further:
            install_recorder(s.cluster.client)
            s.cluster.client.register_plugin(worker_plugin)
        return {w: f.result(timeout=timeout)
                for _, loads in self.load_weights(snapshot.result(timeout=timeout))
                for w, f in loads.items()}

    def load_weights(self, snapshot: WeightsSnapshot
                     ) -> list[tuple[EventLoop, dict[str, Future]]]:
        """``snapshot`` (gathered once from shard 0's trainer) scattered to one inference
        worker of each further shard, then loaded by every inference worker there (from that
        worker): per shard, its event loop and the load futures by worker."""
        out = []
        for s in self.further:
            if not s.inference_workers:
                continue
            s.weights_on = next(iter(s.inference_workers))
            key = f"weights-{snapshot.version}{s.driver.key_tag}"
            s.weights = s.cluster.client.scatter({key: snapshot}, workers=[s.weights_on],
                                                 hash=False)[key]
            s.weights_version = snapshot.version
            out.append((s.events, {w: self.load_on(s, w) for w in s.inference_workers}))
        return out

    def load_on(self, s: RolloutShard, worker: str) -> Future | None:
        """The shard's newest weights loaded on one of its inference workers (None: it has
        none now; they come with the next version)."""
        if s.weights is None:
            return None
        with s.driver.spans("trainer", Stage.LOAD_WEIGHTS.value):
            return submit_on(
                s.cluster.client, worker, Stage.LOAD_WEIGHTS, with_backend,
                self.stages.load_weights, s.weights, tag=s.inference_workers[worker],
                key=f"{Stage.LOAD_WEIGHTS}-{s.weights_version}-{worker}{s.driver.key_tag}")

    # -- report -----------------------------------------------------------------------------
    def live_envs(self) -> int:
        """Environment instances still alive on the further shards' workers."""
        return sum(r.get("envs", {}).get("live", 0) for s in self.further
                   for r in s.cluster.client.run(worker_report).values())

    def summary(self) -> list[dict]:
        """Per shard: its scheduler, groups started, rollout tasks submitted, and (further
        shards) the tasks its scheduler ran per stage and its workers' engine versions."""
        out = [{"shard": 0, "groups": self.groups[0],
                "rollout_tasks_submitted": dict(self.primary.tasks.submitted)}]
        if not self.further:  # the run's one scheduler
            return out
        out[0]["scheduler"] = self.primary_cluster.client.scheduler.address
        for s in self.further:
            client = s.cluster.client
            reports = client.run(worker_report)
            out.append({
                "shard": s.index, "scheduler": client.scheduler.address,
                "groups": self.groups[s.index],
                "rollout_tasks_submitted": dict(s.driver.tasks.submitted),
                "tasks_per_stage": {stage: sum(per_worker.values()) for stage, per_worker
                                    in sorted(client.run_on_scheduler(
                                        placement_snapshot).items())},
                "workers": {a: {"pool": s.cluster.worker_pool.get(a, a),
                                "version": r.get("engine", {}).get("version"),
                                "live_envs": r.get("envs", {}).get("live", 0)}
                            for a, r in sorted(reports.items())}})
        return out
