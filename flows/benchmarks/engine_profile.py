"""The engine profile's grid, features, fits and report (``flows/bench_engine.py`` measures).

The device model (:mod:`resources.device_model`) says one engine step takes
``floor + communication + max(FLOPs / F, bytes / B)``. Whether that *shape* predicts a real
engine is checked here on measured step times: a decode step of a batch at a context length, and
a prefill chunk of ``n`` tokens after ``c`` cached ones. The features of each point are the device
model's own work terms (:meth:`DeviceModel.decode_work` / :meth:`DeviceModel.prefill_work`: FLOPs,
and the bytes of the weights its tokens touch and of the KV), so what is fitted is the project's
model, not a new one. Two forms are fitted on one half of the grid and checked on the other, both
minimising *relative* error (times span orders of magnitude):

- **roofline**: ``t = floor + max(flops / F, bytes / B)``, the device model's own form
  (``scipy.optimize.least_squares``);
- **additive**: ``t = floor + flops / F + bytes / B`` (non-negative least squares).

The fitted floor is the engine's :attr:`DeviceModel.step_floor` (host step plus each layer's
kernels); an engine profiled here runs on one device, so there is no communication term. A
coefficient fitted to zero means that term is not resolved by the grid: its throughput is
reported as ``None`` (unbounded).

The split is a checkerboard: a decode point is fitted when its batch index plus its context index
is even, a prefill point when its chunk index plus context index is; the rest are held out. Every
held-out point's neighbours along both axes are fitted ones, so the check is out of sample
without leaving any batch, context or chunk unseen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import mean
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from scipy.optimize import least_squares, nnls

from resources.device_model import DeviceModel

SPLIT = ("checkerboard: a decode point is fitted when (batch index + context index) is even, a "
         "prefill point when (chunk index + context index) is even; the others are held out")
FORMS = ("roofline", "additive")


@dataclass(frozen=True)
class Grid:
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    contexts: tuple[int, ...] = (32, 64, 128, 192)
    chunks: tuple[int, ...] = (16, 32, 64, 128)

    @classmethod
    def quick(cls) -> Grid:
        """About a quarter of the default grid, its corners kept."""
        return cls(batches=(1, 4, 16, 64), contexts=(32, 192), chunks=(16, 128))


@dataclass
class Point:
    """One grid point. ``kind`` decode: ``batch`` sequences at ``context`` tokens each (``size``
    = batch); prefill: one chunk of ``size`` tokens after ``context`` cached ones (batch 1).
    ``kv_context`` is the mean context the timed steps actually ran at (a decode step adds a
    token to each sequence); ``seconds`` the median of ``samples``."""

    kind: str
    size: int
    context: int
    kv_context: float
    samples: list[float]
    half: str = ""
    flops: float = 0.0
    bytes: float = 0.0
    predicted: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return float(np.median(self.samples))


@dataclass
class Fit:
    form: str
    floor_s: float
    flops_per_s: float | None  # None: the compute term fitted to zero (unbounded)
    bytes_per_s: float | None
    fit_error: dict[str, float] = field(default_factory=dict)
    held_out_error: dict[str, float] = field(default_factory=dict)
    compute_bound: int = 0  # fit-half points whose compute term exceeds the memory term


    def terms(self, flops: float, nbytes: float) -> tuple[float, float]:
        return (flops / self.flops_per_s if self.flops_per_s else 0.0,
                nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def predict(self, flops: float, nbytes: float) -> float:
        compute, memory = self.terms(flops, nbytes)
        combined = max(compute, memory) if self.form == "roofline" else compute + memory
        return self.floor_s + combined


def split(points: list[Point], grid: Grid) -> None:
    """Mark each point ``fit`` or ``held_out`` by the checkerboard of :data:`SPLIT`."""
    for p in points:
        sizes = grid.batches if p.kind == "decode" else grid.chunks
        even = (sizes.index(p.size) + grid.contexts.index(p.context)) % 2 == 0
        p.half = "fit" if even else "held_out"


def work(device: DeviceModel, kind: str, size: int, kv_context: float) -> tuple[float, float]:
    """The device model's FLOPs and bytes of one step, as its ``*_time`` methods count them."""
    if kind == "decode":
        return device.decode_work(size, size * kv_context)
    return device.prefill_work(size, round(kv_context))


def featurize(points: list[Point], device: DeviceModel) -> None:
    for p in points:
        p.flops, p.bytes = work(device, p.kind, p.size, p.kv_context)


def _columns(points: list[Point]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features scaled to order one (floor, flops, bytes columns), their scales, and times."""
    x = np.array([[1.0, p.flops, p.bytes] for p in points])
    scale = np.maximum(x.max(axis=0), 1e-300)
    return x / scale, scale, np.array([p.seconds for p in points])


def _fit_from(form: str, coef: np.ndarray, scale: np.ndarray) -> Fit:
    """A :class:`Fit` from coefficients on scaled columns (each the term's largest contribution,
    in seconds); a term below 1e-9 of their sum counts as zero (solvers stop short of it)."""
    coef = np.where(coef < 1e-9 * coef.sum(), 0.0, coef)
    floor, a, b = (float(c) / float(s) for c, s in zip(coef, scale, strict=True))
    return Fit(form, floor, 1.0 / a if a > 0 else None, 1.0 / b if b > 0 else None)


def fit_additive(points: list[Point]) -> Fit:
    """``floor + flops/F + bytes/B``: non-negative least squares on relative residuals."""
    x, scale, t = _columns(points)
    coef, _ = nnls(x / t[:, None], np.ones(len(t)))
    return _fit_from("additive", coef, scale)


def fit_roofline(points: list[Point], start: Fit | None = None) -> Fit:
    """``floor + max(flops/F, bytes/B)`` by ``least_squares`` on relative residuals, from a few
    starts (``start``'s constants among them: max() makes the cost non-smooth); the best kept."""
    x, scale, t = _columns(points)

    def residuals(c: np.ndarray) -> np.ndarray:
        return (c[0] * x[:, 0] + np.maximum(c[1] * x[:, 1], c[2] * x[:, 2])) / t - 1.0

    lo = float(t.min())
    starts = [np.array([lo / 2, lo, lo]), np.array([lo / 2, t.max(), lo]),
              np.array([lo / 2, lo, t.max()]), np.array([lo, 0.0, 0.0])]
    if start is not None:
        starts.append(np.array([start.floor_s * scale[0],
                                scale[1] / start.flops_per_s if start.flops_per_s else 0.0,
                                scale[2] / start.bytes_per_s if start.bytes_per_s else 0.0]))
    best = min((least_squares(residuals, s0, bounds=(0.0, np.inf)) for s0 in starts),
               key=lambda r: r.cost)
    return _fit_from("roofline", best.x, scale)


def errors(fit: Fit, points: list[Point]) -> dict[str, float]:
    rel = [abs(fit.predict(p.flops, p.bytes) - p.seconds) / p.seconds for p in points]
    return {"mean": mean(rel), "max": max(rel)} if rel else {"mean": float("nan"),
                                                             "max": float("nan")}


def fit_and_check(points: list[Point]) -> dict[str, Fit]:
    """Both forms fitted on the ``fit`` half, their errors on each half, and every point's
    predictions stored on it."""
    train = [p for p in points if p.half == "fit"]
    held = [p for p in points if p.half == "held_out"]
    additive = fit_additive(train)
    fits = {"roofline": fit_roofline(train, start=additive), "additive": additive}
    for name, f in fits.items():
        f.fit_error, f.held_out_error = errors(f, train), errors(f, held)
        f.compute_bound = sum(c > m for c, m in (f.terms(p.flops, p.bytes) for p in train))
        for p in points:
            p.predicted[name] = f.predict(p.flops, p.bytes)
    return fits


def better(fits: dict[str, Fit]) -> str:
    return min(fits, key=lambda k: fits[k].held_out_error["mean"])


def summary_line(fits: dict[str, Fit]) -> str:
    parts = [f"mean {fits[k].held_out_error['mean']:.1%}, max {fits[k].held_out_error['max']:.1%}"
             f" ({k})" for k in FORMS]
    return "held-out error: " + " / ".join(parts)


def _duration(seconds: float) -> str:
    for factor, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(seconds) >= factor:
            return f"{seconds / factor:.4g} {unit}"
    return f"{seconds * 1e9:.4g} ns"


def _si(x: float | None, unit: str) -> str:
    if x is None:
        return "unbounded (term fitted to 0)"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def print_report(console: Console, points: list[Point], fits: dict[str, Fit], unit: str,
                 title: str) -> None:
    """The held-out points (measured, predicted, error), the constants and the summary line.
    A roofline with no compute-bound fit point bounds F from below only."""
    train = [p for p in points if p.half == "fit"]
    table = Table(title=f"{title}: held-out points ({unit})")
    for col in ("kind", "batch/chunk", "context", "measured", "roofline", "err", "additive",
                "err"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for p in sorted((p for p in points if p.half == "held_out"),
                    key=lambda p: (p.kind, p.size, p.context)):
        cells = [p.kind, str(p.size), str(p.context), _duration(p.seconds)]
        for k in FORMS:
            pred = p.predicted[k]
            cells += [_duration(pred), f"{(pred - p.seconds) / p.seconds:+.1%}"]
        table.add_row(*cells)
    console.print(table)
    consts = Table(title="fitted constants (fit half)")
    for col in ("form", "floor", "effective FLOP/s", "effective bytes/s", "fit-half mean err",
                "held-out mean err", "held-out max err", "compute-bound fit points"):
        consts.add_column(col, justify="right")
    for k in FORMS:
        f = fits[k]
        consts.add_row(k, _duration(f.floor_s), _si(f.flops_per_s, "FLOP/s"),
                       _si(f.bytes_per_s, "B/s"), f"{f.fit_error['mean']:.1%}",
                       f"{f.held_out_error['mean']:.1%}", f"{f.held_out_error['max']:.1%}",
                       f"{f.compute_bound} of {len(train)}")
    console.print(consts)
    console.print(f"split: {SPLIT}")
    console.print(f"better on the held-out half: {better(fits)}")
    console.print(summary_line(fits))


def report_json(points: list[Point], fits: dict[str, Fit], grid: Grid,
                extra: dict[str, Any]) -> dict[str, Any]:
    def point(p: Point) -> dict[str, Any]:
        return dict(asdict(p), seconds=p.seconds)

    return dict(extra, grid=asdict(grid), split=SPLIT, points=[point(p) for p in points],
                fits={k: asdict(f) for k, f in fits.items()}, better=better(fits),
                summary=summary_line(fits))

