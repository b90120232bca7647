"""The critique-and-revise example at toy size: its rollout function trained end to end through
`jaxrl train`'s processes, the revision's and the first answer's rewards logged side by side."""

from examples import toy_result


def test_toy_critique_revise_trains_on_the_rollout_function(tmp_path):
    result = toy_result("critique_revise", tmp_path)
    assert result["steps"] == 2
    assert 0 <= result["reward/env_last_quarter"] <= 1 and 0 <= result["reward/answer_last_quarter"] <= 1
    assert "reward/answer" in (tmp_path / "summary.md").read_text()
