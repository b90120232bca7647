"""The vs_trl bench's figures from a run's metrics (the run itself needs TRL's venv and a primed model)."""

from experiments.bench.vs_trl import engine_figures


def test_engine_figures_are_medians_and_the_shares_of_ticks_and_rollout_in_device_calls():
    rows = [{"busy_s": 1.0, "device_s": 0.9, "insert_s": 0.45, "decode_calls": 6.0, "insert_calls": 5.0, "tokens": 4000.0,
             "rollout_s": 1.2},
            {"busy_s": 2.0, "device_s": 1.0, "insert_s": 0.2, "decode_calls": 8.0, "insert_calls": 7.0, "tokens": 4200.0,
             "rollout_s": 2.5},
            {"busy_s": 1.0, "device_s": 0.8, "insert_s": 0.2, "decode_calls": 7.0, "insert_calls": 6.0, "tokens": 3900.0,
             "rollout_s": 1.0}]
    figures = engine_figures(rows)
    assert figures == {"busy_s": 1.0, "device_s": 0.9, "insert_s": 0.2, "decode_calls": 7.0, "insert_calls": 6.0,
                       "tokens": 4000.0, "device_share_of_ticks": 0.8, "device_share_of_rollout": 0.75,
                       "insert_share_of_device": 0.25}


def test_a_run_without_engine_metrics_has_no_engine_figures():
    assert engine_figures([{"busy_s": None, "device_s": None, "insert_s": None, "rollout_s": 1.0}]) == {}
