"""Figures over repeated runs: the median with its spread (the lowest and highest repeat), and
ratios between two systems taken repeat by repeat (the runs of one repeat ran back to back, so
that machine drift hits both alike) and called a gain only when every repeat agrees."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from statistics import median


@dataclass(frozen=True)
class Spread:
    """The median of a figure over repeats, and its lowest and highest."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        xs = [float(v) for v in values]
        if not xs:
            return cls(float("nan"), float("nan"), float("nan"))
        return cls(median(xs), min(xs), max(xs))

    def text(self, digits: int = 2, brackets: str = "()") -> str:
        """``"1.23 (1.10-1.40)"``; the bare median when every repeat agrees (or one ran)."""
        m = f"{self.median:.{digits}f}"
        lo, hi = f"{self.low:.{digits}f}", f"{self.high:.{digits}f}"
        if lo == hi:
            return m
        return f"{m} {brackets[0]}{lo}-{hi}{brackets[1]}"


class Verdict(StrEnum):
    GAIN = "gain"
    LOSS = "loss"
    NONE = "no difference"
    ONE_RUN = "one run"  # no spread to judge by


def verdict(ratios: Sequence[float]) -> Verdict:
    """A gain when every paired ratio is above 1, a loss when every one is below, else no
    difference (the spread includes 1); a single ratio has no spread and gets no verdict."""
    if len(ratios) < 2:
        return Verdict.ONE_RUN
    if ratios and min(ratios) > 1.0:
        return Verdict.GAIN
    if ratios and max(ratios) < 1.0:
        return Verdict.LOSS
    return Verdict.NONE


def paired_ratios(runs: Sequence[dict], reference: Sequence[dict],
                  figure: Callable[[dict], float], lower_is_better: bool) -> list[float]:
    """Per repeat, the reference's advantage on ``figure`` over the system's: the system's
    over the reference's for a time (s/step), the reference's over the system's for a
    throughput. Above 1: the reference did better. Repeats missing on either side are left
    out."""
    out = []
    for r, b in zip(runs, reference, strict=False):
        x, y = figure(r), figure(b)
        if not (x and y and x == x and y == y):  # a zero or NaN figure has no ratio
            continue
        out.append(x / y if lower_is_better else y / x)
    return out


@dataclass(frozen=True)
class Ratio:
    """Paired ratios of one figure with their median, spread and verdict."""

    values: tuple[float, ...]

    @property
    def spread(self) -> Spread:
        return Spread.of(self.values)

    @property
    def verdict(self) -> Verdict:
        return verdict(self.values)

    def text(self) -> str:
        """``"1.63 [1.50, 1.80] gain"``."""
        if not self.values:
            return "-"
        s = self.spread
        inner = f" [{s.low:.2f}, {s.high:.2f}]" if len(self.values) > 1 else ""
        return f"{s.median:.2f}{inner} {self.verdict}"

    def as_dict(self) -> dict:
        s = self.spread
        return {"per_repeat": list(self.values), "median": s.median, "min": s.low,
                "max": s.high, "verdict": str(self.verdict)}


def ratio(runs: Sequence[dict], reference: Sequence[dict], figure: Callable[[dict], float],
          lower_is_better: bool) -> Ratio:
    return Ratio(tuple(paired_ratios(runs, reference, figure, lower_is_better)))
