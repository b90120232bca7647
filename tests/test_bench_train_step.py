"""The train-step benchmark runs a few tiny steps and prints the split of a step as JSON."""

import math

import pytest

from benches import tiny_figures


@pytest.mark.timeout(660)  # past pytest's 300 s: its own limit (600 s) says what stopped it
def test_tiny_benchmark_prints_the_step_split():
    figures = tiny_figures("train_step", timeout=600)
    for key in ("step_s", "generate_s", "env_s", "learn_s", "sync_s"):
        assert isinstance(figures[key], float) and math.isfinite(figures[key]) and figures[key] >= 0, key
    assert figures["step_s"] > 0 and figures["steps_measured"] == 2
    assert figures["generate_s"] + figures["env_s"] + figures["learn_s"] + figures["sync_s"] <= figures["step_s"] * 1.01
