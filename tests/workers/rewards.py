"""A reward function for the process-level tests (importable by the trainer and its bridge)."""


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
