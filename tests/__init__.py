"""The test suite: unit tests by package (unit/flows, unit/tasks, unit/resources),
integration tests on real Dask clusters, end-to-end runs of the entry points, and the fault drills."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
# PYTHONPATH of the processes the tests start: this checkout's packages first, wherever the
# editable install points
CHECKOUT_PYTHONPATH = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

# The overrides of a short, quiet run, in one place: no progress line, no evaluation rounds, a
# free dashboard port; SMALL adds two groups per batch; NO_PICTURES skips the end-of-run curves
# and Dask's performance report
QUIET = ["metrics.progress=false", "eval.every_steps=0", "cluster.dashboard_port=0"]
SMALL = [*QUIET, "trainer.groups_per_step=2"]
NO_PICTURES = ["metrics.curves=false", "metrics.performance_report=false"]
