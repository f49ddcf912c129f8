"""Stop strings, found the same way by the engine (which stops the sequence) and the router
(which cuts the text it detokenized from a backend's tokens)."""

from __future__ import annotations


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in `text[start:]`: (its index in `text`, the string), or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
