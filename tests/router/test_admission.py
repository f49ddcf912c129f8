import asyncio

import pytest

from common.errors import APIError
from router.admission import Admission


def test_priorities_bounds_and_cancellation():
    async def go():
        adm = Admission(max_running=1, max_queued=2)
        order = []
        gate = asyncio.Event()

        async def job(name, prio):
            async with adm.slot(prio):
                order.append(name)
                await gate.wait()

        first = asyncio.create_task(job("first", "batch"))
        await asyncio.sleep(0)
        batch = asyncio.create_task(job("batch", "batch"))
        await asyncio.sleep(0)
        inter = asyncio.create_task(job("interactive", "interactive"))
        await asyncio.sleep(0)
        assert adm.running == 1 and adm.queued == 2
        with pytest.raises(APIError) as e:
            async with adm.slot("interactive"):
                pass
        assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
        gate.set()
        await asyncio.gather(first, batch, inter)
        assert order == ["first", "interactive", "batch"]  # interactive jumped the batch one
        assert adm.running == 0 and adm.queued == 0

        gate.clear()
        holder = asyncio.create_task(job("holder", None))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(job("gone", None))
        await asyncio.sleep(0)
        waiter.cancel()  # a client that leaves while queued frees its place
        await asyncio.gather(waiter, return_exceptions=True)
        assert adm.queued == 0
        gate.set()
        await holder
        assert adm.running == 0

    asyncio.run(go())
