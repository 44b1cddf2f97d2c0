"""bad_words (vLLM's field): the words' token sequences never appear in the output, step by step and
pipelined (where a word's next-to-last token may still be on the device when the next one is sampled)."""

from __future__ import annotations

import pytest

from kvserve.engine.llm import LLM
from kvserve.protocol.sampling_params import SamplingParams, SamplingParamsError

PROMPTS = ["The capital of France is", "Once upon a time there was", "1, 2, 3, 4,"]


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.fixture(scope="module")
def engines(tiny_model_dir) -> dict[bool, LLM]:
    path = tiny_model_dir("llama")
    return {pipelined: LLM(path, max_model_len=128, async_scheduling=pipelined) for pipelined in (False, True)}


def test_bad_word_sequences_never_generated_pipelined_or_not(engines, monkeypatch):
    from kvserve.layers.sampler import Sampler

    pending_seen = []
    apply = Sampler._apply_bad_words
    monkeypatch.setattr(Sampler, "_apply_bad_words", staticmethod(
        lambda work, rows, pending_ids: (pending_seen.extend(r.pending_row is not None for r in rows),
                                         apply(work, rows, pending_ids))[1]))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in engines[False].generate(PROMPTS, greedy, use_tqdm=False)]
    tested: list[int] = []
    # Per prompt, each on its own: its 2nd token alone, its 3rd-4th tokens as a two-token word, its 6th-8th as a
    # three-token word. The output is the same until the word's last token, which it cannot write there.
    for i, tokens in enumerate(plain):
        for start, end in ((1, 2), (2, 4), (5, 8)):
            word = tokens[start:end]
            if word[-1] in tokens[:end - 1] or any(t in word for t in tokens[:start]):
                continue  # an earlier ban would change the output before this one
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words_token_ids=[word])
            runs = [engines[p].generate([PROMPTS[i]], params, use_tqdm=False)[0].outputs[0].token_ids
                    for p in (False, True)]
            assert runs[0] == runs[1], ("pipelined bans differ from step-by-step ones", word)
            out = runs[0]
            assert out[:end - 1] == tokens[:end - 1] and out[end - 1] != tokens[end - 1], (out, tokens, word)
            assert not _contains(out, word), (out, word)
            tested.append(len(word))
    assert {1, 2, 3} <= set(tested), tested
    assert any(pending_seen), "no pipelined step had its newest token on the device"


def test_bad_words_are_tokenized_as_written_and_after_a_space(engines):
    llm = engines[False]
    tokenizer = llm.get_tokenizer()

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    # After a space "unbelievable" is fewer tokens than alone: only the plain form is banned (vLLM's rule).
    assert len(encode(" unbelievable")) != len(encode("unbelievable"))
    assert encode(" hello") != encode("hello")
    resolved = llm.engine.input_processor.resolve_bad_words(SamplingParams(bad_words=["unbelievable", " hello"]))
    assert resolved.bad_words_token_ids == [encode("unbelievable"), encode("hello"), encode(" hello")]

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=["hello"])
    assert llm.engine.input_processor.resolve_bad_words(params).bad_words_token_ids
    assert params.bad_words_token_ids is None  # the caller's object is not changed
    # A word the model writes (a generated token whose text, re-tokenized, is that token): banned, it is gone.
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    resolve = llm.engine.input_processor.resolve_bad_words
    prompt, word, sequences = next(
        (i, w, seqs) for i, tokens in enumerate(plain) for t in tokens
        if (w := tokenizer.decode([t]).strip()).isalpha()
        and [t] in (seqs := resolve(SamplingParams(bad_words=[w])).bad_words_token_ids))
    banned = llm.generate([PROMPTS[prompt]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                            bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert list(banned.token_ids) != list(plain[prompt])
    for ids in sequences:
        assert not _contains(list(banned.token_ids), ids)


def test_the_spaced_form_rule_with_a_scripted_tokenizer():
    """vLLM's rule on every branch: the spaced form is added only with as many tokens and a different first one;
    each sequence once, in order."""
    from kvserve.engine.input_processor import InputProcessor

    vocab = {"a": [1], " a": [2], "bc": [3, 4], " bc": [3, 5], "de": [6, 7], " de": [8]}

    class Tokenizer:
        eos_token_id = None

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return {"input_ids": vocab[text]}

        def __len__(self) -> int:
            return 10

    processor = InputProcessor(Tokenizer(), 64, [0], 10)  # type: ignore[arg-type]
    resolved = processor.resolve_bad_words(SamplingParams(bad_words=["a", "bc", " de", "a"]))
    assert resolved.bad_words_token_ids == [[1], [2], [3, 4], [6, 7]]


@pytest.mark.parametrize("bad_words", [[""], ["  "], [3], "word"])
def test_bad_words_must_be_words(bad_words):
    with pytest.raises(SamplingParamsError, match="bad_words"):
        SamplingParams(bad_words=bad_words)


@pytest.mark.parametrize("ids", [[1], [[]], [[True]], [[-1]], "x", [[1.0]]])
def test_bad_words_token_ids_must_be_token_id_lists(ids):
    with pytest.raises(SamplingParamsError, match="bad_words"):
        SamplingParams(bad_words_token_ids=ids)


def test_given_token_ids_are_kept_and_checked(engines):
    llm = engines[False]
    resolve = llm.engine.input_processor.resolve_bad_words
    given = SamplingParams(bad_words=["hello"], bad_words_token_ids=[[5, 6]])
    assert resolve(given) is given  # resolved already (as the server does it): used as they are
    words = [f"w{i}" for i in range(300)] + ["hello", "hello", " hello"]
    resolved = resolve(SamplingParams(bad_words=words)).bad_words_token_ids
    assert len(resolved) == len({tuple(ids) for ids in resolved})  # each sequence once, in order
    assert resolved.index(list(llm.get_tokenizer().encode("hello", add_special_tokens=False))) > 0
    vocab = len(llm.get_tokenizer())
    for ids in ([[10**9]], [[5, vocab]]):
        with pytest.raises(SamplingParamsError, match="out of range"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, bad_words_token_ids=ids), use_tqdm=False)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, bad_words_token_ids=[[5, vocab - 1]]), use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="cannot be tokenized"):
        resolve(SamplingParams(bad_words=["a\ud800b"]))
