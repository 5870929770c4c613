"""Stop strings of a sample call, as OpenAI's `stop`: a completion ends before the first place its text holds any of
them. The engine stops on single tokens; for a string of several tokens a row's decoding ends as soon as its decoded
text holds one (`stop_reached`, checked after each token), and the completion is then cut before it
(`cut_at_stop`)."""

from __future__ import annotations

from typing import Callable


def _first_stop(text: str, stops: list[str]) -> int | None:
    return min((at for at in (text.find(s) for s in stops) if at >= 0), default=None)


def stop_reached(tokens: list[int], decode: Callable[[list[int]], str], stops: list[str]) -> bool:
    """Whether the tokens' text holds a stop string: the row needs no more tokens. (A decode of the whole row per
    token: the same text cut_at_stop cuts, so a row never ends on a stop that the cut would not find.)"""
    return _first_stop(decode(tokens), stops) is not None


def cut_at_stop(tokens: list[int], decode: Callable[[list[int]], str], stops: list[str]) -> tuple[list[int], str]:
    """The completion before its first stop string: the text cut just before it, and the tokens whose text lies
    wholly before it (a token that straddles the stop's start is dropped with it)."""
    text = decode(tokens)
    found = _first_stop(text, stops)
    if found is None:
        return tokens, text
    text = text[:found]
    # the longest prefix of tokens whose text is a prefix of the cut text (binary search: decodes are not free)
    low, high = 0, len(tokens)
    while low < high:
        middle = (low + high + 1) // 2
        if text.startswith(decode(tokens[:middle])):
            low = middle
        else:
            high = middle - 1
    return tokens[:low], text
