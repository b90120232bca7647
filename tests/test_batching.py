"""The scoring models' batcher: concurrent requests share batches of `rows`, each gets its own result,
and a batch that fails fails its own requests only."""

import asyncio

from bridge.batching import Batcher


def test_concurrent_requests_share_batches_of_rows_and_get_their_own_results():
    batches = []

    def run(requests):
        batches.append(list(requests))
        return [r * 10 for r in requests]

    async def main():
        batcher = Batcher(run, rows=4, window_s=0.01)
        return batcher, await asyncio.gather(*(batcher.submit(i) for i in range(6)))

    batcher, results = asyncio.run(main())
    assert results == [0, 10, 20, 30, 40, 50]
    assert batches == [[0, 1, 2, 3], [4, 5]]
    assert batcher.stats["episodes"] == 6 and batcher.stats["batches"] == 2


def test_a_failing_batch_fails_its_requests_and_the_next_batch_is_served():
    def run(requests):
        if 0 in requests:
            raise ValueError("no zeros")
        return list(requests)

    async def main():
        batcher = Batcher(run, rows=2, window_s=0.01)
        first = await asyncio.gather(*(batcher.submit(i) for i in (0, 1, 2, 3)), return_exceptions=True)
        return first, batcher.stats["batches"]

    (zero, one, two, three), served = asyncio.run(main())
    assert isinstance(zero, ValueError) and isinstance(one, ValueError) and str(one) == "no zeros"
    assert (two, three, served) == (2, 3, 1)


def test_a_lone_request_is_served_after_the_window():
    async def main():
        return await Batcher(lambda requests: [len(requests)], rows=8, window_s=0.01).submit("x")

    assert asyncio.run(main()) == 1
