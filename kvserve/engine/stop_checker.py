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

Cost per call: O(num_new_chars + longest stop) per stop string: a new match must end within the new
characters, so it starts at most ``len(stop) - 1`` characters before them.
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
    """Stop-string matching for one request (stateless between calls: the caller passes the text)."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        # Duplicates would only repeat work.
        self._stop = list(dict.fromkeys(stop))
        self._include_stop_str = include_stop_str_in_output

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
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self._stop:
            start = text.find(stop_str, max(0, new_start - len(stop_str) + 1))
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
        held = 0
        for stop_str in self._stop:
            # Only tails longer than what is already held can change the answer.
            for length in range(min(len(stop_str) - 1, len(text)), held, -1):
                if text.endswith(stop_str[:length]):
                    held = length
                    break
        return len(text) - held
