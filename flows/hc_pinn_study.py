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
:func:`tasks.hc_pinn.correlations.compare`); a run collapses when it misses the threshold with its
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

Where the parts are: the job and the statistics in ``tasks/hc_pinn/`` (``study.py``,
``correlations.py``, ``collapse.py``); the sweep on Dask in ``flows/studies/hc_pinn_sweep.py``;
the tables, figure and files in ``flows/studies/hc_pinn_report.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from flows.studies.hc_pinn_report import draw, summary, write_results
from flows.studies.hc_pinn_sweep import SchedulerUnusable, run_jobs
from tasks.hc_pinn.boundary import BoundarySpec
from tasks.hc_pinn.collapse import COLLAPSE_LOSS, summarise
from tasks.hc_pinn.correlations import correlations, verdict
from tasks.hc_pinn.problems import PROBLEMS
from tasks.hc_pinn.study import StudyCase
from tasks.hc_pinn.training import DEFAULT_LR, DEFAULT_THRESHOLD

logger = logging.getLogger(__name__)

DEFAULT_SPECS = ("poly 1", "poly 2", "poly 3", "poly 4", "sine 1", "sine 2", "sine 4", "dist 1",
                 "dist 2", "rfun 1", "rfun 2", "exp 1", "exp 4", "exp 16", "tanh 1", "tanh 4",
                 "tanh 16")


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
    rules = {"threshold": args.threshold, "collapse_loss": args.collapse_loss,
             "steps": args.steps}
    text = summary(runs, summaries, corrs, verdict_, time.perf_counter() - t0, **rules)
    console = Console(width=250)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    (args.out / "summary.md").write_text(text + "\n")
    write_results(args.out, config, runs, summaries, corrs, verdict_)
    draw(runs, corrs, summaries, args.out / "hc_pinn_study.png", seed=args.seeds[0], **rules)
    console.print(f"wrote {args.out}/results.json, results.csv, summary.md, hc_pinn_study.png",
                  markup=False, highlight=False)
    # the tables cover the runs that finished; a study with failed runs is incomplete
    return 1 if any(not r.ok for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
