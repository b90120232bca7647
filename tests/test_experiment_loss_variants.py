"""The loss-variants example at toy size: two objectives trained, compared in a table and a plot."""

import yaml

from examples import toy_result


def test_toy_loss_variants_compare_two_runs(tmp_path):
    result = toy_result("loss_variants", tmp_path, "--set", "learner.num_iterations=2")
    assert result["runs"] == 2 and set(result["variants"]) == {"grpo", "cispo"}
    assert (tmp_path / "compare_reward.png").stat().st_size > 0
    assert "| cispo |" in (tmp_path / "variants.md").read_text()
    assert "cispo_seed0" in (tmp_path / "summary.md").read_text()
    ran = yaml.safe_load((tmp_path / "runs" / "cispo_seed0" / "config.yaml").read_text())
    assert ran["learner"]["num_iterations"] == 2 and ran["learner"]["loss"]["loss_type"] == "cispo"
