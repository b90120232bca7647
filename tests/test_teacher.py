"""The distillation teacher scores an episode's tokens as the learner scores them, batching the
episodes that finish together in one compiled program."""

import asyncio

import numpy as np
import pytest

from bridge.teacher import Teacher
from jaxrl.compilation import programs
from jaxrl.logprobs import completion_logprobs
from jaxrl.models import load_pretrained
from jaxrl.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=3)


def test_the_teacher_scores_each_completion_token_as_the_learner_does(model_dir):
    teacher = Teacher(model_dir, max_seq_len=64, rows=4)
    rng = np.random.default_rng(0)
    episodes = [(rng.integers(1, 200, p).tolist(), rng.integers(1, 200, c).tolist())
                for p, c in [(5, 9), (12, 30), (1, 3), (20, 20), (7, 11), (3, 40)]]
    before = programs()

    async def score_all():
        return await asyncio.gather(*(teacher.score(p, c) for p, c in episodes))

    scores = asyncio.run(score_all())
    assert programs() == before, "the teacher compiled its program before the first episode"
    assert teacher.batcher.stats["episodes"] == 6 and teacher.batcher.stats["batches"] == 2  # 4 rows, then 2
    model = load_pretrained(model_dir)
    for (prompt, completion), logp in zip(episodes, scores):
        ref, _ = completion_logprobs(model, np.asarray([prompt]), np.ones((1, len(prompt)), np.int32),
                                     np.asarray([completion]), np.ones((1, len(completion)), np.int32))
        assert logp.dtype == np.float32 and logp.shape == (len(completion),)
        np.testing.assert_allclose(logp, np.asarray(ref)[0], atol=2e-5)


def test_an_episode_longer_than_the_teacher_holds_is_refused(model_dir):
    teacher = Teacher(model_dir, max_seq_len=16, rows=2)
    with pytest.raises(ValueError, match="an episode of 20 tokens is longer than the teacher's 16"):
        asyncio.run(teacher.score([1] * 10, [2] * 10))


def test_a_teacher_of_another_vocabulary_is_refused(model_dir):
    with pytest.raises(ValueError, match=r"a vocabulary of \d+ tokens, the student's has 7; the teacher must share"):
        Teacher(model_dir, max_seq_len=16, vocab_size=7)
