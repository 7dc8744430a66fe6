"""The trainer as the driver sees it: train steps, weight publication and loading, save, resume.

The trainer lives on the TRAINER worker (:class:`tasks.trainer.Trainer`, built there by the
worker plugin); inference backends live on the inference workers. Publishing weights is one task
on the trainer's worker; each inference worker then loads the snapshot worker to worker (the
driver never holds the weights), and each backend switches at its next safe point.
"""

from __future__ import annotations

from distributed import Client, Future

from flows.monitoring.monitor import StageSpans
from resources.cluster import ClusterHandle
from resources.pools import Stage, Tag, submit_on
from resources.worker import with_backend, with_trainer
from tasks.records import TrainBatch
from tasks.stages import Stages

# the longest the driver waits on one call to the trainer (a resume, a save): never for ever
TRAINER_CALL_TIMEOUT_S = 600


class TrainerHandle:
    def __init__(self, client: Client, cluster: ClusterHandle, stages: Stages,
                 spans: StageSpans | None = None, key_tag: str = ""):
        self.client, self.stages = client, stages
        self.key_tag = key_tag  # ends every key (see flows.training.rollout.RolloutDriver)
        self.spans = spans or StageSpans("run")
        # the trainer's worker; None while it is lost and no other worker carries the tag
        self.worker: str | None = cluster.workers_with(Tag.TRAINER)[0]
        compute = set(cluster.workers_with(Tag.GPU_COMPUTE))
        # every inference worker, with the tag its weight load takes a slot of
        self.inference_workers = {
            w: (Tag.GPU_COMPUTE if w in compute else Tag.GPU_BANDWIDTH)
            for w in sorted(compute | set(cluster.workers_with(Tag.GPU_BANDWIDTH)))}
        self.snapshot: Future | None = None  # the newest published weights, on the trainer
        self._restores = 0

    @staticmethod
    def inference_tag(tags: dict[str, float]) -> Tag | None:
        """The tag a worker's weight loads take a slot of (None: it runs no inference)."""
        for tag in (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH):
            if tags.get(str(tag), 0) > 0:
                return tag
        return None

    def add_inference_worker(self, worker: str, tags: dict[str, float]) -> None:
        """An inference worker joined: it gets every weight load from now on."""
        tag = self.inference_tag(tags)
        if tag is not None:
            self.inference_workers[worker] = tag

    def remove_inference_worker(self, worker: str) -> None:
        self.inference_workers.pop(worker, None)

    def lost(self) -> None:
        """The trainer's worker left: nothing goes to the trainer until :meth:`restore`."""
        self.worker = None

    def _on_trainer(self, stage: Stage, fn, *args, key: str) -> Future:
        with self.spans("trainer", stage.value):
            return submit_on(self.client, self.worker, stage, with_trainer, fn, *args,
                             key=key + self.key_tag)

    def train(self, batch: TrainBatch) -> Future:
        """One train step on a batch cut at ``batch.policy_version``."""
        return self._on_trainer(Stage.TRAIN_STEP, self.stages.train_step, batch,
                                key=f"{Stage.TRAIN_STEP}-{batch.policy_version}")

    def sync_weights(self, version: int) -> dict[str, Future]:
        """Publish the trainer's weights and load them on every inference worker: the load
        futures by worker."""
        self.snapshot = self._on_trainer(Stage.PUBLISH_WEIGHTS, self.stages.publish_weights,
                                         key=f"{Stage.PUBLISH_WEIGHTS}-{version}-"
                                             f"{self._restores}")
        return {w: self.load_on(w, version) for w in self.inference_workers}

    def load_on(self, worker: str, version: int) -> Future:
        """The newest published weights (of ``version``) loaded on one inference worker: a
        worker that joins loads them before it is given work."""
        with self.spans("trainer", Stage.LOAD_WEIGHTS.value):
            return submit_on(
                self.client, worker, Stage.LOAD_WEIGHTS, with_backend, self.stages.load_weights,
                self.snapshot, tag=self.inference_workers[worker],
                key=f"{Stage.LOAD_WEIGHTS}-{version}-{self._restores}-{worker}{self.key_tag}")

    def time_share(self, version: int, seconds: float) -> list[Future]:
        """Colocated training on emulated devices: every inference engine yields its GPUs to
        the train step of ``version`` for its ``seconds`` (unscaled)."""
        from resources.emulated import yield_to_training

        return [submit_on(self.client, w, Stage.LOAD_WEIGHTS, with_backend, yield_to_training,
                          seconds, tag=tag, key=f"time_share-{version}-{i}{self.key_tag}")
                for i, (w, tag) in enumerate(self.inference_workers.items())]

    def checkpoint(self, directory: str, version: int) -> Future:
        """A resumable checkpoint of ``version`` (and its policy) written into ``directory``."""
        return self._on_trainer(Stage.SAVE_CHECKPOINT, self.stages.save_checkpoint, directory,
                                key=f"checkpoint-{version}")

    def resume(self, checkpoint: str) -> int:
        """Restore the trainer from a checkpoint; the version it resumes at."""
        return self._on_trainer(Stage.TRAIN_STEP, self.stages.load_checkpoint, checkpoint,
                                key="resume-0").result(timeout=TRAINER_CALL_TIMEOUT_S)

    def restore(self, worker: str, checkpoint: str | None, version: int,
                timeout: float = TRAINER_CALL_TIMEOUT_S) -> None:
        """The trainer's worker was lost: rebuild the trainer on ``worker`` from
        ``checkpoint`` (weights, optimiser, schedule, random states; None: the initial
        weights, when nothing was trained) and have it go on numbering at ``version``, so
        that policy versions never repeat."""
        self.worker, self._restores = worker, self._restores + 1
        self._on_trainer(Stage.TRAIN_STEP, restore_at, self.stages.load_checkpoint,
                         checkpoint, version, key=f"restore-{self._restores}"
                         ).result(timeout=timeout)


    def save(self, run_dir: str, version: int) -> str:
        """The final policy (Hugging Face directory) and a resumable checkpoint."""
        return self._on_trainer(Stage.SAVE_CHECKPOINT, self.stages.save_checkpoint, run_dir,
                                key=f"{Stage.SAVE_CHECKPOINT}-{version}"
                                ).result(timeout=TRAINER_CALL_TIMEOUT_S)


def restore_at(trainer, load_checkpoint, checkpoint: str | None, version: int) -> int:
    """On the trainer's worker: restore, then continue the version count at ``version``."""
    if checkpoint is not None:
        load_checkpoint(trainer, checkpoint)
    trainer.version = version
    return version
