"""Async stream helpers shared by the router and the workers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

T = TypeVar("T")


async def prepend(first: Iterable[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """Yield `first` (items already taken off a stream), then the rest of the stream."""
    for item in first:
        yield item
    async for item in rest:
        yield item
