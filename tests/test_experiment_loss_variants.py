"""The loss-variants example at toy size: two objectives trained, compared in a table and a plot."""

from examples import toy_result


def test_toy_loss_variants_compare_two_runs(tmp_path):
    result = toy_result("loss_variants", tmp_path)
    assert result["runs"] == 2 and set(result["variants"]) == {"grpo", "cispo"}
    assert (tmp_path / "compare_reward.png").stat().st_size > 0
    assert "| cispo |" in (tmp_path / "variants.md").read_text()
    assert "cispo_seed0" in (tmp_path / "summary.md").read_text()
