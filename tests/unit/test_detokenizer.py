"""Incremental detokenizer against the tokenizer's own full decode (the oracle), byte-level BPE and SentencePiece."""

from __future__ import annotations

import copy
import random

import pytest

from kvserve.engine.detokenizer import IncrementalDetokenizer, backend_decode

TEXTS = [
    "Hello world! How are you today?",
    "你好，世界！我们今天去公园散步。",
    "Mixed: the 模型 says 🙂 and 👨‍👩‍👧 then 🇫🇷 ok.",
    "鑫鑫 emoji at the end 🎉",
    "  two leading spaces and a\nnew line\tand tab",
]
PROMPT = "User: please answer.\nAssistant:"


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=None) -> list[str]:
    deltas = []
    i = 0
    while i < len(ids):
        size = 1 if chunk_sizes is None else chunk_sizes(i)
        deltas.append(detok.add_tokens(ids[i : i + size]))
        i += size
    return deltas


def in_context(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> str:
    """The invariant's right side: what the output adds to the decoded prompt."""
    prompt_text = full_decode(tokenizer, prompt_ids, skip_special_tokens)
    whole = full_decode(tokenizer, prompt_ids + output_ids, skip_special_tokens)
    assert whole.startswith(prompt_text)
    return whole[len(prompt_text) :]


@pytest.fixture(params=["byte_level_bpe", "sentencepiece"])
def tokenizer(request):
    name = {"byte_level_bpe": "smollm_tokenizer", "sentencepiece": "sp_tokenizer"}[request.param]
    return request.getfixturevalue(name)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tokenizer, text):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detok, output_ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text
    assert detok.output_text == in_context(tokenizer, prompt_ids, output_ids)


@pytest.mark.parametrize("seed", range(3))
def test_random_chunking_gives_the_same_text(tokenizer, seed):
    rng = random.Random(seed)
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    output_ids = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detok, output_ids, chunk_sizes=lambda _: rng.randint(1, 4))
    assert all("\ufffd" not in d for d in deltas)
    assert detok.output_text == in_context(tokenizer, prompt_ids, output_ids)


def test_partial_characters_are_held_back(smollm_tokenizer, sp_tokenizer):
    # Both tokenizers spell these characters with several single-byte tokens: the first tokens of a
    # character must give "" and the last one the whole character.
    for tok, text in ((smollm_tokenizer, "世界"), (sp_tokenizer, "🙂")):
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, tok.encode("Say:", add_special_tokens=False))
        deltas = stream(detok, ids)
        assert len(ids) > len(text.strip())  # the test needs multi-token characters
        assert "" in deltas
        assert detok.output_text.strip() == text


def test_byte_level_output_equals_decode_of_output_alone(smollm_tokenizer):
    tok = smollm_tokenizer
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    for text in TEXTS:
        output_ids = tok.encode(" " + text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt_ids)
        stream(detok, output_ids)
        assert detok.output_text == full_decode(tok, output_ids)
        assert detok.output_text.startswith(" ")


def test_sentencepiece_keeps_the_word_initial_space(sp_tokenizer):
    tok = sp_tokenizer
    prompt_ids = tok.encode("Hello", add_special_tokens=False)
    output_ids = tok.encode("Hello world", add_special_tokens=False)[len(prompt_ids) :]
    assert tok.convert_ids_to_tokens(output_ids)[0].startswith("\u2581")  # "▁w..." starts a word
    detok = IncrementalDetokenizer(tok, prompt_ids)
    stream(detok, output_ids)
    assert detok.output_text == " world"
    # Decoding the output alone drops the space (start-of-text rule); the detokenizer keeps it.
    assert full_decode(tok, output_ids) == "world"


def test_empty_prompt_equals_decode_of_output(tokenizer):
    output_ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    stream(detok, output_ids)
    assert detok.output_text == full_decode(tokenizer, output_ids)


def test_prompt_tail_of_special_tokens_and_split_characters(smollm_tokenizer):
    tok = smollm_tokenizer
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    # A prompt whose last five tokens are special or the tail bytes of one character.
    prompt_ids = tok.encode("问题：世", add_special_tokens=False) + [im_end, im_start, im_end]
    output_ids = tok.encode(" 答案是 42", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = stream(detok, output_ids)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.output_text == " 答案是 42"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(smollm_tokenizer, skip_special_tokens):
    tok = smollm_tokenizer
    im_end, eos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    output_ids = (
        tok.encode(" first 世", add_special_tokens=False)
        + [im_end]
        + tok.encode(" second", add_special_tokens=False)
        + [eos, eos]
    )
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, output_ids)
    assert all("\ufffd" not in d for d in deltas)
    expected = " first 世<|im_end|> second<|endoftext|><|endoftext|>"
    if skip_special_tokens:
        expected = expected.replace("<|im_end|>", "").replace("<|endoftext|>", "")
    assert detok.output_text == expected
    assert detok.output_text == in_context(tok, prompt_ids, output_ids, skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_sentencepiece(sp_tokenizer, skip_special_tokens):
    tok = sp_tokenizer
    hello = tok.encode("Hello", add_special_tokens=False)
    prompt_ids = [tok.bos_token_id] + hello
    output_ids = tok.encode("Hello world", add_special_tokens=False)[len(hello) :] + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    stream(detok, output_ids)
    assert detok.output_text == (" world" if skip_special_tokens else " world</s>")
    assert detok.output_text == in_context(tok, prompt_ids, output_ids, skip_special_tokens)


def test_sentencepiece_prompt_ending_in_many_special_tokens(sp_tokenizer):
    # The context window must reach back to real text, or the word-initial space of the first output
    # token would be stripped as if the output started the text.
    tok = sp_tokenizer
    hello = tok.encode("Hello", add_special_tokens=False)
    prompt_ids = hello + [tok.eos_token_id, tok.bos_token_id] * 4
    output_ids = tok.encode("Hello world", add_special_tokens=False)[len(hello) :]
    detok = IncrementalDetokenizer(tok, prompt_ids)
    stream(detok, output_ids)
    assert detok.output_text == " world"
    assert detok.output_text == in_context(tok, prompt_ids, output_ids)


def test_flush_emits_a_held_invalid_tail(smollm_tokenizer):
    tok = smollm_tokenizer
    first_byte_of_char = tok.encode("世", add_special_tokens=False)[0]
    detok = IncrementalDetokenizer(tok, tok.encode("x", add_special_tokens=False))
    assert detok.add_tokens(tok.encode(" ok", add_special_tokens=False)) == " ok"
    assert detok.add_tokens([first_byte_of_char]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.output_text == " ok\ufffd"


class _CountingTokenizer:
    """Forwards decode and records how many ids each call decoded."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.decoded_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_work_per_call_does_not_grow_with_the_output(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    prompt_ids = tokenizer.encode(PROMPT * 20, add_special_tokens=False)
    output_ids = tokenizer.encode(" ".join(TEXTS) * 10, add_special_tokens=False)
    assert len(output_ids) > 300
    detok = IncrementalDetokenizer(counting, prompt_ids)  # type: ignore[arg-type]
    stream(detok, output_ids)
    # A window of a few characters' tokens (a 4-byte character spelled byte by byte is 4 tokens).
    assert max(counting.decoded_lengths) <= 12
    assert detok.output_text == in_context(tokenizer, prompt_ids, output_ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_is_the_tokenizers_decode(tokenizer, skip_special_tokens):
    """The detokenizer calls a fast tokenizer's Rust decode directly: it must give what `decode` gives, on any
    ids (special tokens and split characters included)."""
    fast = backend_decode(tokenizer)
    if fast is None:
        pytest.skip(f"{type(tokenizer).__name__} decodes through its own Python code")
    rng = random.Random(7)
    special = list(tokenizer.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 12))]
        assert fast(ids, skip_special_tokens=skip_special_tokens) == full_decode(tokenizer, ids, skip_special_tokens)


def test_a_tokenizer_that_overrides_decoding_is_decoded_through_it(smollm_tokenizer):
    class Shouting(type(smollm_tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs).upper()

    tok = copy.copy(smollm_tokenizer)
    tok.__class__ = Shouting
    assert backend_decode(smollm_tokenizer) is not None and backend_decode(tok) is None
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT, add_special_tokens=False))
    stream(detok, tok.encode(" quiet words", add_special_tokens=False))
    assert detok.output_text == " QUIET WORDS"
