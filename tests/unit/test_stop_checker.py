"""Stop strings: found across delta boundaries, earliest wins, and nothing of a stop string is ever streamed."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.stop_checker import StopChecker, StopResult


def run_stream(checker: StopChecker, deltas: list[str]) -> tuple[StopResult | None, str, str]:
    """Feed deltas as the output processor would: (stop result, text streamed so far, final text)."""
    text = ""
    sent = 0
    for delta in deltas:
        text += delta
        result = checker.check(text, len(delta))
        if result is not None:
            assert result.text.startswith(text[:sent]), "already-streamed text was taken back"
            return result, text[:sent], result.text
        safe = checker.safe_emit_len(text)
        assert safe >= sent, "the safe length went backwards"
        sent = safe
    return None, text[:sent], text


def split_randomly(text: str, rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(text):
        size = rng.randint(0, 4)  # empty deltas happen (held-back partial characters)
        deltas.append(text[i : i + size])
        i += size
    return deltas


def reference_stop(text: str, stops: list[str], include: bool) -> StopResult | None:
    """Oracle: the stop string a one-character-at-a-time reader sees complete first."""
    for end in range(1, len(text) + 1):
        matches = [(end - len(s), s) for s in stops if text[:end].endswith(s)]
        if matches:
            start, stop = min(matches)
            return StopResult(stop, text[:end] if include else text[:start])
    return None


def test_stop_spanning_many_deltas():
    checker = StopChecker(["</answer>"])
    result, streamed, final = run_stream(checker, ["The answer", " is 42<", "/ans", "wer", "> and more"])
    assert result == StopResult("</answer>", "The answer is 42")
    assert "<" not in streamed


def test_stop_inside_one_delta_with_text_after_it():
    result, _, final = run_stream(StopChecker(["STOP"]), ["abc STOP def"])
    assert result == StopResult("STOP", "abc ")


def test_include_stop_str_in_output():
    result, streamed, final = run_stream(
        StopChecker(["\n\n"], include_stop_str_in_output=True), ["a\n", "\nb"]
    )
    assert result == StopResult("\n\n", "a\n\n")
    assert streamed == "a\n"  # nothing held back: the stop string is output either way


def test_earliest_stop_wins():
    checker = StopChecker(["world", "lo"])
    assert checker.check("hello world", 11) == StopResult("lo", "hel")
    # Overlapping: "bc" is complete one character before "abcd".
    assert StopChecker(["abcd", "bc"]).check("xabcd", 5) == StopResult("bc", "xa")
    # Same end: the longer (earlier-starting) one.
    assert StopChecker(["bc", "abc"]).check("xabc", 4) == StopResult("abc", "x")


def test_only_new_text_is_searched():
    checker = StopChecker(["ab"])
    # "ab" at the start ended before the new characters: the caller would have stopped then.
    assert checker.check("ab xyz", 3) is None
    # A match straddling old and new characters is found.
    assert checker.check("xxa" + "b", 1) == StopResult("ab", "xx")


def test_safe_emit_len_holds_back_stop_prefixes():
    checker = StopChecker(["STOP", "<end>"])
    assert checker.safe_emit_len("hello") == 5
    assert checker.safe_emit_len("hello S") == 6
    assert checker.safe_emit_len("hello STO") == 6
    assert checker.safe_emit_len("hello <en") == 6
    assert checker.safe_emit_len("hello ST<") == 8
    assert checker.safe_emit_len("STO") == 0
    assert StopChecker([]).safe_emit_len("STO") == 3


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    text=st.text(alphabet="abc<>/ 世", max_size=40),
    stops=st.lists(st.text(alphabet="abc<>/世", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_chunking_agrees_with_the_reference(text, stops, include, seed):
    checker = StopChecker(stops, include_stop_str_in_output=include)
    result, streamed, final = run_stream(checker, split_randomly(text, random.Random(seed)))
    expected = reference_stop(text, stops, include)
    assert result == expected
    if expected is not None:
        assert final == expected.text
    # Nothing streamed is ever cut later, and no stop string (or a prefix that became one) leaks.
    assert final.startswith(streamed)
    if not include:
        assert not any(s in streamed for s in stops)


@pytest.mark.parametrize("stop", ["世界", "好世", "🙂!"])
def test_stop_spanning_tokens_through_the_detokenizer(smollm_tokenizer, stop):
    tok = smollm_tokenizer
    prompt_ids = tok.encode("Say:", add_special_tokens=False)
    output_ids = tok.encode(" 你好世界🙂! 再见", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    checker = StopChecker([stop])
    sent = 0
    result = None
    for token_id in output_ids:
        delta = detok.add_tokens([token_id])
        result = checker.check(detok.output_text, len(delta))
        if result is not None:
            break
        sent = checker.safe_emit_len(detok.output_text)
        assert stop not in detok.output_text[:sent]
    assert result is not None
    full = " 你好世界🙂! 再见"
    assert result.text == full[: full.index(stop)]
    assert result.text.startswith(detok.output_text[:sent])


def _held_reference(text: str, stops: list[str]) -> int:
    """Oracle: the longest tail of `text` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
               default=0)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    text=st.text(alphabet="ab", max_size=60),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=9), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    min_steps=st.integers(0, 6),
)
def test_the_partial_matches_kept_between_calls_give_the_stateless_answers(text, stops, seed, min_steps):
    for stateful_min_span in (0, StopChecker.stateful_min_span):  # kept state for these short strings too
        _partial_matches_case(text, stops, seed, min_steps, stateful_min_span)


def _partial_matches_case(text: str, stops: list[str], seed: int, min_steps: int, stateful_min_span: int) -> None:
    """The checker keeps each stop string's partial match between calls (so that long stop strings cost little
    a step). Property, on a two-letter alphabet where stop strings overlap themselves (borders): every call
    answers as a fresh checker (which knows nothing of earlier calls) answers, when the output processor's
    calls come as they do: no `check` for the first steps (min_tokens), and `safe_emit_len` after each step
    with no stop, also on steps whose text did not grow."""
    rng = random.Random(seed)
    checker = StopChecker(stops)
    checker._stateful = checker._span >= stateful_min_span
    text_so_far = ""
    for step, delta in enumerate(split_randomly(text, rng)):
        text_so_far += delta
        if step >= min_steps:
            result = checker.check(text_so_far, len(delta))
            assert result == StopChecker(stops).check(text_so_far, len(delta)), (text_so_far, step)
            if result is not None:
                return
        assert checker.safe_emit_len(text_so_far) == len(text_so_far) - _held_reference(text_so_far, stops)


def test_long_stop_strings_hold_what_they_must():
    """Stop strings of thousands of characters: held tails grow with the text and fall back to a shorter border
    when the text departs from the string."""
    stop = "ab" * 2000 + "c"
    checker = StopChecker([stop, "x" * 5000])
    text = ""
    for _ in range(1500):
        text += "ab"
        assert checker.safe_emit_len(text) == 0  # all of it may still become the stop string
    text += "b"  # "...abb": no tail of it starts the string
    assert checker.check(text, 1) is None and checker.safe_emit_len(text) == len(text)
    text += "ab" * 2000 + "c"
    result = checker.check(text, 4001)
    assert result is not None and result.text == "ab" * 1500 + "b"


def test_a_text_that_changed_where_the_partial_matches_were_found_is_read_whole(monkeypatch):
    """The checker compares only the seen text's last characters (those its partial matches depend on) with the
    next text: a text rewritten there is read as a fresh checker reads it; one rewritten further back keeps
    answers that do not depend on it."""
    monkeypatch.setattr(StopChecker, "stateful_min_span", 0)
    checker = StopChecker(["STOP"])
    assert checker.safe_emit_len("abc ST") == 4
    assert checker.safe_emit_len("abc Sx") == 6  # not "abc ST" grown: its held tail is gone
    assert checker.check("abc SxSTOP", 4) is not None
    checker = StopChecker(["STOP"])
    assert checker._stateful
    assert checker.safe_emit_len("xyz ST") == 4
    assert checker.safe_emit_len("abc STO") == 4  # the last 3 characters seen are as before: "ST" + "O"
