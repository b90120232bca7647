"""Tables and plots of runs' metrics (RUN/metrics.jsonl, written by jaxrl.run.tracking).

Figures are drawn on `matplotlib.figure.Figure` objects and saved as PNG (Agg): no pyplot, so
no global backend switch and no figure left open in a long-lived process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxrl.run.run_dir import RunDir
from jaxrl.run.tracking import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The reward curve: the first of these keys a run logged.
REWARD_KEYS = ("reward/mean", "reward")
# The panels of metrics.png, those a run logged, in this order.
PANEL_METRICS = (
    "kl", "loss", "policy_loss", "entropy", "grad_norm", "clip_frac_low", "clip_frac_high",
    "response_length/mean", "completion_tokens", "learning_rate", "step_s", "tokens_per_s",
)
# Columns compare_runs adds after its metric, those any run logged.
COMPARE_KEYS = ("eval/reward/mean", "kl", "entropy", "response_length/mean", "step_s")


def summary_table(rows: Sequence[Mapping], keys: Sequence[str] | None = None) -> str:
    """Per metric, its last logged value and that value's step; rewards also get their max.

    `keys`: the metrics to show, in order (default: every metric in `rows`). A last value that
    was NaN shows as nan: the table never hides a diverged run behind an older finite value.
    """
    keys = list(keys) if keys is not None else _metric_keys(rows)
    body = []
    for key in keys:
        points = _points(rows, key)
        if not points:
            body.append([key, "-", "-", ""])
            continue
        step, final = points[-1]
        body.append([key, str(step), _fmt(final), _fmt(_max(points)) if _is_reward(key) else ""])
    return _table(["metric", "step", "final", "max"], body)


def plot_run(run_dir: str | Path, metrics: Sequence[str] = PANEL_METRICS) -> list[Path]:
    """Writes RUN/plots/reward.png and RUN/plots/metrics.png from RUN/metrics.jsonl.

    reward.png: the reward per step (with its std band when logged) and the `eval/...reward...`
    points. metrics.png: one panel per key of `metrics` the run logged. A figure with nothing
    to show is not written. Returns the paths written.
    """
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    paths = []
    reward = next((k for k in REWARD_KEYS if _points(rows, k)), None)
    evals = [k for k in _metric_keys(rows) if k.startswith("eval/") and "reward" in k]
    if reward or evals:
        fig = _figure((7, 4))
        ax = fig.subplots()
        if reward:
            _curve(ax, rows, reward, label=reward)
            std = _points(rows, "reward/std") if reward == "reward/mean" else []
            if std:
                steps, mean = _arrays(_points(rows, reward))
                spread = dict(std)
                width = np.array([spread.get(s, np.nan) for s in steps], dtype=float)
                ax.fill_between(steps, mean - width, mean + width, alpha=0.15, label="± std")
        for key in evals:
            ax.plot(*_arrays(_points(rows, key)), marker="o", linestyle="--", label=key)
        ax.set(xlabel="step", ylabel="reward", title=f"{run_dir.name}: reward")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        paths.append(_save(fig, out / "reward.png"))
    present = [k for k in metrics if _points(rows, k)]
    if present:
        cols = min(3, len(present))
        grid_rows = math.ceil(len(present) / cols)
        fig = _figure((4.2 * cols, 2.8 * grid_rows), suptitle=True)
        axes = list(fig.subplots(grid_rows, cols, squeeze=False).flat)
        for ax, key in zip(axes, present):
            _curve(ax, rows, key)
            ax.set_title(key, fontsize="medium")
            ax.grid(alpha=0.3)
        for ax in axes[len(present):]:  # the unused cells of the last row
            ax.set_visible(False)
        fig.suptitle(run_dir.name)
        paths.append(_save(fig, out / "metrics.png"))
    return paths


def compare_runs(run_dirs: Mapping[str, str | Path], out_dir: str | Path, metric: str = "reward/mean",
                 keys: Sequence[str] | None = None) -> tuple[str, Path]:
    """Compares runs: a table of their final metrics and OUT/compare_reward.png of `metric`.

    `run_dirs`: run name -> run directory; a run without metrics (it failed early) is listed
    with '-'. `keys`: the metrics after `metric` (default: those of COMPARE_KEYS any run
    logged). The table is returned as text and saved as OUT/summary.md (markdown). Returns
    (table, plot path).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {name: read_metrics(d) if RunDir(d).metrics.exists() else [] for name, d in run_dirs.items()}
    if keys is None:
        keys = [k for k in COMPARE_KEYS if any(_points(rows, k) for rows in runs.values())]
    columns = [metric] + [k for k in keys if k != metric]
    header = ["run", "steps"]
    for key in columns:
        header += [key, f"{key} (max)"] if _is_reward(key) else [key]
    body = []
    for name, rows in runs.items():
        line = [name, str(rows[-1]["step"]) if rows else "-"]
        for key in columns:
            points = _points(rows, key)
            line.append(_fmt(points[-1][1]) if points else "-")
            if _is_reward(key):
                line.append(_fmt(_max(points)) if points else "-")
        body.append(line)
    plot = _save(_overlay(runs, metric), out_dir / "compare_reward.png")
    (out_dir / "summary.md").write_text(
        f"# {out_dir.name}\n\n{_table(header, body, markdown=True)}\n\n![{metric}]({plot.name})\n"
    )
    return _table(header, body), plot


def _overlay(runs: Mapping[str, list[dict]], metric: str) -> Figure:
    fig = _figure((8, 4.5))
    ax = fig.subplots()
    plotted = 0
    for name, rows in runs.items():
        if _points(rows, metric):
            _curve(ax, rows, metric, label=name)
            plotted += 1
    if plotted:
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, f"no run has logged {metric} yet", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="step", ylabel=metric, title=metric)
    ax.grid(alpha=0.3)
    return fig


def _curve(ax, rows: Sequence[Mapping], key: str, label: str | None = None) -> None:
    """The curve of `key`; a long noisy one is drawn faint with its moving average on top."""
    steps, values = _arrays(_points(rows, key))
    window = len(values) // 20
    if window < 2:
        ax.plot(steps, values, label=label)
        return
    (line,) = ax.plot(steps, values, alpha=0.3)
    smooth = np.convolve(values, np.ones(window) / window, mode="valid")
    start = (window - 1) // 2  # centred: a trailing average would lag behind the curve
    ax.plot(steps[start:start + len(smooth)], smooth, color=line.get_color(), label=label)


def _points(rows: Sequence[Mapping], key: str) -> list[tuple[int, float | None]]:
    """(step, value) of the rows that logged `key`; None is a NaN or inf that was logged."""
    return [(row["step"], row[key]) for row in rows if key in row]


def _arrays(points) -> tuple[np.ndarray, np.ndarray]:
    steps = np.array([s for s, _ in points], dtype=float)
    values = np.array([np.nan if v is None else v for _, v in points], dtype=float)
    return steps, values


def _max(points) -> float | None:
    finite = [v for _, v in points if v is not None]
    return max(finite) if finite else None


def _metric_keys(rows: Sequence[Mapping]) -> list[str]:
    keys = {}
    for row in rows:
        keys.update((k, None) for k in row if k not in ("step", "time"))
    return list(keys)


def _is_reward(key: str) -> bool:
    return "reward" in key and not key.endswith("std")  # the max of a spread says nothing


def _fmt(value) -> str:
    return "nan" if value is None else f"{value:.4g}"


def _table(header: list[str], body: list[list[str]], markdown: bool = False) -> str:
    """Aligned columns: the first (names) left, the others (numbers) right."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def cells(row):
        return [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]

    if markdown:
        rule = ["-" * widths[0]] + ["-" * max(w - 1, 1) + ":" for w in widths[1:]]
        return "\n".join("| " + " | ".join(r) + " |" for r in [cells(header), rule, *map(cells, body)])
    rule = ["-" * w for w in widths]
    return "\n".join("  ".join(r).rstrip() for r in [cells(header), rule, *map(cells, body)])


def _figure(size: tuple[float, float], suptitle: bool = False) -> Figure:
    from matplotlib.figure import Figure  # imported when the first plot is drawn: 0.3 s of start-up

    # Margins fixed in inches: a layout engine measures every tick label, and took half the time of
    # drawing a run's plots (at the end of every run).
    w, h = size
    fig = Figure(figsize=size)
    fig.subplots_adjust(left=0.9 / w, right=1 - 0.2 / w, bottom=0.5 / h, top=1 - (0.65 if suptitle else 0.35) / h,
                        wspace=0.38, hspace=0.5)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def finish_report(run_dir: Path, out) -> dict[str, float]:
    """A finished run's plots and table of its main metrics (printed to `out`); returns their last values."""
    rows = read_metrics(run_dir)
    if not rows:
        return {}
    plot_run(run_dir)
    keys = [k for k in ("reward/mean", "eval/success", "eval/reward/mean", "loss", "kl", "entropy", "grad_norm",
                        "completion/model_tokens", "time/step_s") if any(k in r for r in rows)]
    print(summary_table(rows, keys), file=out, flush=True)
    last = {}
    for r in rows:
        last.update({k: r[k] for k in keys if r.get(k) is not None})
    return {k: round(float(v), 4) for k, v in last.items()}
