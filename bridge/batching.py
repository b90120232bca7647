"""Concurrent requests gathered into batches of a fixed number of rows and run off the event loop:
how the bridge's scoring models (the distillation teacher, reward classifiers) take the episodes
that finish close together, one compiled program per batch shape."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from bridge.engines.base import read_off_loop


class Batcher:
    """`await submit(x)` is `run(batch)[i]` for the batch of at most `rows` requests that `x` joined;
    a request waits up to `window_s` for others to fill its batch."""

    def __init__(self, run: Callable[[list[Any]], list[Any]], rows: int, window_s: float):
        self.run, self.rows, self.window_s = run, rows, window_s
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.stats = {"episodes": 0, "batches": 0, "score_s": 0.0}

    async def submit(self, request: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        """Runs the pending requests `rows` at a time until none is left."""
        while self._pending:
            if len(self._pending) < self.rows:
                await asyncio.sleep(self.window_s)  # episodes of a group finish close together
            batch, self._pending = self._pending[:self.rows], self._pending[self.rows:]
            start = time.perf_counter()
            try:
                results = await read_off_loop(self.run, [request for request, _ in batch])
            except Exception as e:  # every request of the batch learns why
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            self.stats["batches"] += 1
            self.stats["episodes"] += len(batch)
            self.stats["score_s"] += time.perf_counter() - start
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
