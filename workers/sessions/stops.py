"""Stop strings of a sample call, as OpenAI's `stop`: a completion ends before the first place its text holds any of
them. The engine stops on single tokens only, so a string of several tokens is cut out of the decoded completion
afterwards (generation runs on to eos or max_tokens)."""

from __future__ import annotations

from typing import Callable


def cut_at_stop(tokens: list[int], decode: Callable[[list[int]], str], stops: list[str]) -> tuple[list[int], str]:
    """The completion before its first stop string: the text cut just before it, and the tokens whose text lies
    wholly before it (a token that straddles the stop's start is dropped with it)."""
    text = decode(tokens)
    found = [at for at in (text.find(s) for s in stops) if at >= 0]
    if not found:
        return tokens, text
    text = text[: min(found)]
    # the longest prefix of tokens whose text is a prefix of the cut text (binary search: decodes are not free)
    low, high = 0, len(tokens)
    while low < high:
        middle = (low + high + 1) // 2
        if text.startswith(decode(tokens[:middle])):
            low = middle
        else:
            high = middle - 1
    return tokens[:low], text
