"""The engine profile (flows/bench_engine.py, flows/benchmarks/engine_profile.py): its features are
the device model's own work terms, the checkerboard split holds every point out with fitted
neighbours, both fits recover known constants from synthetic step times, and a quick ``hf``
profile runs end to end and writes its report."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from flows.benchmarks.engine_profile import (
    Fit,
    Grid,
    Point,
    featurize,
    fit_additive,
    fit_and_check,
    split,
    summary_line,
)
from resources.catalog import get_profile
from resources.device_model import DeviceModel, ModelSpec
from tests import ROOT

# config/vllm.yaml's tiny Qwen2 (vocab of the tiny tokenizer), float32 as the CPU engines run it
TINY = ModelSpec.from_hf_config(dict(
    model_type="qwen2", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, vocab_size=349, tie_word_embeddings=True),
    kv_bytes=4, bytes_per_param=4)


def _grid_points(grid: Grid) -> list[Point]:
    return ([Point("decode", b, c, float(c), [1.0]) for b in grid.batches for c in grid.contexts]
            + [Point("prefill", n, c, float(c), [1.0]) for n in grid.chunks
               for c in grid.contexts])


def _synthetic(form: str, floor: float, flops_per_s: float, bytes_per_s: float,
               noise: float = 0.01) -> list[Point]:
    """The default grid's points with times from ``form`` and multiplicative noise."""
    grid = Grid()
    points = _grid_points(grid)
    featurize(points, DeviceModel(TINY, get_profile("CPU")))
    truth = Fit(form, floor, flops_per_s, bytes_per_s)
    rng = np.random.default_rng(0)
    for p in points:
        p.samples = [truth.predict(p.flops, p.bytes) * (1 + noise * rng.standard_normal())]
    split(points, grid)
    return points


def test_features_are_the_device_models_work_terms():
    """A roofline fit with the device's own floor and throughputs gives back
    DeviceModel.decode_step_time and prefill_time exactly: the profile fits the model's form."""
    dev = DeviceModel(TINY, get_profile("H800"))
    assert dev.step_floor > 0
    points = _grid_points(Grid())
    featurize(points, dev)
    own = Fit("roofline", dev.step_floor, dev.hw.peak_flops * dev.mfu,
              dev.hw.mem_bandwidth * dev.mbu)
    for p in points:
        expected = (dev.decode_step_time([p.context] * p.size) if p.kind == "decode"
                    else dev.prefill_time(p.size, p.context))
        assert own.predict(p.flops, p.bytes) == pytest.approx(expected, rel=1e-12)


def test_checkerboard_split_holds_out_half_with_fitted_neighbours():
    grid = Grid()
    points = _grid_points(grid)
    split(points, grid)
    by_key = {(p.kind, p.size, p.context): p.half for p in points}
    held = [p for p in points if p.half == "held_out"]
    assert abs(len(held) - len(points) / 2) <= 1
    for kind, sizes in (("decode", grid.batches), ("prefill", grid.chunks)):
        halves = {by_key[(kind, s, c)] for s in sizes for c in grid.contexts}
        assert halves == {"fit", "held_out"}
        for i, s in enumerate(sizes):
            for j, c in enumerate(grid.contexts):
                if by_key[(kind, s, c)] == "held_out":
                    neighbours = [by_key[(kind, sizes[i2], grid.contexts[j2])]
                                  for i2, j2 in ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1))
                                  if 0 <= i2 < len(sizes) and 0 <= j2 < len(grid.contexts)]
                    assert set(neighbours) == {"fit"}
    quick = Grid.quick()
    assert len(_grid_points(quick)) / len(points) == pytest.approx(0.27, abs=0.03)


def _throughputs(points: list[Point]) -> tuple[float, float]:
    """F and B at which both terms matter on this grid: compute-bound big prefills, memory-bound
    small decodes."""
    flops = np.array([p.flops for p in points])
    nbytes = np.array([p.bytes for p in points])
    bytes_per_s = 1e9
    return float(np.median(flops / (nbytes / bytes_per_s))), bytes_per_s


def test_roofline_fit_recovers_its_constants_and_predicts_the_held_out_half():
    probe = _synthetic("roofline", 1e-3, 1.0, 1.0)
    flops_per_s, bytes_per_s = _throughputs(probe)
    points = _synthetic("roofline", 2e-4, flops_per_s, bytes_per_s)
    bound = {p.flops / flops_per_s > p.bytes / bytes_per_s for p in points}
    assert bound == {True, False}  # both sides of the roof are on the grid
    fits = fit_and_check(points)
    roof = fits["roofline"]
    assert roof.floor_s == pytest.approx(2e-4, rel=0.1)
    assert roof.flops_per_s == pytest.approx(flops_per_s, rel=0.05)
    assert roof.bytes_per_s == pytest.approx(bytes_per_s, rel=0.05)
    assert roof.held_out_error["mean"] < 0.02
    assert roof.held_out_error["mean"] <= fits["additive"].held_out_error["mean"]
    assert all(set(p.predicted) == {"roofline", "additive"} for p in points)


def test_additive_fit_recovers_its_constants():
    probe = _synthetic("additive", 1e-3, 1.0, 1.0)
    flops_per_s, bytes_per_s = _throughputs(probe)
    points = _synthetic("additive", 5e-4, flops_per_s, bytes_per_s, noise=0.0)
    fit = fit_additive([p for p in points if p.half == "fit"])
    assert fit.floor_s == pytest.approx(5e-4, rel=1e-3)
    assert fit.flops_per_s == pytest.approx(flops_per_s, rel=1e-3)
    assert fit.bytes_per_s == pytest.approx(bytes_per_s, rel=1e-3)


def test_a_term_the_times_do_not_show_is_reported_unbounded():
    """Times flat in compute: the additive fit drops the FLOP term (None), predictions finite."""
    points = _synthetic("additive", 1e-3, 1.0, 1.0)
    for p in points:
        p.samples = [1e-3 + p.bytes / 1e9]
    fits = fit_and_check(points)
    assert fits["additive"].flops_per_s is None
    assert fits["additive"].held_out_error["max"] < 1e-6
    line = summary_line(fits)
    assert line.startswith("held-out error: mean ") and "(roofline) / mean " in line
    assert line.endswith("(additive)")


def test_quick_hf_profile_writes_its_report(tmp_path):
    out = tmp_path / "hf.json"
    run = subprocess.run([sys.executable, "flows/bench_engine.py", "--backend", "hf", "--quick",
                          "--reps", "3", "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "held-out error: mean" in run.stdout
    report = json.loads(out.read_text())
    assert report["backend"] == "hf" and report["quick"] is True
    assert report["model_spec"]["q_dim"] == 64 and report["model_spec"]["layers"] == 2
    points = report["points"]
    assert len(points) == 12
    assert {p["half"] for p in points} == {"fit", "held_out"}
    assert all(len(p["samples"]) == 3 and p["seconds"] > 0 for p in points)
    for form in ("roofline", "additive"):
        fit = report["fits"][form]
        assert fit["floor_s"] >= 0
        assert math.isfinite(fit["held_out_error"]["mean"])
    assert report["better"] in ("roofline", "additive") and report["split"]
