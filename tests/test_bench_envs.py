"""The environments benchmark keeps working (tiny sizes; the figures themselves are not asserted)."""

from benches import tiny_figures


def test_tiny_envs_benchmark_prints_its_figures():
    figures = tiny_figures("envs")
    for key in ("env_steps_per_s", "raw_env_steps_per_s", "bridge_over_raw", "fresh_env_steps_per_s",
                "fresh_raw_env_steps_per_s", "fresh_bridge_over_raw", "episodes_per_s",
                "sessions", "episodes", "steps"):
        assert figures[key] > 0, key
