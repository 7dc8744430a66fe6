"""What the simulator cannot know, fitted on one emulated run and carried to others.

An emulated run (``flows/bench.py``) holds three things the device model does not give:

- how many turns a trajectory of each env task takes (the policy's and the environment's
  doing), kept as a share of the env's ``max_turns`` so that it carries to a workload whose env
  task of the same name has another limit;
- the time a turn spends outside its emulated waits (the driver, the scheduler, messages and the
  tiny policy's real forward passes, all on this machine's cores), fitted as
  ``turns in flight x (b + c x hand-offs between workers)`` by non-negative least squares over
  the calibration's runs: the same few cores serve every turn in flight (processor sharing), so
  a straggler alone at the end of a synchronous step waits next to nothing and a run with many
  turns in flight waits long, and each hand-off is a transfer between worker processes (none
  when prefill, decode and environment share a monolithic worker);
- the real seconds a train step takes beyond the emulated trainer's, and a score task's round
  trip to the (emulated) reward service.

Times are kept in real seconds and turned into emulated ones with the predicted run's
``engine.time_scale``. An env task the calibration never trained gets the calibration's pooled
share of ``max_turns`` (the prior; 1.0, every episode running to its limit, when the calibration
trained nothing), which is what an untrained policy does on these environments.

Runs are read into small digests (:class:`RunDigest`): what the calibration needs and the
step ends a validation compares with. A bench directory, a run directory or a digest's JSON
are accepted alike, so a few kilobytes of JSON stand for a run in tests.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field
from scipy.optimize import nnls

from flows.config import TrainConfig, validated
from flows.config.overrides import apply_overrides
from flows.monitoring.metrics import read_metrics
from flows.monitoring.step_timings import legs_of
from flows.simulation.environments import max_turns_of

logger = logging.getLogger(__name__)


def steady_step_s(ends: list[float]) -> float:
    """Mean time per step from the end of the first (which holds the start-up) to the end of
    the last but one (the last holds the run's end: admission stopped, environments closing);
    to the end of the last when there are fewer than four steps."""
    last = len(ends) - 2 if len(ends) >= 4 else len(ends) - 1
    if last < 1:
        raise ValueError(f"{len(ends)} train steps; a steady step time needs two")
    return (ends[last] - ends[0]) / last


class EnvTurns(BaseModel):
    """The trained trajectories of one env task in a run and their mean turns."""

    model_config = ConfigDict(extra="forbid")

    trajectories: int = Field(ge=0)
    mean_turns: float = Field(ge=0)


class RunMeasures(BaseModel):
    """What a calibration reads of a run beyond its config and step ends (real seconds)."""

    model_config = ConfigDict(extra="forbid")

    env_turns: dict[str, EnvTurns] = Field(description="By env task, the trained ones")
    turns: int = Field(ge=0, description="Turns answered")
    turn_outside_s: float = Field(ge=0, description="Mean real seconds of a turn outside its "
                                  "emulated waits (submission to answer)")
    turns_in_flight: float = Field(ge=0, description="Turns in flight when a turn was "
                                   "submitted, the mean over turns (over time without a task "
                                   "stream)")
    turns_in_env: float = Field(default=0.0, ge=0, description="Of those, turns inside an "
                                "environment task (waiting on it, holding no core); 0 without "
                                "a task stream")
    train_extra_s: float = Field(ge=0, description="Real seconds per train step beyond the "
                                 "emulated trainer's (the median step)")
    hops_per_turn: float = Field(default=0.0, ge=0, description="Hand-offs between workers in "
                                 "a turn (env -> prefill -> decode -> env), the mean")
    score_task_s: float | None = Field(default=None, ge=0, description="Mean real seconds of "
                                       "a score task (None: no task stream)")


class RunDigest(BaseModel):
    """One emulated run as the calibration and the validation read it."""

    model_config = ConfigDict(extra="forbid")

    system: str
    overrides: list[str] = Field(default_factory=list, description="Of the bench's base config")
    step_ends_s: list[float] = Field(description="Emulated seconds at each train step's end")
    measures: RunMeasures | None = Field(default=None, description="Calibration inputs (a "
                                         "digest kept only to be predicted may leave them out)")

    @property
    def steady_step_s(self) -> float:
        return steady_step_s(self.step_ends_s)


class BenchDigest(BaseModel):
    """The runs of one bench invocation (one workload, one seed): a base config and each
    system's differences from it."""

    model_config = ConfigDict(extra="forbid")

    workload: str
    seed: int
    time_scale: float
    base_config: dict[str, Any]
    runs: list[RunDigest]

    def config(self, run: RunDigest) -> TrainConfig:
        data = json.loads(json.dumps(self.base_config))
        apply_overrides(data, run.overrides)
        return validated(data)

    def without_measures(self) -> BenchDigest:
        """The digest of runs to be predicted: their step ends and configs only."""
        return self.model_copy(update={"runs": [r.model_copy(update={"measures": None})
                                                for r in self.runs]})


# -- reading runs ---------------------------------------------------------------------------------


def config_diff(base: Any, other: Any, prefix: str = "") -> list[str]:
    """Dotted ``key=value`` overrides that turn ``base`` into ``other`` (JSON values; a list
    of another length, or a key ``base`` lacks, is given whole)."""
    if isinstance(base, dict) and isinstance(other, dict):
        out = []
        for k in sorted(set(base) | set(other), key=str):
            if k not in other:
                raise ValueError(f"{prefix}{k}: a key only the base config has")
            if k not in base:
                out.append(f"{prefix}{k}={json.dumps(other[k])}")
            else:
                out += config_diff(base[k], other[k], f"{prefix}{k}.")
        return out
    if isinstance(base, list) and isinstance(other, list) and len(base) == len(other):
        return [o for i, (a, b) in enumerate(zip(base, other, strict=True))
                for o in config_diff(a, b, f"{prefix}{i}.")]
    return [] if base == other else [f"{prefix[:-1]}={json.dumps(other)}"]


def _mean_open_at(spans: list[tuple[float, float]], at: list[float]) -> float:
    """Mean over the moments ``at`` of the spans ``(start, end)`` begun and not yet ended at
    each (a span beginning at that moment counted, one ending then not)."""
    if not spans or not at:
        return 0.0
    starts = np.sort([a for a, _ in spans])
    ends = np.sort([b for _, b in spans])
    moments = np.asarray(at, float)
    return float(np.mean(np.searchsorted(starts, moments, "right")
                         - np.searchsorted(ends, moments, "right")))


def in_flight_at_submission(turns: list) -> float:
    """Mean over turns of the turns in flight when each was submitted (itself and those
    submitted with it included), from the task stream's ``[key, submitted, answered, ...]``."""
    return _mean_open_at([(t[1], t[2]) for t in turns], [t[1] for t in turns])


def in_env_at_submission(stream: dict) -> float:
    """Mean over turns of the turns inside an environment task (``env_reset``, ``env_step``)
    when each was submitted: from the task stream, each turn's environment tasks are those of
    the cohorts it went through (its key's legs). A turn waiting on its environment holds no
    core; the host's load is the turns in flight less these."""
    env: dict[str, list[tuple[float, float]]] = {}
    for key, _worker, start, stop in stream["tasks"]:
        stage, _, suffix = key.partition("-")
        if stage in ("env_reset", "env_step"):
            env.setdefault(suffix, []).append((start, stop))
    turns = stream["turns"]
    spans = [span for t in turns for leg in legs_of(t[0]) for span in env.get(leg, ())]
    return _mean_open_at(spans, [t[1] for t in turns])


def stream_hops_and_scores(stream: dict) -> tuple[float, float | None]:
    """From a task stream (``{"tasks": [[key, worker, start, stop], ...], "turns": ...}``): the
    mean hand-offs between workers per turn, and the mean real seconds of a score task."""
    workers: dict[str, dict[str, str]] = {}
    scores = []
    for key, worker, start, stop in stream["tasks"]:
        stage, _, suffix = key.partition("-")
        workers.setdefault(suffix, {})[stage] = worker
        if stage == "score":
            scores.append(stop - start)
    hops = [turn_hops(w["env_step"], w["prefill"], w["decode"])
            # a continued member's turn lists its cohorts; it finished in the last
            for w in (workers.get(legs_of(t[0])[-1], {}) for t in stream["turns"])
            if {"env_step", "prefill", "decode"} <= set(w)]
    return (float(np.mean(hops)) if hops else 0.0,
            float(np.mean(scores)) if scores else None)


def turn_hops(env_worker: str, prefill_worker: str, decode_worker: str) -> int:
    """Hand-offs between workers in a turn: the observation to prefill, prefill's KV to decode,
    the response to the environment."""
    return ((env_worker != prefill_worker) + (prefill_worker != decode_worker)
            + (decode_worker != env_worker))


def _measures(run_dir: Path, cfg: TrainConfig, rows: list[dict]) -> RunMeasures:
    summary = json.loads((run_dir / "summary.json").read_text())
    env_turns = {}
    for t in cfg.env_tasks:
        n = sum(r.get(f"env/{t.name}/trajectories", 0) for r in rows)
        if n:
            turns = sum(r.get(f"env/{t.name}/turns", 0) * r.get(f"env/{t.name}/trajectories", 0)
                        for r in rows)
            env_turns[t.name] = EnvTurns(trajectories=n, mean_turns=turns / n)
    turns = summary["turns"]
    in_flight = turns["count"] * turns["wall_s_mean"] / summary["elapsed_s"]
    hops, score, in_env = 0.0, None, 0.0
    stream_file = run_dir / "task_stream.json"
    if stream_file.exists():  # each turn's load: the turns in flight when it was submitted
        stream = json.loads(stream_file.read_text())
        in_flight = in_flight_at_submission(stream["turns"])
        in_env = in_env_at_submission(stream)
        hops, score = stream_hops_and_scores(stream)
    scale = cfg.engine.time_scale
    trainer_emulated = sum((w.get("trainer") or {}).get("emulated_busy_s", 0.0)
                           for w in summary["workers"].values())
    # train/seconds holds the step's wall time: its scaled device time, or the real step where
    # that is longer (before the emulated trainer ran its real step within the device time, the
    # two added up); the steps' median (the last one holds the run's end)
    emulated_step = trainer_emulated * scale / max(len(rows), 1)
    seconds = [r.get("train/seconds", 0.0) for r in rows]
    extra = max(0.0, median(seconds[:-1] if len(seconds) > 2 else seconds) - emulated_step)
    return RunMeasures(
        env_turns=env_turns, turns=turns["count"],
        turn_outside_s=max(0.0, turns["wall_s_mean"] - turns["emulated_wait_s_mean"]),
        turns_in_flight=in_flight, turns_in_env=in_env, train_extra_s=extra, hops_per_turn=hops,
        score_task_s=score)


def read_run(run_dir: Path, system: str | None = None) -> tuple[dict, RunDigest]:
    """(the run's resolved config, its digest) of a run directory of ``flows/train.py``."""
    data = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg = validated(json.loads(json.dumps(data)))
    rows = read_metrics(run_dir)
    if len(rows) < 2:
        raise ValueError(f"{run_dir}: {len(rows)} train steps; a steady step time needs two")
    ends = [r["perf/elapsed_s"] / cfg.engine.time_scale for r in rows]
    name = system or run_dir.name.rsplit("-", 1)[0]
    return data, RunDigest(system=name, step_ends_s=ends, measures=_measures(run_dir, cfg, rows))


def read_bench(path: Path) -> BenchDigest:
    """A bench directory (``flows/bench.py --out DIR``: each system's runs, every repeat), one
    run directory, or a digest's JSON, as a :class:`BenchDigest`."""
    path = Path(path)
    if path.is_file():
        return BenchDigest.model_validate_json(path.read_text())
    if (path / "bench.json").exists():  # every repeat of every system
        bench = json.loads((path / "bench.json").read_text())
        dirs = [(name, path / "runs" / f"{name.replace(' ', '_').replace(',', '')}-{rep}")
                for rep in range(int(bench.get("repeats", 1))) for name in bench["results"]]
        workload = Path(bench["workload"]).stem
    elif (path / "config.yaml").exists():
        dirs, workload = [(None, path)], path.parent.parent.name
    else:
        raise FileNotFoundError(f"{path}: neither a bench directory, a run directory nor a "
                                f"digest")
    read = [read_run(d, name) for name, d in dirs if (d / "summary.json").exists()]
    if not read:
        raise FileNotFoundError(f"{path}: no finished run")
    base = read[0][0]
    runs = [digest.model_copy(update={"overrides": config_diff(base, data)})
            for data, digest in read]
    return BenchDigest(workload=workload, seed=int(base.get("seed", 0)),
                       time_scale=float(base["engine"]["time_scale"]), base_config=base,
                       runs=runs)


# -- the fit --------------------------------------------------------------------------------------


class Calibration(BaseModel):
    """The fitted quantities (real seconds; turn counts as shares of ``max_turns``)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="The run(s) fitted: workload and seed")
    turn_share: dict[str, float] = Field(description="By env task: mean turns over max_turns")
    prior_share: float = Field(gt=0, le=1, description="For an env task not in the "
                               "calibration: the pooled share")
    turn_overhead_per_turn_in_flight_s: float = Field(ge=0, description="A turn's real "
                                                      "seconds outside its emulated waits, per "
                                                      "turn in flight")
    turn_overhead_per_hop_in_flight_s: float = Field(default=0.0, ge=0, description="... and "
                                                     "per hand-off between workers in the turn "
                                                     "and turn in flight")
    score_task_s: float | None = Field(default=None, ge=0, description="Real seconds of a "
                                       "score task (the reward service's round trip)")
    train_overhead_s: float = Field(ge=0, description="Real seconds per train step beyond the "
                                    "emulated trainer's")
    points: list[tuple[float, float, float]] = Field(
        default_factory=list, description="The fitted (turns in flight outside an environment, "
        "hops per turn, seconds outside) per run")

    def overrides(self, cfg: TrainConfig) -> list[str]:
        """``simulate.*`` overrides predicting a run of ``cfg`` (its own time scale)."""
        scale = cfg.engine.time_scale
        out = []
        for t in cfg.env_tasks:
            limit = max_turns_of(t.env)
            if limit is None:  # no known limit: left to simulate.turns' default
                continue
            share = self.turn_share.get(t.name, self.prior_share)
            out.append(f"simulate.turns.{t.name}={{mean: {max(1.0, share * limit):.4f}, "
                       f"max: {limit}}}")
        out += [f"simulate.turn_overhead_per_turn_in_flight_s="
                f"{self.turn_overhead_per_turn_in_flight_s / scale:.6f}",
                f"simulate.turn_overhead_per_hop_in_flight_s="
                f"{self.turn_overhead_per_hop_in_flight_s / scale:.6f}",
                f"simulate.train_overhead_s={self.train_overhead_s / scale:.6f}"]
        if self.score_task_s is not None:  # the emulated service's round trip, all in
            out.append(f"simulate.lambda_latency_s={self.score_task_s / scale:.6f}")
        return out


def fit_overhead(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(b, c) >= 0 of ``seconds = in_flight x (b + c x hops)`` by non-negative least squares
    over ``(in_flight, hops, seconds)`` points: the host's cores shared by the turns in flight
    (processor sharing: a turn alone waits next to nothing, each more in flight adds its share),
    a hand-off between worker processes adding to a turn's work. Without variation in the
    hand-offs, ``c`` is 0."""
    if not points:
        return 0.0, 0.0
    p = np.array(points, float)
    n, h, y = p[:, 0], p[:, 1], p[:, 2]
    if np.ptp(h) <= 1e-9 * max(1.0, float(h.max())):
        (b,), _ = nnls(n[:, None], y)
        return float(b), 0.0
    (b, c), _ = nnls(np.stack([n, n * h], axis=1), y)
    return float(b), float(c)


def fit(bench: BenchDigest) -> Calibration:
    """The calibration of one bench invocation's runs (one workload, one seed)."""
    runs = [r for r in bench.runs if r.measures is not None]
    if not runs:
        raise ValueError(f"{bench.workload}: no run with measures to calibrate on")
    limits = {}
    for r in runs:
        for t in bench.config(r).env_tasks:
            limits[t.name] = max_turns_of(t.env)
    turns: dict[str, list[float]] = {}  # env task: [trajectories, turns]
    for r in runs:
        for name, et in r.measures.env_turns.items():
            acc = turns.setdefault(name, [0.0, 0.0])
            acc[0] += et.trajectories
            acc[1] += et.trajectories * et.mean_turns
    share = {name: min(1.0, t / n / limits[name]) for name, (n, t) in turns.items()
             if n and limits.get(name)}
    pooled_n = sum(n * limits[name] for name, (n, _) in turns.items() if limits.get(name))
    pooled_t = sum(t for name, (_, t) in turns.items() if limits.get(name))
    prior = min(1.0, pooled_t / pooled_n) if pooled_n else 1.0
    # a cohort barrier holds finished members for their mates outside any emulated wait: the
    # simulator models that hold itself (rollout.cohort_barrier), so it is not host time
    # the host's load: turns in flight less those waiting on their environment
    points = [(r.measures.turns_in_flight - r.measures.turns_in_env, r.measures.hops_per_turn,
               r.measures.turn_outside_s)
              for r in runs if r.measures.turns and not bench.config(r).rollout.cohort_barrier]
    b, c = fit_overhead(points)
    scores = [r.measures.score_task_s for r in runs if r.measures.score_task_s is not None]
    cal = Calibration(source=f"{bench.workload} seed {bench.seed}", turn_share=share,
                      prior_share=prior, turn_overhead_per_turn_in_flight_s=b,
                      turn_overhead_per_hop_in_flight_s=c,
                      score_task_s=median(scores) if scores else None,
                      train_overhead_s=median(r.measures.train_extra_s for r in runs),
                      points=points)
    logger.info("calibration on %s: %s", cal.source, cal.model_dump(exclude={"points"}))
    return cal
