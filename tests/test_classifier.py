"""A classifier reward model scores a conversation as transformers' sequence-classification model of
the same checkpoint does, batching the episodes that finish together, with every program compiled
before the first."""

import asyncio

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from bridge.classifier import RewardClassifier
from jaxrl.compilation import programs
from jaxrl.models import Decoder, save_classifier
from jaxrl.tiny import build_tiny_classifier, tiny_config
from jaxrl.tiny_tokenizer import build_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Repeat: red fox"}, {"role": "assistant", "content": "red fox"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Again, louder."},
     {"role": "assistant", "content": "HI!"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3},
     {"role": "assistant", "content": "z y x"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two three"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("classifier") / "rm", seed=2)


@pytest.fixture(scope="module")
def newline_padded_dir(tmp_path_factory):
    """A checkpoint whose padding token is the newline that ends every turn of the chat template."""
    tok = build_tokenizer()
    [newline] = tok.encode("\n", add_special_tokens=False)
    return build_tiny_classifier(tmp_path_factory.mktemp("classifier") / "nl", seed=2, tokenizer=tok,
                                 pad_token_id=newline)


@pytest.mark.parametrize("padding", ["endoftext", "newline"])
def test_scores_equal_transformers_on_the_conversation_its_chat_template_renders(padding, request):
    model_dir = request.getfixturevalue({"endoftext": "model_dir", "newline": "newline_padded_dir"}[padding])
    classifier = RewardClassifier(model_dir, max_seq_len=200, rows=4)
    before = programs()

    async def score_all():
        return await asyncio.gather(*(classifier.score(c) for c in CONVERSATIONS))

    scores = asyncio.run(score_all())
    assert programs() == before, "the classifier compiled its programs before the first conversation"
    assert classifier.batcher.stats["episodes"] == 5 and classifier.batcher.stats["batches"] == 2  # 4 rows, then 1
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir)
    for conversation, score in zip(CONVERSATIONS, scores):
        ids = classifier.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
        assert classifier.render(conversation) == list(ids)
        assert (ids[-1] == classifier.pad_id) == (padding == "newline")  # read before the turn's last token
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-4)
    assert len({round(s, 4) for s in scores}) == len(scores)  # the head reads each conversation


def test_a_conversation_longer_than_the_classifier_holds_is_refused(model_dir):
    classifier = RewardClassifier(model_dir, max_seq_len=64, rows=2)
    with pytest.raises(ValueError, match=r"a conversation of \d+ tokens is longer than the reward model's 64 \(the "
                                         r"engine's max_seq_len\): raise bridge.engine_kwargs.max_seq_len"):
        asyncio.run(classifier.score(CONVERSATIONS[3]))


def test_a_classifier_of_several_labels_is_refused(tmp_path, model_dir):
    cfg = tiny_config(vocab_size=512)
    save_classifier(Decoder(cfg, nnx.Rngs(0)), np.zeros((cfg.hidden_size, 3), np.float32), tmp_path)
    with pytest.raises(ValueError, match=r"3 labels; a reward model gives one score \(num_labels 1\)"):
        RewardClassifier(tmp_path, max_seq_len=64)
