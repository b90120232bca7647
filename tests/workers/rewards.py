"""A reward function for the process-level tests (importable by the trainer and its bridge)."""

import json
import os


def short(completions, **task_fields):
    """1 for a completion of at most 12 characters: a second, cheaper signal beside the environment's."""
    return [float(len(c) <= 12) for c in completions]


def nan(completions, **task_fields):
    """A broken reward function: NaN for every completion."""
    return [float("nan")] * len(completions)


def nothing(completions, **task_fields):
    """A reward function that applies to nothing: the run has no score at all."""
    return [None] * len(completions)


def even_length(completions, **task_fields):
    """1 for a completion of an even number of characters: a signal an untrained model gets about half
    the time, so that its groups have advantages and its updates move the weights."""
    return [float(len(c) % 2 == 0) for c in completions]


def huge(completions, **task_fields):
    """Finite, but past what the learner's float32 arithmetic holds."""
    return [1e308] * len(completions)


def record_conversation(prompts, completions, completion_ids, environments, env, **task_fields):
    """Applies to nothing: appends each episode's first prompt, its conversation (what reward models read
    of a TRL-format task) and task fields to the JSON-lines file $JAXRL_TEST_CONVERSATIONS."""
    with open(os.environ["JAXRL_TEST_CONVERSATIONS"], "a") as f:
        for i, (prompt, completion, ids) in enumerate(zip(prompts, completions, completion_ids)):
            fields = {k: v[i] for k, v in task_fields.items()}
            f.write(json.dumps({"prompt": prompt, "completion": completion, "completion_ids": ids,
                                "task": fields}) + "\n")
    return [None] * len(completions)
