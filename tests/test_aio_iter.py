"""AsyncMessenger.messages() (``async for`` over a subscription, at least once)
and the async read_channel.

No pytest asyncio plugin: each test runs its own ``asyncio.run(...)``; every
wait is bounded by ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from keyop_messenger import ChannelNotFoundError, Config, Message
from keyop_messenger.aio import AsyncMessenger

#: Bound on every wait of these tests.
WAIT_S = 15.0


def make_config(tmp_path: Path) -> Config:
    return Config.from_dict({"name": "aio-iter", "storage": {"data_dir": str(tmp_path / "d")}})


async def publish_n(am: AsyncMessenger, n: int, first: int = 0) -> list[str]:
    return await am.publish_batch("jobs", [("demo.Job", {"n": i}) for i in range(first, first + n)])


async def take(am: AsyncMessenger, n: int, sid: str = "worker") -> list[Message]:
    """The first ``n`` messages of one messages() loop, left by ``break`` in ``async with``."""
    got: list[Message] = []

    async def run() -> None:
        async with am.messages("jobs", sid, start="earliest") as stream:
            async for msg in stream:
                got.append(msg)
                if len(got) == n:
                    break

    await asyncio.wait_for(run(), WAIT_S)
    return got


def test_messages_in_order_with_content(tmp_path: Path) -> None:
    async def main() -> tuple[list[str], list[Message]]:
        async with AsyncMessenger(make_config(tmp_path)) as am:
            ids = await publish_n(am, 20)
            return ids, await take(am, 20)

    ids, got = asyncio.run(main())
    assert [m.id for m in got] == ids
    assert [m.payload for m in got] == [{"n": i} for i in range(20)]
    assert {m.channel for m in got} == {"jobs"}


def test_break_then_resume_starts_after_the_message_in_hand(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], list[int]]:
        async with AsyncMessenger(make_config(tmp_path)) as am:
            await publish_n(am, 10)
            first = [m.payload["n"] for m in await take(am, 4)]
            second = [m.payload["n"] for m in await take(am, 6)]
            return first, second

    first, second = asyncio.run(main())
    assert first == [0, 1, 2, 3]
    assert second == [4, 5, 6, 7, 8, 9]  # the message in hand at break was acknowledged


def test_exception_in_body_redelivers_that_message(tmp_path: Path) -> None:
    class Boom(Exception):
        pass

    async def main() -> tuple[list[int], list[int]]:
        async with AsyncMessenger(make_config(tmp_path)) as am:
            await publish_n(am, 5)
            seen: list[int] = []

            async def failing() -> None:
                async with am.messages("jobs", "worker", start="earliest") as stream:
                    async for msg in stream:
                        seen.append(msg.payload["n"])
                        if msg.payload["n"] == 2:
                            raise Boom

            with pytest.raises(Boom):
                await asyncio.wait_for(failing(), WAIT_S)

            # A bare ``async for`` left by an exception: also not acknowledged.
            async def bare() -> None:
                async for msg in am.messages("jobs", "worker"):
                    seen.append(msg.payload["n"])
                    raise Boom

            with pytest.raises(Boom):
                await asyncio.wait_for(bare(), WAIT_S)
            rest = [m.payload["n"] for m in await take(am, 3)]
            return seen, rest

    seen, rest = asyncio.run(main())
    assert seen == [0, 1, 2, 2]
    assert rest == [2, 3, 4]


def test_slow_body_backpressure_bounds_what_the_engine_hands_over(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], int]:
        async with AsyncMessenger(make_config(tmp_path)) as am:
            await publish_n(am, 50)
            got: list[int] = []
            stream = am.messages("jobs", "worker", start="earliest", buffer=2)

            async def run() -> None:
                async with stream:
                    async for msg in stream:
                        await asyncio.sleep(0.002)  # a slow body
                        got.append(msg.payload["n"])
                        if len(got) == 50:
                            break

            await asyncio.wait_for(run(), WAIT_S)
            return got, stream.max_outstanding

    got, most = asyncio.run(main())
    assert got == list(range(50))
    assert 1 <= most <= 2 + 1


def test_bare_async_for_break_closes_and_redelivers_the_message_in_hand(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], list[int]]:
        async with AsyncMessenger(make_config(tmp_path)) as am:
            await publish_n(am, 4)
            first: list[int] = []

            async def bare() -> None:
                async for msg in am.messages("jobs", "worker", start="earliest"):
                    first.append(msg.payload["n"])
                    if len(first) == 2:
                        break

            await asyncio.wait_for(bare(), WAIT_S)
            # The same id subscribes again at once: the dropped stream's subscription closed.
            rest = [m.payload["n"] for m in await take(am, 3)]
            return first, rest

    first, rest = asyncio.run(main())
    assert first == [0, 1]
    assert rest == [1, 2, 3]  # 0 acknowledged; 1 was in hand at break: delivered again


def test_closing_the_messenger_ends_the_loop(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], bool]:
        am = AsyncMessenger(make_config(tmp_path))
        await am.open()
        await publish_n(am, 3)
        got: list[int] = []

        async def run() -> None:
            async for msg in am.messages("jobs", "worker", start="earliest"):
                got.append(msg.payload["n"])

        task = asyncio.create_task(run())
        for _ in range(300):
            if len(got) == 3:
                break
            await asyncio.sleep(0.01)
        await asyncio.wait_for(am.close(), WAIT_S)
        await asyncio.wait_for(task, WAIT_S)  # ends (StopAsyncIteration), does not hang
        return got, task.done()

    got, done = asyncio.run(main())
    assert got == [0, 1, 2]
    assert done


def test_async_read_channel_keywords_and_errors(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], list[int], list[int]]:
        async with AsyncMessenger(make_config(tmp_path)) as am:
            await publish_n(am, 600)
            every = [e.message.payload["n"] async for e in am.read_channel("jobs")]
            offsets = [e.offset async for e in am.read_channel("jobs", limit=12)]
            window = [
                e.message.payload["n"]
                async for e in am.read_channel("jobs", since=offsets[3], until=offsets[7])
            ]
            limited = [e.message.payload["n"] async for e in am.read_channel("jobs", limit=5)]
            with pytest.raises(ChannelNotFoundError):
                async for _ in am.read_channel("nope"):
                    pass
            return every, window, limited

    every, window, limited = asyncio.run(main())
    assert every == list(range(600))
    assert window == [3, 4, 5, 6]
    assert limited == [0, 1, 2, 3, 4]


def test_messages_refuses_a_buffer_below_one(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncMessenger(make_config(tmp_path)) as am:
            with pytest.raises(ValueError, match="buffer must be >= 1"):
                am.messages("jobs", "worker", buffer=0)

    asyncio.run(main())
