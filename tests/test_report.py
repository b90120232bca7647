"""Reports: the summary table, a run's plots and the comparison of runs, from synthetic metrics."""

import json

from jaxrl.run.report import compare_runs, plot_run, summary_table
from jaxrl.run.tracking import read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, steps=40, slope=0.01, eval_every=10, nan_last_kl=False):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {"step": step, "time": 1000.0 + step, "reward/mean": slope * step - 0.05 * (-1) ** step,
                   "reward/std": 0.2, "kl": 1e-3 * step, "loss": 1.0 / step, "grad_norm": 0.5}
            if eval_every and step % eval_every == 0:
                row["eval/reward/mean"] = slope * step
            if nan_last_kl and step == steps:
                row["kl"] = None
            f.write(json.dumps(row) + "\n")
    return run_dir


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


def test_summary_table_gives_final_values_and_the_reward_max(tmp_path):
    rows = read_metrics(_write_run(tmp_path / "run", nan_last_kl=True))
    lines = summary_table(rows).splitlines()
    assert lines[0].split() == ["metric", "step", "final", "max"]
    assert set(lines[1]) == {"-", " "}
    table = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert table["reward/mean"] == ["40", "0.35", "0.44"]  # the max at step 39
    assert table["eval/reward/mean"] == ["40", "0.4", "0.4"]
    assert table["reward/std"] == ["40", "0.2"]  # no max for a spread
    assert table["kl"] == ["40", "nan"]  # the last value is NaN: never an older finite one
    assert list(table) == ["reward/mean", "reward/std", "kl", "loss", "grad_norm", "eval/reward/mean"]
    # Aligned: every row as wide as the header's columns.
    assert len({len(line) for line in lines[:2]}) == 1


def test_summary_table_with_chosen_keys_marks_missing_ones(tmp_path):
    rows = read_metrics(_write_run(tmp_path / "run"))
    lines = summary_table(rows, keys=["kl", "entropy"]).splitlines()
    assert [line.split() for line in lines[2:]] == [["kl", "40", "0.04"], ["entropy", "-", "-"]]


def test_plot_run_writes_the_reward_and_metrics_figures(tmp_path):
    run = _write_run(tmp_path / "run")
    paths = plot_run(run)
    assert paths == [run / "plots" / "reward.png", run / "plots" / "metrics.png"]
    for path in paths:
        _assert_png(path)


def test_plot_run_skips_figures_without_data(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "kl": 0.1}\n{"step": 2, "kl": 0.2}\n')
    assert plot_run(run) == [run / "plots" / "metrics.png"]
    assert plot_run(run, metrics=("entropy",)) == []


def test_compare_runs_tables_plots_and_writes_markdown(tmp_path):
    runs = {
        "lr=1e-05": _write_run(tmp_path / "a", slope=0.01),
        "lr=3e-05": _write_run(tmp_path / "b", steps=30, slope=0.03, eval_every=0),
        "failed": tmp_path / "c",  # died before logging anything
    }
    table, plot = compare_runs(runs, tmp_path / "cmp")
    lines = table.splitlines()
    assert lines[0].split() == ["run", "steps", "reward/mean", "reward/mean", "(max)", "eval/reward/mean",
                                "eval/reward/mean", "(max)", "kl"]
    assert lines[2].split() == ["lr=1e-05", "40", "0.35", "0.44", "0.4", "0.4", "0.04"]
    assert lines[3].split() == ["lr=3e-05", "30", "0.85", "0.92", "-", "-", "0.03"]
    assert lines[4].split() == ["failed"] + ["-"] * 6
    assert plot == tmp_path / "cmp" / "compare_reward.png"
    _assert_png(plot)
    markdown = (tmp_path / "cmp" / "summary.md").read_text()
    assert "| run      | steps | reward/mean | reward/mean (max) |" in markdown
    assert "| lr=3e-05 |    30 |        0.85 |              0.92 |" in markdown
    assert "![reward/mean](compare_reward.png)" in markdown


def test_compare_runs_with_chosen_metric_and_keys(tmp_path):
    runs = {"a": _write_run(tmp_path / "a"), "b": _write_run(tmp_path / "b", steps=10)}
    table, plot = compare_runs(runs, tmp_path / "cmp", metric="loss", keys=["grad_norm"])
    assert [line.split() for line in table.splitlines()[2:]] == [["a", "40", "0.025", "0.5"],
                                                                  ["b", "10", "0.1", "0.5"]]
    _assert_png(plot)


def test_compare_runs_without_any_data_still_draws(tmp_path):
    table, plot = compare_runs({"a": tmp_path / "a"}, tmp_path / "cmp")
    assert table.splitlines()[2].split() == ["a", "-", "-", "-"]
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
