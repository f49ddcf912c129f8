"""Per-client fairness (router/clients.py, router/admission.py): one client's requests cannot
take the router or the workers from another's."""

import asyncio

import pytest

from common.errors import APIError
from router.admission import Admission
from router.clients import ClientGate, client_id


def test_a_client_is_its_key_else_its_address_and_never_the_key_itself():
    assert client_id("sk-secret", "10.0.0.1") == client_id("sk-secret", "10.0.0.2")
    assert "sk-secret" not in client_id("sk-secret", None)
    assert client_id(None, "10.0.0.1") != client_id(None, "10.0.0.2")


def test_the_gate_lets_other_clients_past_a_busy_one_and_bounds_its_line():
    async def go():
        gate = ClientGate(max_requests=1, max_waiting=2)
        order: list[str] = []
        release = asyncio.Event()

        async def req(client: str, name: str) -> None:
            async with gate.enter(client):
                order.append(name)
                await release.wait()

        tasks = [asyncio.create_task(req("a", f"a{i}")) for i in range(3)]
        await asyncio.sleep(0)
        b = asyncio.create_task(req("b", "b0"))
        await asyncio.sleep(0)
        assert order == ["a0", "b0"]  # b is not behind a's line
        with pytest.raises(APIError) as e:  # a's line is full: 429
            async with gate.enter("a"):
                pass
        assert e.value.status == 429
        tasks[1].cancel()  # a waiter that leaves gives up its place
        await asyncio.gather(tasks[1], return_exceptions=True)
        release.set()
        await asyncio.gather(tasks[0], tasks[2], b)
        assert order == ["a0", "b0", "a2"]
        assert gate.num_clients == 0  # nothing kept for clients that have gone

    asyncio.run(go())


def test_admission_serves_the_client_with_fewer_running_first_and_caps_each():
    async def go():
        adm = Admission(max_running=4, max_queued=16, max_per_client=3)
        order: list[str] = []
        done = {name: asyncio.Event() for name in ("a0", "a1", "a2", "a3", "b0")}

        async def req(client: str, name: str, n: int = 1) -> None:
            async with adm.slot(None, n, client):
                order.append(name)
                await done[name].wait()

        tasks = [asyncio.create_task(req("a", f"a{i}")) for i in range(4)]
        await asyncio.sleep(0)
        assert order == ["a0", "a1", "a2"]  # a's fourth waits for a's own slots (cap 3)
        b = asyncio.create_task(req("b", "b0"))
        await asyncio.sleep(0)
        assert order[-1] == "b0" and adm.running == 4  # b went past a's waiting request
        done["b0"].set()
        await b
        await asyncio.sleep(0)
        assert "a3" not in order  # still capped: the free slot is not a's
        done["a0"].set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert order[-1] == "a3"
        for e in done.values():
            e.set()
        await asyncio.gather(*tasks)
        assert adm.running == 0 and adm.queued == 0

    asyncio.run(go())


def test_a_waiting_heavy_request_is_not_overtaken_by_lighter_ones_of_its_class():
    async def go():
        adm = Admission(max_running=2, max_queued=16)
        order: list[str] = []
        release = asyncio.Event()

        async def req(client: str, name: str, n: int) -> None:
            async with adm.slot(None, n, client):
                order.append(name)
                await release.wait()

        first = asyncio.create_task(req("a", "a-n1", 1))
        await asyncio.sleep(0)
        heavy = asyncio.create_task(req("b", "b-n2", 2))
        await asyncio.sleep(0)
        light = asyncio.create_task(req("a", "a-n1-again", 1))
        await asyncio.sleep(0)
        assert order == ["a-n1"]  # one slot is free, but b's n=2 is waiting ahead of it
        release.set()
        await asyncio.gather(first, heavy, light)
        assert order == ["a-n1", "b-n2", "a-n1-again"]

    asyncio.run(go())


def test_a_client_past_its_burst_waits_its_turn_at_the_rate_then_gets_429(monkeypatch):
    import router.clients as clients

    now = [100.0]
    slept: list[float] = []

    async def fake_sleep(delay: float) -> None:
        slept.append(round(delay, 3))

    monkeypatch.setattr(clients.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(clients.asyncio, "sleep", fake_sleep)

    async def go():
        gate = ClientGate(None, requests_per_s=10, burst=2)
        for _ in range(5):
            async with gate.enter("a"):
                pass
        assert slept == [0.1, 0.2]  # the burst and the one due now at once, then paced
        with pytest.raises(APIError) as e:  # past twice the burst
            async with gate.enter("a"):
                pass
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
        async with gate.enter("b"):  # another client is not paced by a's requests
            pass
        assert len(slept) == 2
        now[0] += 10.0  # a while later, a's burst is whole again
        for _ in range(2):
            async with gate.enter("a"):
                pass
        assert len(slept) == 2

    asyncio.run(go())


def test_a_constraint_key_survives_lone_surrogates():
    """A client's JSON may carry lone surrogates (\\ud8ad): the refused-constraint cache key must
    still be made (orjson refused them: a 500 found by the schema fuzzer)."""
    from router.choices import _spec_key

    class Body:
        guided_json = {"M\ud8ad\udca6": True, "k": ["\uda06"]}
        tools = None
        tool_choice = None

    key = _spec_key(Body(), "guided_json")
    assert key == _spec_key(Body(), "guided_json") and len(key) == 32  # a sha256 digest
