"""Does the boundary function of a hard-constrained PINN decide how it trains, through the
spectrum of its residual kernel? A study over problems, boundary functions and init seeds.

The claim under test (the HC-PINN NTK analysis): in the trial function ``u~ = A + B N`` the
boundary function ``B`` multiplies into every row of the residual Jacobian ``J``, a spatial
modulation of the residual NTK ``K = J J^T`` that acts as a spectral filter; the **effective
rank** of ``K`` predicts convergence better than the classical **condition number**; and widely
used ``B`` can collapse the spectrum so that training stagnates although the boundary values
hold exactly.

Method. One job per (problem, ``B``, seed) (:func:`tasks.hc_pinn.study.run_case`): the
spectrum of ``K`` at initialisation, from the singular values of ``J``
(:func:`tasks.hc_pinn.ntk.jacobian_spectrum`), then full-batch Adam from that same network until
the loss relative to that of ``u~ = A`` reaches ``--threshold`` or ``--steps`` run out. Over the
runs, per problem and pooled: Spearman's rho of the effective rank, the log10 condition number
and the top eigenvalue's share with three measures of slowness (steps to the threshold, the
runs that missed it ranked after, by final loss; log10 final loss; log10 L2 error). The verdict
compares |rho| of the effective rank and of the condition number (the rule:
:func:`tasks.hc_pinn.study.compare`); a run collapses when it misses the threshold with its
relative loss still above ``--collapse-loss``, a ``B`` collapses on a problem when most of its
seeds do.

Where it departs from the analysis it tests: small tanh networks (2 x 32) on small grids, one
learning rate and a fixed budget, so "convergence" is what this budget shows; the spectrum is
taken at initialisation only. At these sizes ``K`` is numerically singular: its condition number
is at float64's limit in most runs (flagged in the table and the verdict) and is then
round-off; it still enters the correlations as computed, which is what a practitioner
computing it would get.

    python flows/hc_pinn_study.py                      # 3 problems x 17 B x 3 seeds: minutes
    python flows/hc_pinn_study.py --problems poisson1d --specs "poly 1" "sine 4" "rfun 1" \\
        --seeds 0 --steps 200                          # a quick look
    python flows/hc_pinn_study.py --workers 0 --problems heat1d   # in this process, no Dask
    python flows/hc_pinn_study.py --scheduler tcp://HOST:8786     # on a running cluster

Writes to ``--out`` (default ``runs/hc_pinn_study``): ``results.json`` (the resolved config,
every run, failed ones with the reason, the summaries, correlations and verdict; non-finite
numbers as null), ``results.csv`` (every run), ``summary.md`` (the tables printed) and
``hc_pinn_study.png``. Exit status 0; 1 when a run failed (its reason is printed and saved; the
tables cover the others); 2 for bad arguments or an unusable ``--scheduler``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from enum import Enum
from pathlib import Path

from rich.console import Console

from flows.benchmarks.report import markdown_table
from resources.pools import Tag, tags_of
from tasks.hc_pinn.boundary import COMMON, BoundarySpec
from tasks.hc_pinn.ntk import analyse
from tasks.hc_pinn.problems import PROBLEMS, get_problem
from tasks.hc_pinn.study import (
    COLLAPSE_LOSS,
    POOLED,
    Correlation,
    Failure,
    Measure,
    Predictor,
    SpecSummary,
    StudyCase,
    StudyRun,
    collapsed,
    contrast,
    correlations,
    run_case,
    summarise,
    verdict,
)
from tasks.hc_pinn.training import DEFAULT_LR, DEFAULT_THRESHOLD

logger = logging.getLogger(__name__)

DEFAULT_SPECS = ("poly 1", "poly 2", "poly 3", "poly 4", "sine 1", "sine 2", "sine 4", "dist 1",
                 "dist 2", "rfun 1", "rfun 2", "exp 1", "exp 4", "exp 16", "tanh 1", "tanh 4",
                 "tanh 16")
Job = Callable[[StudyCase], StudyRun]
CONNECT_TIMEOUT_S = 30


# -- the command line -------------------------------------------------------------------------------


def _problem(text: str) -> str:
    if text not in PROBLEMS:
        raise argparse.ArgumentTypeError(f"unknown problem {text!r}; known: {sorted(PROBLEMS)}")
    return text


def _spec(text: str) -> BoundarySpec:
    m = re.fullmatch(r"\s*([A-Za-z]+)(?:\s+(\d+))?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a boundary function: write "
                                         "'FAMILY [PARAM]', e.g. 'sine 2'")
    try:
        return BoundarySpec(m.group(1).lower(), int(m.group(2)) if m.group(2) else 1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _checked(kind: type, ok: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {rule}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", nargs="+", type=_problem, default=list(PROBLEMS),
                   help=f"problems (default: all of {', '.join(PROBLEMS)})")
    p.add_argument("--specs", nargs="+", type=_spec, default=[_spec(s) for s in DEFAULT_SPECS],
                   metavar="SPEC", help="boundary functions, one quoted 'FAMILY PARAM' each "
                   "(default: 17 forms, the COMMON ones among them)")
    p.add_argument("--seeds", nargs="+", type=_checked(int, lambda v: v >= 0, ">= 0"),
                   default=[0, 1, 2], help="network init seeds (default 0 1 2)")
    p.add_argument("--steps", type=_checked(int, lambda v: v >= 1, ">= 1"), default=1000,
                   help="Adam step budget per run (default 1000)")
    p.add_argument("--threshold", type=_checked(float, lambda v: 0 < v < 1, "in (0, 1)"),
                   default=DEFAULT_THRESHOLD, help="relative loss that counts as converged")
    p.add_argument("--lr", type=_checked(float, lambda v: 0 < v < math.inf, "> 0"),
                   default=DEFAULT_LR, help="Adam learning rate")
    p.add_argument("--collapse-loss", type=_checked(float, lambda v: 0 < v < math.inf, "> 0"),
                   default=COLLAPSE_LOSS, help="a run that misses the threshold collapses when "
                   f"its relative loss ends above this (default {COLLAPSE_LOSS})")
    p.add_argument("--workers", type=_checked(int, lambda v: v >= 0, ">= 0"),
                   default=os.cpu_count() or 1, help="local Dask worker processes, one thread "
                   "each (default: the CPU count); 0 runs the jobs in this process, no Dask")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="tcp://HOST:PORT of a running Dask scheduler (instead of a local one)")
    p.add_argument("--out", type=Path, default=Path("runs/hc_pinn_study"), help="output folder")
    return p.parse_args(argv)


def cases_of(args: argparse.Namespace) -> list[StudyCase]:
    """Every (problem, spec, seed), duplicates dropped, in the order given."""
    cases = [StudyCase(problem, spec, seed, args.steps, args.threshold, args.lr)
             for problem in args.problems for spec in args.specs for seed in args.seeds]
    return list(dict.fromkeys(cases))


# -- running the jobs ------------------------------------------------------------------------------


def job_key(case: StudyCase) -> str:
    """The Dask key: the stage, the case, and a token of its budget (so runs of another budget
    on a shared scheduler never share a result; equal cases may: the job is deterministic)."""
    from dask.base import tokenize

    spec = f"{case.spec.family}{case.spec.param}"
    return f"hc-pinn-{case.problem}-{spec}-{case.seed}-{tokenize(case)[:8]}"


def _failure(exc: BaseException) -> Failure:
    from distributed import KilledWorker

    if isinstance(exc, KilledWorker):
        return Failure.WORKER_LOST
    if isinstance(exc, CancelledError):  # the scheduler forgot it, or the client lost it
        return Failure.CLUSTER_LOST
    return Failure.JOB_ERROR


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _progress(done: int, total: int, run: StudyRun) -> None:
    if not run.ok:
        logger.warning("%s %s seed %d failed (%s): %s", run.problem, run.spec, run.seed,
                       run.failure.value, run.reason)
    if done == total or done % max(1, total // 10) == 0:
        logger.info("%d/%d runs done", done, total)


def run_in_process(cases: Sequence[StudyCase], job: Job = run_case) -> list[StudyRun]:
    """The jobs one after another in this process; a job that raises is recorded as failed."""
    out = []
    for case in cases:
        try:
            run = job(case)
        except Exception as exc:
            run = StudyRun.failed(case, Failure.JOB_ERROR, _reason(exc))
        out.append(run)
        _progress(len(out), len(cases), run)
    return out


def run_on_dask(client, cases: Sequence[StudyCase], job: Job = run_case) -> list[StudyRun]:
    """The jobs on ``client``'s cluster, in the order of ``cases``; each failure (the job
    raised, its workers died, the cluster went away) recorded with its reason."""
    from distributed import as_completed

    # CPU work of the environment kind: one CPU_ENV slot each, as on a RollArc cluster's env
    # workers (the local cluster below advertises one slot per single-threaded worker)
    futures = client.map(job, cases, key=[job_key(c) for c in cases],
                         resources={Tag.CPU_ENV.value: 1})
    case_of = {f.key: c for f, c in zip(futures, cases, strict=True)}
    done: dict[StudyCase, StudyRun] = {}
    try:
        for fut in as_completed(futures):
            case = case_of[fut.key]
            try:
                run = fut.result()
            except Exception as exc:
                run = StudyRun.failed(case, _failure(exc), _reason(exc))
            done[case] = run
            _progress(len(done), len(cases), run)
    except Exception as exc:  # the client lost its scheduler: what is left is lost with it
        logger.error("lost the cluster with %d runs to go: %s", len(cases) - len(done),
                     _reason(exc))
        for case in cases:
            done.setdefault(case, StudyRun.failed(case, Failure.CLUSTER_LOST, _reason(exc)))
    return [done[c] for c in cases]


class SchedulerUnusable(RuntimeError):
    """``--scheduler`` names no scheduler this process can connect to, or one without a
    worker for the study's jobs."""


def run_jobs(cases: Sequence[StudyCase], workers: int, scheduler: str | None) -> list[StudyRun]:
    """On ``scheduler``'s cluster, else on a local one of ``workers`` processes, else (0
    workers) in this process."""
    if scheduler is None and workers == 0:
        return run_in_process(cases)
    from distributed import Client, LocalCluster

    # distributed sets its own logger to INFO on import: the local scheduler's and nannies'
    # chatter would bury the study's progress
    logging.getLogger("distributed").setLevel(logging.WARNING)
    if scheduler:
        try:
            client = Client(scheduler, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError) as exc:
            raise SchedulerUnusable(f"cannot connect to {scheduler!r}: {_reason(exc)}") \
                from None
        with client:
            workers = client.scheduler_info()["workers"].values()
            if not any(tags_of(w.get("resources")).get(Tag.CPU_ENV.value) for w in workers):
                raise SchedulerUnusable(
                    f"{scheduler!r} has no worker with the {Tag.CPU_ENV.value} resource, which "
                    f"the study's jobs ask for (dask worker ... --resources "
                    f"{Tag.CPU_ENV.value}=N)")
            return run_on_dask(client, cases)
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=":0", resources={Tag.CPU_ENV.value: 1}) as cluster, \
            Client(cluster) as client:
        logger.info("local cluster: %d workers, dashboard %s", workers, client.dashboard_link)
        return run_on_dask(client, cases)


# -- tables ----------------------------------------------------------------------------------------


def _num(x: float, fmt: str = ".2f") -> str:
    return "-" if math.isnan(x) else f"{x:{fmt}}"


def spec_table(summaries: Sequence[SpecSummary]) -> str:
    rows = []
    for s in summaries:
        cond = _num(s.log10_condition, ".1f")
        if s.condition_at_limit:
            cond += f" (at float64 limit {s.condition_at_limit}/{s.runs})"
        runs = f"{s.runs}" + (f" ({s.failed} failed)" if s.failed else "")
        rows.append([s.problem, s.spec, "COMMON" if s.common else "",
                     f"{'COLLAPSE' if s.collapses else 'no'} {s.collapsed}/{s.runs}",
                     _num(s.effective_rank, ".3f"), cond, _num(s.top_share, ".3f"),
                     _num(s.steps, ".0f"), _num(s.reached), _num(s.log10_final_loss),
                     _num(s.l2_error, ".3g"), runs])
    return markdown_table(["problem", "B", "common", "collapse (runs)", "eff. rank",
                           "log10 cond", "top share", "steps", "reached", "log10 loss",
                           "L2 error", "runs"], rows)


def correlation_table(corrs: Sequence[Correlation]) -> str:
    rows = []
    for c in corrs:
        rank, cond = Predictor.EFFECTIVE_RANK, Predictor.LOG10_CONDITION
        stronger = c.stronger()
        strongest = c.strongest()
        rows.append([c.scope, c.measure.value, c.n] + [_num(c.rho[p], "+.2f") for p in Predictor]
                    + [f"{stronger.value if stronger else 'neither'} "
                       f"({_num(abs(c.rho[rank]))} vs {_num(abs(c.rho[cond]))})",
                       strongest.value if strongest else "-"])
    return markdown_table(["scope", "slowness", "runs", "rho eff. rank (expect -)",
                           "rho log10 cond (expect +)", "rho top share (expect +)",
                           "stronger, |rho| rank vs cond", "strongest"], rows)


def collapse_lines(summaries: Sequence[SpecSummary], args: argparse.Namespace) -> list[str]:
    lines = [f"Collapse rule: a run collapses when it misses the threshold {args.threshold:g} "
             f"and its relative loss is still above {args.collapse_loss:g} after {args.steps} "
             f"steps; a boundary function collapses on a problem when more than half of its "
             f"seeds do."]
    bad = [s for s in summaries if s.collapses]
    for problem in dict.fromkeys(s.problem for s in summaries):
        mine = [f"{s.spec}{' (COMMON)' if s.common else ''}" for s in bad if s.problem == problem]
        lines.append(f"Collapsing on {problem}: {', '.join(mine) or 'none'}")
    tried = [c for c in COMMON if any(s.spec == c for s in summaries)]
    common_bad = {c: [s.problem for s in bad if s.spec == c] for c in tried}
    common_bad = {c: ps for c, ps in common_bad.items() if ps}
    lines.append("Collapsing COMMON forms: " + ("; ".join(
        f"{c} (on {', '.join(ps)})" for c, ps in common_bad.items()) or "none")
        + f" (of {', '.join(tried) or 'none tried'})")
    b_max = max((s.boundary_b_max for s in bad if not math.isnan(s.boundary_b_max)), default=None)
    if b_max is not None:
        exact = "exactly (to round-off)" if b_max < 1e-12 else "NOT exactly"
        lines.append(f"The collapsing runs meet the boundary values {exact}: max |B| on the "
                     f"prescribed faces is {b_max:.1e}, so u~ = A there.")
    return lines


# -- the picture -----------------------------------------------------------------------------------


def _pooled_rho(corrs: Sequence[Correlation], predictor: Predictor) -> float:
    """rho with the final loss over all runs: the pooled scope, or the only problem's."""
    pooled = [c for c in corrs if c.scope == POOLED] or list(corrs)
    return next((c.rho[predictor] for c in pooled if c.measure is Measure.LOSS), math.nan)


def draw(runs: Sequence[StudyRun], corrs: Sequence[Correlation], summaries, path: Path,
         args: argparse.Namespace) -> None:
    """Final loss against effective rank and against log10 condition number (one colour per
    problem, x: collapsed runs), and the normalised spectra of a collapsing and a healthy B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    ok = [r for r in runs if r.ok]
    problems = list(dict.fromkeys(r.problem for r in ok))
    for ax, pred in zip(axes[:2], (Predictor.EFFECTIVE_RANK, Predictor.LOG10_CONDITION),
                        strict=True):
        for i, problem in enumerate(problems):
            mine = [r for r in ok if r.problem == problem and math.isfinite(pred.of(r))]
            label = problem  # on the first group drawn
            for collapse in (False, True):
                for limit in (False, True):
                    pts = [r for r in mine if collapsed(r, args.collapse_loss) is collapse
                           and (r.condition_at_limit and pred is Predictor.LOG10_CONDITION)
                           is limit]
                    if not pts:
                        continue
                    ax.scatter([pred.of(r) for r in pts],
                               [math.log10(max(r.final_loss, 1e-300)) for r in pts],
                               marker="x" if collapse else "o", s=28, linewidths=1.2,
                               edgecolors=None if collapse else f"C{i}",
                               facecolors="none" if limit and not collapse else f"C{i}",
                               label=label)
                    label = None
        ax.axhline(math.log10(args.threshold), color="green", ls=":", lw=1, label="threshold")
        ax.axhline(math.log10(args.collapse_loss), color="red", ls=":", lw=1,
                   label="collapse (x: collapsed runs)")
        ax.set_xlabel(pred.value + (" (hollow: at float64's limit, round-off)"
                                    if pred is Predictor.LOG10_CONDITION else ""))
        ax.set_ylabel(f"log10 final relative loss after <= {args.steps} steps")
        ax.set_title(f"convergence vs {pred.value}: Spearman rho over all runs = "
                     f"{_pooled_rho(corrs, pred):+.2f}", fontsize=10)
        ax.legend(fontsize=7)
    ax = axes[2]
    pair = contrast(summaries)
    if pair:
        seed = args.seeds[0]
        for s, colour in zip(pair, ("red", "green"), strict=True):
            spectrum, values = analyse(get_problem(s.problem), _spec(s.spec), seed)
            norm = (values / values[0]).tolist()
            ks = [k + 1 for k, v in enumerate(norm) if v > 0]
            ax.semilogy(ks, [v for v in norm if v > 0], color=colour, lw=1.5,
                        label=f"{s.spec}: eff. rank {spectrum.effective_rank:.2f}, "
                              f"{'collapses' if s.collapses else 'reached ' + _num(s.reached)}")
            ax.axvline(spectrum.numerical_rank, color=colour, ls=":", lw=0.8)
        ax.set_title(f"{pair[0].problem}, seed {seed}: normalised spectrum of K "
                     "(dotted: numerical rank)", fontsize=10)
        ax.legend(fontsize=8)
    ax.set_xlabel("k")
    ax.set_ylabel("lambda_k / lambda_1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- files -----------------------------------------------------------------------------------------


def _plain(x):
    """JSON-safe: enums by value, non-finite floats as null."""
    if isinstance(x, Enum):
        return x.value
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {(k.value if isinstance(k, Enum) else k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if dataclasses.is_dataclass(x):
        return _plain({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
    return x


def write_results(out: Path, config: dict, runs, summaries, corrs, verdict_) -> None:
    (out / "results.json").write_text(json.dumps(_plain({
        "config": config, "runs": list(runs),
        "summaries": [{**_plain(s), "collapses": s.collapses} for s in summaries],
        "correlations": list(corrs), "verdict": {**_plain(verdict_), "text": verdict_.text()},
    }), indent=1))
    names = [f.name for f in dataclasses.fields(StudyRun)]
    with (out / "results.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for r in runs:
            writer.writerow(_plain([getattr(r, n) for n in names]))


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["specs"] = [str(s) for s in args.specs]
    logger.info("config: %s", json.dumps(config))
    args.out.mkdir(parents=True, exist_ok=True)
    cases = cases_of(args)
    t0 = time.perf_counter()
    logger.info("%d runs", len(cases))
    try:
        runs = run_jobs(cases, args.workers, args.scheduler)
    except SchedulerUnusable as exc:
        print(f"hc_pinn_study.py: error: argument --scheduler: {exc}", file=sys.stderr)
        return 2
    summaries = summarise(runs, args.collapse_loss)
    corrs = correlations(runs)
    verdict_ = verdict(corrs, runs)
    console = Console(width=250)
    failed = [r for r in runs if not r.ok]
    sections = [
        f"{len(runs)} runs ({len(failed)} failed) in {time.perf_counter() - t0:.0f} s",
        spec_table(summaries),
        "Spearman rho of each predictor at initialisation with slowness (steps to threshold: "
        "reached runs by steps, then the others by final loss; log10 final loss; log10 L2 "
        "error). Higher effective rank should mean faster convergence (rho < 0).",
        correlation_table(corrs),
        verdict_.text(),
        *collapse_lines(summaries, args),
        *[f"FAILED {r.problem} {r.spec} seed {r.seed}: {r.failure.value}: {r.reason}"
          for r in failed],
    ]
    text = "\n\n".join(sections)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    (args.out / "summary.md").write_text(text + "\n")
    write_results(args.out, config, runs, summaries, corrs, verdict_)
    draw(runs, corrs, summaries, args.out / "hc_pinn_study.png", args)
    console.print(f"wrote {args.out}/results.json, results.csv, summary.md, hc_pinn_study.png",
                  markup=False, highlight=False)
    # the tables cover the runs that finished; a study with failed runs is incomplete
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
