"""Stop strings: find them in streamed output text and hold back what might still become one.

Use per step, after the detokenizer appended ``delta`` to the output text ``text``::

    result = checker.check(text, len(delta))
    if result is not None:      # finished: result.text is the final output
        ...
    else:                       # stream text[already_sent:checker.safe_emit_len(text)]
        ...

**Which stop wins**: the match that *ends* first; among matches ending at the same place, the one that
starts first (the longest). That is what a client reading one character at a time would see first, so the
result does not depend on how the text was split into deltas. (Earliest end and earliest start agree
unless one stop string overlaps another, e.g. stops ``["abcd", "bc"]`` on ``"abcd"``: "bc" is complete
one character before "abcd", so it wins.)

Cost per call: O(num_new_chars + what each stop string's held prefix was) per stop string, not O(its
length): the checker keeps, for each stop string, the longest tail of the text seen last that is a proper
prefix of it (its *partial match*). A match ending within the new characters starts no earlier than that
tail; a tail held now is at most the partial match plus the new characters. So a request's long stop strings
(thousands of characters each) cost each step little more than its new text, on the event loop where this
runs. The partial matches hold while the text grows by appending between calls, as the detokenizer's
output text does. They depend only on the seen text's last ``len(longest stop) - 1`` characters, so only
those are compared with the new text (not the whole text, which would cost each step the output's length);
a text that differs there is looked at whole, as a fresh checker would. Short stop strings (all under
`StopChecker.stateful_min_span` characters, as most requests' are) keep no state: trying each of their few
tail lengths costs less than keeping the partial matches (6.8 against 12.3 us a step for two short strings
over a 90,000-character output, measured when this was written).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StopResult:
    """A stop string was found. `text`: the whole output text, cut before the stop string (or right after
    it with ``include_stop_str_in_output``)."""

    stop_str: str | None
    text: str


class StopChecker:
    """Stop-string matching for one request: the caller passes the text at each call (see the module
    docstring for what is kept between calls)."""

    # Partial matches are kept between calls when the longest stop string has at least this many characters
    # past its first (a class attribute: tests set it to 0 to run the kept-state path on short strings).
    stateful_min_span = 32

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        # Duplicates would only repeat work.
        self._stop = list(dict.fromkeys(stop))
        self._include_stop_str = include_stop_str_in_output
        # Each stop string's partial match (the longest tail of the text seen, its first `_seen` characters,
        # that is a proper prefix of it), as `safe_emit_len` last found it; they depend only on the seen text's
        # last `_span` characters (`_seen_tail`).
        self._partial = [0] * len(self._stop)
        self._span = max((len(s) for s in self._stop), default=1) - 1
        self._seen = 0
        self._seen_tail = ""
        self._stateful = self._span >= self.stateful_min_span

    def _extends_seen(self, text: str) -> bool:
        """Whether the partial matches hold for `text`: it ends, at the seen length, as the seen text did."""
        return (self._stateful and len(text) >= self._seen
                and text.startswith(self._seen_tail, self._seen - len(self._seen_tail)))

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def check(self, text: str, num_new_chars: int) -> StopResult | None:
        """Look for a stop string ending in the last `num_new_chars` characters of `text`.

        Assumes earlier calls saw the rest of `text` and found nothing (so no match ends before the new
        characters). Returns None when there is no stop yet.
        """
        if not self._stop or num_new_chars <= 0:
            return None
        new_start = len(text) - num_new_chars
        known = new_start >= self._seen and self._extends_seen(text)  # the partial matches hold for this text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for i, stop_str in enumerate(self._stop):
            # A match ending in the new characters starts within the last len - 1 characters before them, and
            # what of it was seen already is a tail of that text and a proper prefix of the string.
            floor = max(0, new_start - len(stop_str) + 1)
            if known:
                floor = max(floor, self._seen - self._partial[i])
            start = text.find(stop_str, floor)
            if start < 0:
                continue
            # The first occurrence of this string also ends first (all its occurrences have one length).
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop_str = best
        return StopResult(stop_str=stop_str, text=text[: end if self._include_stop_str else start])

    def safe_emit_len(self, text: str) -> int:
        """How many leading characters of `text` can be streamed now (call after `check` found no stop).

        Holds back the longest tail of `text` that is a proper prefix of some stop string: those characters
        would be cut if the stop string completes. With ``include_stop_str_in_output`` nothing needs
        holding: text before the end of a future match is part of the output either way.
        """
        if self._include_stop_str or not self._stop:
            return len(text)
        if not self._stateful:  # short stop strings: each tail length tried, longest first
            held = 0
            for stop_str in self._stop:
                for length in range(min(len(stop_str) - 1, len(text)), held, -1):  # only longer tails matter
                    if text.endswith(stop_str[:length]):
                        held = length
                        break
            return len(text) - held
        grown = len(text) - self._seen if self._extends_seen(text) else None  # None: not the text seen before
        self._seen, self._seen_tail = len(text), text[max(0, len(text) - self._span):]
        if not text:
            self._partial = [0] * len(self._stop)
            return 0
        last = text[-1]
        held = 0
        for i, stop_str in enumerate(self._stop):
            # The tail held now came from the one held before and the new characters; it ends with the text's
            # last character, so only the string's positions holding that character are candidates.
            limit = min(len(stop_str) - 1, len(text))
            if grown is not None:
                limit = min(limit, self._partial[i] + grown)
            length = 0
            position = stop_str.rfind(last, 0, limit)
            while position >= 0:
                if text.endswith(stop_str[: position + 1]):
                    length = position + 1
                    break
                position = stop_str.rfind(last, 0, position)
            self._partial[i] = length
            held = max(held, length)
        return len(text) - held
