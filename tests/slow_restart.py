"""A worker preload (``preload=["tests.slow_restart"]``) for the restart test: once the file
named by ``ROLLARC_TEST_SLOW_START`` exists, a worker's start waits the seconds it holds, as a
worker process does that loads torch and an engine on a busy machine."""

import os
import time
from pathlib import Path


def dask_setup(worker) -> None:
    marker = os.environ.get("ROLLARC_TEST_SLOW_START")
    if marker and Path(marker).is_file():
        time.sleep(float(Path(marker).read_text()))
