"""The Python API: a cluster kept across runs, runs trained step by step, metrics as DataFrames.

This is what the notebooks in ``notebooks/`` drive, and what ``flows/train.py`` runs::

    from flows.api import Session, swap

    session = Session.start()                     # the embedded default's local cluster
    print(session.dashboard_link, session.page_link)
    run = session.run(overrides=["trainer.max_steps=20"])
    run.train(5)                                  # five train steps; the work in flight goes on
    run.train(5)                                  # five more, from where it stopped
    run.metrics().tail()                          # pandas DataFrame, one row per train step
    run.plot()                                    # curves.png in the run directory
    run.close()                                   # checkpoint, summary.json, report

    # swap a reward function, an environment class or a stage, and run again
    cfg = swap(session.config(["reward.backend=local"]), "frozenlake", reward_fn=my_reward,
               env=MyEnv)
    run = session.run(cfg, stages=Stages(env_step=my_env_step))
    session.close()

    Session.connect("tcp://HOST:8786")            # a running cluster instead

A notebook's interrupt (KeyboardInterrupt) during :meth:`Run.train` cancels the run's work in
flight, closes its environments and drops its trajectories with the reason ``interrupted``;
the session's cluster stays usable for the next run.

The machinery lives in :mod:`flows.training.session` (:class:`Session`, :func:`run_training`)
and :mod:`flows.training.session_run` (:class:`Run`, :class:`RunStatus`); this module is the
public face notebooks and scripts import from.
"""

from __future__ import annotations

from flows.config import TrainConfig, validate
from flows.training.session import (
    ConfigLike,
    Session,
    check_run_dir,
    check_single_scheduler,
    run_training,
)
from flows.training.session_run import ENDED, Run, RunStatus

__all__ = [
    "ENDED",
    "ConfigLike",
    "Run",
    "RunStatus",
    "Session",
    "check_run_dir",
    "check_single_scheduler",
    "run_training",
    "swap",
]


def swap(cfg: TrainConfig, env_task: str, **changes) -> TrainConfig:
    """A validated copy of ``cfg`` with fields of one env task replaced: ``reward_fn`` (a
    Python function: ``reward.backend=local``), ``env`` (a TextEnv class, or
    ``{"_component_": cls, **kwargs}``), ``group_size``, ``weight``, ...::

        cfg = swap(cfg, "frozenlake", reward_fn=shaped_reward, env=MyLake)
    """
    names = [t.name for t in cfg.env_tasks]
    if env_task not in names:
        raise KeyError(f"no env task {env_task!r} (have {names})")
    tasks = [t.model_copy(update=changes) if t.name == env_task else t for t in cfg.env_tasks]
    return validate(cfg.model_copy(update={"env_tasks": tasks}))
