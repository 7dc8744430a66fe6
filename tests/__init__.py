"""The test suite: unit tests by package (unit/flows, unit/tasks, unit/resources),
integration tests on real Dask clusters, end-to-end runs of the entry points, and the fault drills."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository

# The overrides of a short, quiet run, in one place: no progress line, no evaluation rounds, a
# free dashboard port; SMALL adds two groups per batch; NO_PICTURES skips the end-of-run curves
# and Dask's performance report
QUIET = ["metrics.progress=false", "eval.every_steps=0", "cluster.dashboard_port=0"]
SMALL = [*QUIET, "trainer.groups_per_step=2"]
NO_PICTURES = ["metrics.curves=false", "metrics.performance_report=false"]
