"""The RollArc page of the Dask dashboard (``/individual-rollarc``): a Bokeh document in the
scheduler's dashboard server, redrawn every second from the monitor's records
(:class:`flows.monitoring.records.RunRecords`).

Top: reward and per-env-task success against step and against wall time, evaluation rounds as
markers. Then the staleness histogram of trained trajectories, trajectories by state (trained,
dropped by reason), trajectories in flight per pool, the policy version each inference worker
holds, the pools' busy fractions over time, the reward service's figures, and the latest train
step's critical path (:mod:`flows.monitoring.critical_path`): its seconds by what it waited on,
as a stacked bar and a table, the gating trajectory and the bottleneck pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, FactorRange, HoverTool, SingleIntervalTicker
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from distributed.dashboard.components.scheduler import BOKEH_THEME

from flows.monitoring.critical_path import Category

UPDATE_MS = 1000
HEIGHT = 260
REWARD_KEYS = (("invocations", "invocations"), ("mean_batch", "trajectories per call"),
               ("latency_ms_p50", "latency p50 (ms)"), ("latency_ms_p99", "latency p99 (ms)"),
               ("throttles", "throttles"), ("cold_starts", "cold starts"),
               ("function_errors", "function errors"), ("lost", "trajectories lost"))


# the critical path's categories, in the colours of the benchmark's timelines where they match
CATEGORY_COLOURS = {Category.PREFILL: "#1f77b4", Category.DECODE: "#ff7f0e",
                    Category.KV_TRANSFER: "#17becf", Category.UNSPLIT: "#dbdbdb",
                    Category.ENV: "#2ca02c", Category.REWARD: "#9467bd", Category.TRAIN: "#d62728",
                    Category.WEIGHT_SYNC: "#e377c2", Category.CHECKPOINT: "#bcbd22",
                    Category.QUEUE: "#7f7f7f", Category.ORCHESTRATION: "#c7c7c7"}


def critical_path_html(step: dict | None) -> str:
    """The latest step's critical path: a stacked bar of its seconds by category, then a table
    of them, the gating trajectory and the bottleneck pool."""
    if not step:
        return "<h4>Critical path of the latest step</h4><p>No step trained yet.</p>"
    total = max(step["seconds"], 1e-12)
    cats = step["categories"]
    bar = "".join(f"<div title='{c} {s:.2f} s' style='width:{100 * s / total:.2f}%;"
                  f"background:{CATEGORY_COLOURS.get(c, '#cccccc')}'></div>"
                  for c, s in cats.items())
    rows = "".join(f"<tr><td><span style='color:{CATEGORY_COLOURS.get(c, '#cccccc')}'>"
                   f"&#9632;</span> {c}</td><td style='text-align:right'>{s:.2f} s</td>"
                   f"<td style='text-align:right'>{s / total:.0%}</td></tr>"
                   for c, s in cats.items())
    neck = step.get("bottleneck")
    share = step["pools"].get(neck, 0.0) / total if neck else 0.0
    pools = ", ".join(f"{p} {s:.2f} s" for p, s in step["pools"].items())
    return (f"<h4>Critical path of step {step['step']}: {step['seconds']:.2f} s</h4>"
            f"<div style='display:flex;height:18px;width:100%'>{bar}</div>"
            f"<table>{rows}</table><p>bottleneck pool: <b>{neck}</b> ({share:.0%} of the step); "
            f"by pool: {pools}; gating trajectory {step.get('gating_trajectory')} "
            f"({step.get('gating_turns', 0)} turns); from {step.get('source')} timings</p>")


def _color(i: int) -> str:
    return Category10_10[i % len(Category10_10)]


def _lines(rows: list[dict], x_key: str, names: list[str], key_of) -> dict:
    xs, ys, labels, colors = [], [], [], []
    for i, name in enumerate(names):
        pts = [(r[x_key], r[key_of(name)]) for r in rows
               if x_key in r and isinstance(r.get(key_of(name)), int | float)]
        if pts:
            xs.append([p[0] for p in pts])
            ys.append([p[1] for p in pts])
            labels.append(name)
            colors.append(_color(i))
    return {"xs": xs, "ys": ys, "name": labels, "color": colors}


def _bars(counts: dict) -> dict:
    names = [str(k) for k in counts]
    return {"name": names, "value": [float(v) for v in counts.values()],
            "color": [_color(i) for i in range(len(names))]}


class RollArcPage:
    """The figures and their sources; :meth:`update` redraws them from the monitor."""

    def __init__(self, records_of: Callable[[], Any]):
        self.records_of = records_of  # the monitor's RunRecords, or None
        self.title = Div(text="")
        self.src_step = ColumnDataSource(_lines([], "", [], str))
        self.src_reward = ColumnDataSource({"x": [], "y": [], "t": []})
        self.src_eval = ColumnDataSource({"x": [], "y": [], "name": [], "color": []})
        self.src_wall = ColumnDataSource(_lines([], "", [], str))
        self.src_stale = ColumnDataSource({"staleness": [], "count": []})
        self.src_states = ColumnDataSource(_bars({}))
        self.src_pools = ColumnDataSource(_bars({}))
        self.src_versions = ColumnDataSource(_bars({}))
        self.src_busy = ColumnDataSource(_lines([], "", [], str))
        self.reward_table = Div(text="")
        self.path_table = Div(text=critical_path_html(None), sizing_mode="stretch_width")

        opts = {"height": HEIGHT, "sizing_mode": "stretch_width", "tools": "pan,wheel_zoom,reset"}
        self.fig_step = self._curves("Reward and success per env task, by step",
                                     "policy version (train step)", self.src_step, "x", opts)
        self.fig_step.scatter("x", "y", source=self.src_eval, color="color", size=9,
                              marker="diamond", legend_label="evaluation")
        self.fig_wall = self._curves("Reward and success per env task, by wall time",
                                     "seconds of training", self.src_wall, "t", opts)
        self.fig_stale = figure(title="Staleness of trained trajectories",
                                x_axis_label="steps behind the trainer", **opts)
        self.fig_stale.vbar(x="staleness", top="count", width=0.8, source=self.src_stale)
        self.fig_stale.xaxis.ticker = SingleIntervalTicker(interval=1)
        self.fig_states = self._hbar("Trajectories: by state, trained, dropped by reason",
                                     self.src_states, opts)
        self.fig_pools = self._hbar("Trajectories in flight per pool", self.src_pools, opts)
        self.fig_versions = self._hbar("Policy version held by each inference worker",
                                       self.src_versions, opts)
        self.fig_busy = figure(title="Pool busy fraction (share of time its workers ran a task)",
                               x_axis_label="seconds since the run started", y_range=(0, 1.05),
                               **opts)
        self.fig_busy.multi_line("xs", "ys", color="color", legend_field="name",
                                 source=self.src_busy, line_width=2)
        for f in (self.fig_step, self.fig_wall, self.fig_busy):
            f.legend.location = "top_left"
            f.legend.background_fill_alpha = 0.5
        self.root = column(
            self.title, row(self.fig_step, self.fig_wall, sizing_mode="stretch_width"),
            row(self.fig_stale, self.fig_states, sizing_mode="stretch_width"),
            row(self.fig_pools, self.fig_versions, sizing_mode="stretch_width"),
            row(self.fig_busy, self.reward_table, sizing_mode="stretch_width"),
            self.path_table, sizing_mode="stretch_width")

    def _curves(self, title: str, x_label: str, lines: ColumnDataSource, reward_x: str,
                opts: dict):
        """Success per env task (one line each) and the mean reward (dashed)."""
        fig = figure(title=title, x_axis_label=x_label, **opts)
        fig.multi_line("xs", "ys", color="color", legend_field="name", source=lines,
                       line_width=2)
        fig.line(reward_x, "y", source=self.src_reward, color="black", line_dash="dashed",
                 legend_label="reward mean")
        return fig

    @staticmethod
    def _hbar(title: str, source: ColumnDataSource, opts: dict):
        fig = figure(title=title, y_range=FactorRange(), **opts)
        fig.hbar(y="name", right="value", height=0.7, color="color", source=source)
        fig.add_tools(HoverTool(tooltips=[("", "@name"), ("value", "@value")]))
        return fig

    def update(self) -> None:
        rec = self.records_of()
        if rec is None or rec.run_id is None:
            self.title.text = "<h3>RollArc</h3><p>No RollArc run has reported to this " \
                              "scheduler yet.</p>"
            return
        train, evals, live, names = rec.train, rec.evals, rec.live, rec.env_tasks
        last = train[-1] if train else {}
        state = "ended" if rec.ended else "running"
        self.title.text = (
            f"<h3>RollArc run {rec.run_id} ({state})</h3><p>policy version "
            f"{last.get('train/step', 0)}, reward mean {last.get('reward/mean', 0):+.3f}, "
            f"{last.get('perf/trajectories_per_s', 0):.1f} trajectories/s, staleness mean "
            f"{last.get('rollout/staleness_mean', 0):.2f}</p>")
        self.src_step.data = _lines(train, "train/step", names, lambda n: f"env/{n}/success")
        self.src_reward.data = {"x": [r["train/step"] for r in train],
                                "y": [r.get("reward/mean", 0.0) for r in train],
                                "t": [r.get("perf/elapsed_s", 0.0) for r in train]}
        ev = [(r["eval/step"], r[f"eval/{n}/success"], n, _color(i))
              for r in evals for i, n in enumerate(names) if f"eval/{n}/success" in r]
        self.src_eval.data = {"x": [e[0] for e in ev], "y": [e[1] for e in ev],
                              "name": [e[2] for e in ev], "color": [e[3] for e in ev]}
        self.src_wall.data = _lines(train, "perf/elapsed_s", names,
                                    lambda n: f"env/{n}/success")
        hist = Counter({int(k): v for k, v in live.get("staleness_hist", {}).items()})
        self.src_stale.data = {"staleness": sorted(hist), "count": [hist[k] for k in sorted(hist)]}
        states = dict(live.get("states", {}))
        states |= {f"dropped: {k}": v for k, v in live.get("dropped", {}).items()}
        self._set_bars(self.fig_states, self.src_states, states)
        self._set_bars(self.fig_pools, self.src_pools, live.get("in_flight_per_pool", {}))
        self._set_bars(self.fig_versions, self.src_versions, live.get("worker_versions", {}))
        pools = sorted(rec.busy)
        busy_rows = {p: list(rec.busy[p]) for p in pools}
        self.src_busy.data = {"xs": [[t for t, _ in busy_rows[p]] for p in pools],
                              "ys": [[f for _, f in busy_rows[p]] for p in pools],
                              "name": pools, "color": [_color(i) for i in range(len(pools))]}
        cells = "".join(f"<tr><td>{label}</td><td style='text-align:right'>"
                        f"{_fmt(last.get(f'reward/{key}'))}</td></tr>"
                        for key, label in REWARD_KEYS)
        self.reward_table.text = (f"<h4>Reward service</h4><table>{cells}</table>"
                                  f"<p>busy, mean: " + ", ".join(
                                      f"{p} {f:.0%}" for p, f in rec.busy_mean().items())
                                  + "</p>")
        self.path_table.text = critical_path_html(live.get("critical_path"))

    @staticmethod
    def _set_bars(fig, source: ColumnDataSource, counts: dict) -> None:
        data = _bars(counts)
        fig.y_range.factors = data["name"]
        source.data = data


def _fmt(v) -> str:
    if v is None:
        return "–"
    return f"{v:.1f}" if isinstance(v, float) and not float(v).is_integer() else f"{int(v)}"


def rollarc_doc(doc, records_of: Callable[[], Any]) -> None:
    """Build the page in a Bokeh document; ``records_of`` returns the current records."""
    page = RollArcPage(records_of)
    page.update()
    doc.add_periodic_callback(page.update, UPDATE_MS)
    doc.add_root(page.root)
    doc.title = "RollArc"
    doc.theme = BOKEH_THEME
