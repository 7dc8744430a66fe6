"""Every notebook in notebooks/ runs top to bottom (nbclient, a real kernel) on the embedded
default with a small budget of train steps; their run directories go to a temporary folder."""

from __future__ import annotations

import os
import time

import nbformat
import pytest
from nbclient import NotebookClient

from tests import ROOT

pytestmark = pytest.mark.integration

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# the quickstart runs in the default suite; the others (half a minute each) with the long tests,
# which .ci/run runs after it
CASES = [pytest.param(p, id=p.stem, marks=() if p.stem.startswith("01_") else pytest.mark.long)
         for p in NOTEBOOKS]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", CASES)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLARC_NOTEBOOK_STEPS", "2")  # a step, then the rest
    monkeypatch.setenv("ROLLARC_RUN_DIR", str(tmp_path / "runs" / "reading"))
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    elapsed = time.perf_counter() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # every code cell ran, and the figures came out as images
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "no figure rendered"
    print(f"{path.name}: {elapsed:.0f} s with {os.environ['ROLLARC_NOTEBOOK_STEPS']} steps")
