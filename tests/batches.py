"""Random train batches shaped like rollouts, shared by the learner tests."""

import numpy as np

VOCAB = 128


def make_batch(seed=0, B=16, P=6, C=8, R=2, sampler=True):
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((B, P), np.int32)
    for b in range(B):
        prompt_mask[b, : rng.integers(0, P - 1)] = 0
    completion_mask = np.zeros((B, C), np.int32)
    for b in range(B):
        completion_mask[b, : rng.integers(1, C + 1)] = 1
    loss_mask = completion_mask.copy()
    loss_mask[::3, 1:3] = 0  # tool-result tokens: context, but not trained on
    rewards = rng.normal(size=(B, R)).astype(np.float32)
    rewards[::5, 1] = np.nan  # the second reward function does not apply there
    batch = dict(
        prompt_BxP=(rng.integers(0, VOCAB, (B, P)) * prompt_mask).astype(np.int32),
        prompt_mask_BxP=prompt_mask,
        completion_BxC=(rng.integers(0, VOCAB, (B, C)) * completion_mask).astype(np.int32),
        completion_mask_BxC=completion_mask,
        loss_mask_BxC=loss_mask,
        rewards_BxR=rewards,
    )
    if sampler:
        batch["sampler_logp_BxC"] = (-5 + 0.3 * rng.normal(size=(B, C))).astype(np.float32)
    return batch
