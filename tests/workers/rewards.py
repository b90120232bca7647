"""A reward function for the process-level tests (importable by the trainer and its bridge)."""


def short(completions, **task_fields):
    """1 for a completion of at most 12 characters: a second, cheaper signal beside the environment's."""
    return [float(len(c) <= 12) for c in completions]
