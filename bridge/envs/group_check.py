"""One task per group, checked: GRPO-style advantages compare the episodes of a group with each
other, which only means something if they all played the same task. The bridge compares each
episode's first prompt with its group's first; an environment whose reset ignores the task's seed
(OpenEnv's reasoning_gym hands each reset the next question) or is random makes them differ."""

from __future__ import annotations

import collections
import json
import logging
from typing import Any

from bridge.envs.spec import EnvSpec, MixedGroupError

log = logging.getLogger(__name__)

REMEMBERED_GROUPS = 4096  # groups whose first prompt is kept (a group's episodes start close together)


class GroupCheck:
    """The first prompts of the latest groups, and which of them were found mixed."""

    def __init__(self):
        self._first: collections.OrderedDict[tuple[str, str], tuple[str, bool]] = collections.OrderedDict()
        self._warned: set[str] = set()

    def mixed(self, spec: EnvSpec, group_id: str | None, prompt: list[dict[str, Any]]) -> bool:
        """Whether this episode's first `prompt` is the first one in group `group_id` of `spec`'s
        environment to differ from the group's first (counted once per group); warns once per
        environment, or raises MixedGroupError with `mixed_groups: error`."""
        if group_id is None:
            return False
        key, text = (spec.name, group_id), json.dumps(prompt, sort_keys=True, default=str)
        first = self._first.get(key)
        if first is None:
            self._first[key] = (text, False)
            while len(self._first) > REMEMBERED_GROUPS:
                self._first.popitem(last=False)
            return False
        if first[0] == text or first[1]:
            return False
        self._first[key] = (first[0], True)
        message = (f"environment {spec.name!r}: the episodes of group {group_id} started from different first prompts, "
                   "so the group is not one task and its advantages compare answers to different tasks; its reset "
                   "ignores the task's seed or is random: pin the task with task fields the reset reads "
                   "(data.task_fields, data.train_file rows, data.splits for a server with task routes)")
        if spec.mixed_groups == "error":
            raise MixedGroupError(message)
        if spec.name not in self._warned:
            self._warned.add(spec.name)
            log.warning("%s; counted in env/%s/groups_mixed (mixed_groups: error stops the run on it)", message,
                        spec.name)
        return True
