"""Workloads: exact-length real prose, length distributions, shared prefixes, JSONL files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvserve.bench import corpus
from kvserve.bench.datasets import (
    TEMPLATE_MARGIN_TOKENS,
    DatasetConfig,
    DatasetError,
    FileDataset,
    LengthDist,
    RandomDataset,
    RunRequests,
    SharedPrefixDataset,
    make_dataset,
)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _body(text: str) -> str:
    # The prose after the reference line and the task line.
    return text.split("\n\n", 1)[1]


@pytest.mark.parametrize("language", ["en", "zh"])
@pytest.mark.parametrize("input_len", [24, 200, 4000])
def test_random_prompts_have_the_requested_token_length(tokenizer, language, input_len):
    dataset = RandomDataset(DatasetConfig(input_len=input_len, language=language, run_nonce="n0"), tokenizer)
    for index in range(5):
        request = dataset.get(index)
        assert request.input_tokens == input_len
        # Re-tokenizing the joined text can merge tokens at the joins, and a cut inside a multi-byte character
        # drops it; the prose is re-cut so that the prompt is never longer than asked (it was 1-2 tokens over
        # in English) and at most two tokens shorter.
        assert 0 <= input_len - _count(tokenizer, request.prompt()) <= 2


def test_prompts_are_real_prose_not_token_soup(tokenizer):
    en_words = set(re.findall(r"[A-Za-z'-]+", " ".join(corpus.ENGLISH_PARAGRAPHS)))
    zh_chars = set("".join(corpus.CHINESE_PARAGRAPHS))
    dataset = RandomDataset(DatasetConfig(input_len=300, language="mixed", run_nonce="n0"), tokenizer)
    languages = set()
    for index in range(40):
        request = dataset.get(index)
        languages.add(request.language)
        body = _body(request.prompt())
        if request.language == "en":
            words = re.findall(r"[A-Za-z'-]+", body)
            # Only the first and last word can be cut mid-word.
            assert all(w in en_words for w in words[1:-1]), body
        else:
            assert set(body) <= zh_chars, body
    assert languages == {"en", "zh"}


def test_same_seed_same_requests_and_no_shared_prefix_between_requests(tokenizer):
    config = DatasetConfig(input_len=64, input_dist="uniform", output_dist="normal", run_nonce="n0")
    a, b = RandomDataset(config, tokenizer), RandomDataset(config, tokenizer)
    assert [a.get(i) for i in range(10)] == [b.get(i) for i in range(10)]
    # The index comes first: two requests differ within their first KV block (16 tokens), so they share no
    # cached block by accident.
    firsts = [tokenizer.encode(a.get(i).prompt(), add_special_tokens=False)[:16] for i in range(10)]
    assert len({tuple(f) for f in firsts}) == 10
    assert a.get(0, warmup=True) != a.get(0)
    # Another run (another nonce) sends other text: re-runs do not hit the previous run's cache.
    other = RandomDataset(DatasetConfig(input_len=64, run_nonce="n1"), tokenizer)
    assert other.get(0).prompt() != a.get(0).prompt()


@pytest.mark.parametrize("language", ["en", "zh", "mixed"])
def test_processes_with_one_seed_send_the_same_prose_under_their_own_nonces(tokenizer, language):
    """Each process draws its nonce; the prose (and task line) must not depend on it. A hex nonce's token
    count varied, and with it the prose's budget: the same seed gave other prose (or no task line) in another
    process. Nonces are drawn to the token count of a fixed one."""
    config = DatasetConfig(input_len=48, input_dist="uniform", language=language)
    datasets = [RandomDataset(config, tokenizer) for _ in range(4)]
    assert len({d.nonce for d in datasets}) > 1
    for index in range(8):
        requests = [d.get(index) for d in datasets]
        assert len({r.prompt().replace(d.nonce, "N") for d, r in zip(datasets, requests, strict=True)}) == 1
        assert len({_count(tokenizer, r.prompt()) for r in requests}) == 1


def test_each_measured_run_sends_its_own_prompts_of_the_same_lengths(tokenizer):
    # A sweep's second point re-sent the first point's prompts, and the server's prefix cache answered 81-83 %
    # of its prompt tokens (H200, session 28): its TTFT and throughput were not the load's.
    config = DatasetConfig(input_len=64, input_dist="uniform", output_dist="normal", run_nonce="n0")
    dataset = RandomDataset(config, tokenizer)
    runs = [RunRequests(dataset, k) for k in range(3)]
    for i in range(10):
        requests = [run.get(i) for run in runs]
        # Different within the first KV block (16 tokens), so nothing is cached from an earlier run.
        firsts = {tuple(tokenizer.encode(r.prompt(), add_special_tokens=False)[:16]) for r in requests}
        assert len(firsts) == 3
        assert len({(r.input_tokens, r.max_tokens, r.language) for r in requests}) == 1
    assert runs[0].get(3) == dataset.get(3)  # run 0 is the dataset's own
    assert runs[2].get(3) == RandomDataset(config, tokenizer).get(3, run=2)  # reproducible from the seed
    assert runs[1].get(0, warmup=True) == dataset.get(0, warmup=True)


def test_shared_prefixes_are_shared_within_a_run_and_cold_at_the_next(tokenizer):
    config = DatasetConfig(name="shared-prefix", prefix_len=64, input_len=16, prefix_reuse=1.0,
                           language="en", run_nonce="n0")
    dataset = SharedPrefixDataset(config, tokenizer)

    def systems(warmup: bool = False, run: int = 0) -> set[str]:
        return {dataset.get(i, warmup, run).messages[0]["content"] for i in range(6)}

    warmup, run0, run1 = systems(warmup=True), systems(run=0), systems(run=1)
    assert len(warmup) == len(run0) == len(run1) == 1
    assert len(warmup | run0 | run1) == 3


def _draws(dist: LengthDist, n: int = 20000) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.array([dist.sample(rng) for _ in range(n)])


def test_length_distributions():
    assert set(_draws(LengthDist("fixed", 100), 100)) == {100}
    uniform = _draws(LengthDist("uniform", 100, 0.5))
    assert uniform.min() >= 50 and uniform.max() <= 150 and abs(uniform.mean() - 100) < 2
    normal = _draws(LengthDist("normal", 1000, 0.1))
    assert abs(normal.mean() - 1000) < 5 and abs(normal.std() - 100) < 5
    assert _draws(LengthDist("normal", 10, 0.9)).min() >= 1


def test_chat_preset_is_long_tailed():
    draws = _draws(LengthDist("chat", 200))
    median = np.median(draws)
    assert 180 < median < 220
    # Most prompts short, a tail of long ones: mean well above the median, P99 many medians out.
    assert draws.mean() > 1.5 * median
    assert np.percentile(draws, 99) > 8 * median
    assert draws.max() <= 16 * 200
    assert (draws <= median).mean() > 0.45


def test_max_model_len_clips_input_plus_output(tokenizer):
    config = DatasetConfig(input_len=400, input_dist="chat", output_len=200, output_dist="chat",
                           max_model_len=512, run_nonce="n0")
    dataset = RandomDataset(config, tokenizer)
    for index in range(50):
        request = dataset.get(index)
        assert request.input_tokens + request.max_tokens + TEMPLATE_MARGIN_TOKENS <= 512


def test_shared_prefix_reuse(tokenizer):
    def systems(reuse: float, num_prefixes: int = 1) -> list[str]:
        config = DatasetConfig(name="shared-prefix", prefix_len=64, input_len=16, prefix_reuse=reuse,
                               num_prefixes=num_prefixes, language="en", run_nonce="n0")
        dataset = SharedPrefixDataset(config, tokenizer)
        requests = [dataset.get(i) for i in range(40)]
        for r in requests:
            assert r.messages[0]["role"] == "system" and r.messages[1]["role"] == "user"
            assert abs(_count(tokenizer, r.messages[0]["content"]) - 64) <= 3
        return [r.messages[0]["content"] for r in requests]

    assert len(set(systems(1.0))) == 1
    assert len(set(systems(1.0, num_prefixes=3))) == 3
    assert len(set(systems(0.0))) == 40
    half = systems(0.5)
    shared = max(half.count(s) for s in half)
    assert 10 <= shared <= 30


def test_file_dataset(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "one"}, {"messages": [{"role": "user", "content": "two"}], "output_len": 7}, "three"]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    dataset = make_dataset(DatasetConfig(name="file", path=str(path), output_len=5),
                           tokenizer=lambda: pytest.fail("the file dataset must not load a tokenizer"))
    assert isinstance(dataset, FileDataset) and dataset.size == 3
    got = [dataset.get(i) for i in range(4)]
    assert [r.prompt() for r in got] == ["one", "two", "three", "one"]
    assert [r.max_tokens for r in got] == [5, 7, 5, 5]


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"text": "x"}', "'prompt'"),
    ('{"messages": [{"role": "user"}]}', "'role' and 'content'"),
    ('{"prompt": "x", "output_len": 0}', "positive integer"),
])
def test_file_dataset_rejects_bad_lines(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=message) as info:
        FileDataset(DatasetConfig(name="file", path=str(path)))
    assert ":2:" in str(info.value)


def test_config_errors():
    with pytest.raises(DatasetError, match="--dataset-path"):
        DatasetConfig(name="file")
    with pytest.raises(DatasetError, match="length distribution"):
        DatasetConfig(input_dist="zipf")
    with pytest.raises(DatasetError, match="at least 1"):
        DatasetConfig(input_len=0)
    with pytest.raises(DatasetError, match="--prefix-reuse"):
        DatasetConfig(prefix_reuse=1.5)


class _WordTokenizer:
    """One token per word: lengths known without a model (make_dataset takes its class as the loader)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))

    def decode(self, token_ids: list[int]) -> str:
        return ""


def test_sharegpt_is_sampled_as_vllm_samples_it(tmp_path):
    # vllm bench serve --dataset-name sharegpt --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json
    def conversation(prompt_words: int, answer_words: int) -> dict:
        return {"id": "x", "conversations": [{"from": "human", "value": " ".join(["q"] * prompt_words)},
                                             {"from": "gpt", "value": " ".join(["a"] * answer_words)}]}

    data = [conversation(5 + k, 10 + k) for k in range(6)]
    data += [conversation(3, 10), conversation(10, 3), conversation(1025, 10), conversation(1000, 1049),
             {"id": "one turn", "conversations": [{"from": "human", "value": "hello there you all"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    dataset = make_dataset(DatasetConfig(name="sharegpt", path=str(path), seed=1), _WordTokenizer)
    requests = [dataset.get(i) for i in range(12)]
    # only the six conversations within vLLM's bounds, each once in a seeded order, then again
    kept = [(r.input_tokens, r.max_tokens) for r in requests[:6]]
    assert sorted(kept) == [(5 + k, 10 + k) for k in range(6)]
    assert [(r.input_tokens, r.max_tokens) for r in requests[6:]] == kept
    assert requests[0].messages == ({"role": "user", "content": " ".join(["q"] * requests[0].input_tokens)},)
    again = make_dataset(DatasetConfig(name="sharegpt", path=str(path), seed=1), _WordTokenizer)
    assert [again.get(i).input_tokens for i in range(6)] == [r.input_tokens for r in requests[:6]]
    # a fixed output length: answers shorter than 4 tokens are kept, and a total within 2048 with it
    fixed = make_dataset(DatasetConfig(name="sharegpt", path=str(path), sharegpt_output_len=7), _WordTokenizer)
    assert sorted(fixed.get(i).input_tokens for i in range(8)) == [5, 6, 7, 8, 9, 10, 10, 1000]
    assert {fixed.get(i).max_tokens for i in range(8)} == {7}
    with pytest.raises(DatasetError, match="needs --dataset-path"):
        DatasetConfig(name="sharegpt")
    path.write_text(json.dumps([conversation(2, 2)]))
    with pytest.raises(DatasetError, match="no conversation within the lengths"):
        make_dataset(DatasetConfig(name="sharegpt", path=str(path)), _WordTokenizer).get(0)
