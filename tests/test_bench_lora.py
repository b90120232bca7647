"""The LoRA benchmark runs at a tiny size and prints its figures (ratios first) as a JSON last line."""

import math

import pytest

from benches import tiny_figures

KEYS = ("learner_peak_rss_ratio", "learner_xla_peak_ratio", "snapshot_bytes_ratio", "publish_load_time_ratio",
        "decode_unmerged_over_plain", "merge_s", "lora_load_s", "full_peak_rss_mb", "lora_peak_rss_mb",
        "full_snapshot_bytes", "lora_snapshot_bytes", "full_publish_load_s", "lora_publish_load_s")


@pytest.mark.timeout(660)  # past pytest's 300 s: its own limit (600 s) says what stopped it
def test_tiny_benchmark_prints_figures(tmp_path):
    figures = tiny_figures("lora", "--dir", str(tmp_path), timeout=600)
    for key in KEYS:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, figures)
    assert figures["lora_trained_params"] < figures["full_trained_params"] == figures["params"]
    assert figures["snapshot_bytes_ratio"] < 1
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself
