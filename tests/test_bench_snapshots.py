"""The snapshot benchmark runs at a tiny size and prints its figures as a JSON last line."""

import math

from benches import tiny_figures

KEYS = ("round_trip_ratio", "round_trip_warm_ratio", "publish_s", "load_s", "publish_ratio", "load_ratio",
        "publish_same_work_ratio", "load_warm_s", "load_warm_ratio", "numpy_save_s", "numpy_publish_s",
        "numpy_load_s", "numpy_load_warm_s", "convert_s", "checksum_s", "size_mb", "orbax_round_trip_ratio",
        "orbax_save_s", "orbax_load_s", "orbax_save_ratio", "orbax_load_ratio", "orbax_load_warm_ratio")


def test_tiny_benchmark_prints_figures(tmp_path):
    figures = tiny_figures("snapshots", "--dir", str(tmp_path), timeout=120)
    for key in KEYS:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, figures)
    assert figures["size_mb"] >= 4 and figures["repeats"] == 2
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself
