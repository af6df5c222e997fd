"""Stop strings: finding them in the growing output, and the text shown while streaming."""

from __future__ import annotations

from typing import Any


_REPLACEMENT = "\ufffd"  # what a decoder renders a partial UTF-8 sequence as


class StopScanner:
    """``stop_check`` for :func:`decode`: does the generated text contain a stop string?

    Called after every target pass with the whole growing token list. Each call decodes the
    tokens added since the previous call — a pass may add any number (k has no upper
    bound) — plus enough earlier tokens to hold a stop string that straddles passes, so
    every character is searched while the cost per pass stays proportional to the pass.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self.checked = 0  # tokens whose text has been searched

    def __call__(self, generated: list[int]) -> bool:
        start, self.checked = self.checked, len(generated)
        back = self.longest + 16  # earlier tokens to re-decode; nearly always ≥ 1 char each
        while True:
            lo = max(0, start - back)
            # Out of context a slice's first token can render differently (a dropped leading
            # space), so it does not count towards the `longest − 1` characters a straddling
            # stop string needs; byte-piece tokens that decode to little make the margin grow.
            # Nor do U+FFFD: a slice that starts or ends inside a UTF-8 sequence renders its
            # stray bytes as one replacement character each, which are not characters of the
            # text, and counting them lets the window start inside a stop string.
            margin = self.tokenizer.decode(generated[lo + 1:start])
            if lo == 0 or len(margin) - margin.count(_REPLACEMENT) >= self.longest:
                break
            back *= 2
        text = self.tokenizer.decode(generated[lo:])
        return any(s in text for s in self.stops)


def visible_text(tokenizer: Any, tokens: list[int], stops: tuple[str, ...]) -> str:
    """The text of ``tokens``, cut before the first stop string."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for s in stops:
        cut = text.find(s)
        if cut >= 0:
            text = text[:cut]
    return text
