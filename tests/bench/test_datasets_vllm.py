"""vLLM's prefix_repetition, sonnet and burstgpt datasets: lengths, sharing, files, seeds, errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.conftest import parse_bench
from bench.fake_server import FakeOpenAIServer
from kvserve.bench.config import BenchConfigError
from kvserve.bench.datasets import (
    SONNET_INSTRUCTION,
    BurstGPTDataset,
    DatasetConfig,
    DatasetError,
    PrefixRepetitionDataset,
    SonnetDataset,
    make_dataset,
)
from kvserve.entrypoints.cli import main


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _prefix_repetition(tokenizer, **settings: object) -> PrefixRepetitionDataset:
    values: dict[str, object] = dict(name="prefix_repetition", prefix_len=48, input_len=24, num_prefixes=3,
                                     num_prompts=12, output_len=9, run_nonce="n0")
    values.update(settings)
    return PrefixRepetitionDataset(DatasetConfig(**values), tokenizer)  # type: ignore[arg-type]


@pytest.mark.parametrize("language", ["en", "zh"])
def test_prefix_repetition_lengths_are_exact_and_prefixes_shared_evenly(tokenizer, language):
    dataset = _prefix_repetition(tokenizer, language=language)
    requests = [dataset.get(i) for i in range(12)]
    prefixes: Counter[tuple[int, ...]] = Counter()
    suffixes = set()
    for request in requests:
        (message,) = request.messages
        ids = _ids(tokenizer, message["content"])
        assert len(ids) == 48 + 24 == request.input_tokens
        assert request.max_tokens == 9
        prefixes[tuple(ids[:48])] += 1
        suffixes.add(tuple(ids[48:]))
    # 3 distinct prefixes, each exactly 12 / 3 times; every suffix its own
    assert sorted(prefixes.values()) == [4, 4, 4]
    assert len(suffixes) == 12
    # the prefix's own tokens are the prompt's first 48: the server's prefix cache can share them
    system = dataset._prefixes(False, 0)
    assert {tuple(_ids(tokenizer, text)) for text, _ in system} == set(prefixes)


def test_prefix_repetition_order_is_shuffled_by_the_seed_and_uneven_counts_differ_by_one(tokenizer):
    a = _prefix_repetition(tokenizer, num_prompts=40, num_prefixes=4, seed=3)
    b = _prefix_repetition(tokenizer, num_prompts=40, num_prefixes=4, seed=3)
    c = _prefix_repetition(tokenizer, num_prompts=40, num_prefixes=4, seed=4)
    order = [a.prefix_index(i) for i in range(40)]
    assert order == [b.prefix_index(i) for i in range(40)]
    assert [a.get(i) for i in range(5)] == [b.get(i) for i in range(5)]
    assert order != [c.prefix_index(i) for i in range(40)]
    assert order != sorted(order) and order != [i % 4 for i in range(40)]
    uneven = _prefix_repetition(tokenizer, num_prompts=11, num_prefixes=3)
    assert sorted(Counter(uneven.prefix_index(i) for i in range(11)).values()) == [3, 4, 4]
    # a later measured run (sweep point) gets prefixes of its own, cold in the server's cache
    assert a.get(0, run=1).prompt()[:20] != a.get(0).prompt()[:20]


def _sonnet_file(tmp_path: Path, lines: int = 60) -> Path:
    words = ["summer", "beauty", "eternal", "lines", "time", "rose", "glass", "youth", "fair", "winter"]
    text = "\n".join(f"Line {k}: thy {words[k % 10]} and {words[(3 * k) % 10]} shall not fade {k}"
                     for k in range(lines))
    path = tmp_path / "sonnet.txt"
    path.write_text(text + "\n\n", encoding="utf-8")
    return path


def test_sonnet_prompts_are_the_files_lines_within_the_lengths(tokenizer, tmp_path):
    path = _sonnet_file(tmp_path)
    file_lines = [line for line in path.read_text().splitlines() if line]
    lines = set(file_lines)
    longest = max(len(_ids(tokenizer, line + "\n")) for line in lines)
    config = DatasetConfig(name="sonnet", path=str(path), input_len=200, prefix_len=60, output_len=15, seed=1,
                           run_nonce="n0")
    dataset = make_dataset(config, lambda: tokenizer)
    assert isinstance(dataset, SonnetDataset)
    prompts = []
    for index in range(6):
        request = dataset.get(index)
        text = request.prompt()
        length = len(_ids(tokenizer, text))
        # within the input length, and short of it by less than one line (+ 2 tokens of merges at the joins)
        assert request.input_tokens == length and 200 - longest - 2 <= length <= 200
        assert request.max_tokens == 15
        head, body = text.split("\n", 1)
        assert head.endswith(SONNET_INSTRUCTION)
        assert set(body.splitlines()) <= lines
        prompts.append(body.splitlines())
    # the same first lines of the file open every prompt, up to the prefix length; the rest is drawn
    shared = dataset._prefix(False, 0)[0]
    opening = shared.splitlines()[1:]
    assert len(opening) >= 2 and opening == file_lines[:len(opening)]
    assert all(p[:len(opening)] == opening for p in prompts)
    assert all(p.startswith(shared) for p in (dataset.get(i).prompt() for i in range(6)))
    assert 60 - longest - 2 <= len(_ids(tokenizer, shared)) <= 60
    assert len({tuple(p) for p in prompts}) == 6
    # each measured run (sweep point) and the warm-up open with a reference line of their own: the shared
    # prefix is cold at each; the lines are the same
    heads = {dataset.get(0, run=1).prompt().split("\n")[0], dataset.get(0, warmup=True).prompt().split("\n")[0],
             dataset.get(0).prompt().split("\n")[0]}
    assert len(heads) == 3
    assert dataset.get(0, run=1).prompt().split("\n")[1:] == dataset.get(0).prompt().split("\n")[1:]
    again = make_dataset(config, lambda: tokenizer)
    assert [again.get(i) for i in range(6)] == [dataset.get(i) for i in range(6)]
    other = make_dataset(DatasetConfig(name="sonnet", path=str(path), input_len=200, prefix_len=60, seed=2,
                                       run_nonce="n0"), lambda: tokenizer)
    assert [other.get(i).prompt() for i in range(6)] != [dataset.get(i).prompt() for i in range(6)]


def test_sonnet_errors(tokenizer, tmp_path):
    def build(path: Path | str, **settings: object) -> SonnetDataset:
        values: dict[str, object] = dict(name="sonnet", path=str(path), input_len=550, prefix_len=200,
                                         run_nonce="n0")
        values.update(settings)
        return SonnetDataset(DatasetConfig(**values), tokenizer)  # type: ignore[arg-type]

    with pytest.raises(DatasetError, match="does not exist"):
        build(tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(DatasetError, match="has no lines"):
        build(tmp_path / "blank.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(DatasetError, match="not UTF-8"):
        build(tmp_path / "bin.txt")
    with pytest.raises(DatasetError, match="shorter than the instruction"):
        build(_sonnet_file(tmp_path), prefix_len=3, input_len=100)
    with pytest.raises(DatasetError, match=r"--sonnet-prefix-len \(300\) must not exceed --sonnet-input-len"):
        DatasetConfig(name="sonnet", path="x", prefix_len=300, input_len=200)
    with pytest.raises(DatasetError, match="--dataset sonnet needs --dataset-path"):
        DatasetConfig(name="sonnet")


BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def _burstgpt_file(tmp_path: Path, rows: list[tuple[str, int, int]], header: str = BURSTGPT_HEADER) -> Path:
    path = tmp_path / "burstgpt.csv"
    path.write_text(header + "".join(f"{k}.5,{model},{req},{resp},{req + resp},Conversation log\n"
                                     for k, (model, req, resp) in enumerate(rows)))
    return path


def test_burstgpt_rows_filtered_and_lengths_taken_from_the_csv(tokenizer, tmp_path):
    rows = [("GPT-4", 30 + k, 5 + k) for k in range(5)]
    rows += [("ChatGPT", 77, 7), ("GPT-4", 40, 0), ("GPT-4", 0, 12), ("ChatGPT", 50, 0)]
    path = _burstgpt_file(tmp_path, rows)
    config = DatasetConfig(name="burstgpt", path=str(path), seed=5, language="en", run_nonce="n0")
    dataset = make_dataset(config, lambda: tokenizer)
    assert isinstance(dataset, BurstGPTDataset)
    requests = [dataset.get(i) for i in range(10)]
    kept = [(r.input_tokens, r.max_tokens) for r in requests[:5]]
    assert sorted(kept) == [(30 + k, 5 + k) for k in range(5)]  # GPT-4's rows with both counts above 0
    assert [(r.input_tokens, r.max_tokens) for r in requests[5:]] == kept  # then again, in the same order
    for request in requests:
        assert 0 <= request.input_tokens - len(_ids(tokenizer, request.prompt())) <= 2
    again = make_dataset(config, lambda: tokenizer)
    assert [again.get(i) for i in range(5)] == requests[:5]
    orders = {tuple(make_dataset(DatasetConfig(name="burstgpt", path=str(path), seed=s, run_nonce="n0"),
                                 lambda: tokenizer).get(i).max_tokens for i in range(5)) for s in range(6)}
    assert len(orders) > 1  # the seed orders the rows
    chatgpt = make_dataset(DatasetConfig(name="burstgpt", path=str(path), burstgpt_model="ChatGPT", run_nonce="n0"),
                           lambda: tokenizer)
    assert {(chatgpt.get(i).input_tokens, chatgpt.get(i).max_tokens) for i in range(3)} == {(77, 7)}
    long = _burstgpt_file(tmp_path, [("GPT-4", 30, 80), ("GPT-4", 50, 5)])
    clipped = make_dataset(DatasetConfig(name="burstgpt", path=str(long), max_model_len=100, run_nonce="n0"),
                           lambda: tokenizer)
    # --max-model-len clips the rows' lengths to fit (prompt + output + 64 tokens of template)
    assert sorted((r.input_tokens, r.max_tokens) for r in (clipped.get(i) for i in range(2))) == [(1, 35), (31, 5)]


@pytest.mark.parametrize("content, message", [
    (BURSTGPT_HEADER.replace("Response tokens", "Output"), "no 'Response tokens' column"),
    ("Timestamp,Request tokens,Response tokens\n1,2,3\n", "no 'Model' column"),
    ("", "is empty"),
    (BURSTGPT_HEADER + "0.1,GPT-4,12,x,12,Conversation log\n", r"burstgpt.csv:2: 'Response tokens' must be a whole"),
    (BURSTGPT_HEADER + "0.1,ChatGPT,12,3,15,Conversation log\n", r"no row of Model 'GPT-4'.*'ChatGPT' \(1\)"),
])
def test_burstgpt_refuses_bad_files(tokenizer, tmp_path, content, message):
    path = tmp_path / "burstgpt.csv"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        BurstGPTDataset(DatasetConfig(name="burstgpt", path=str(path), run_nonce="n0"), tokenizer)


def test_dataset_config_errors():
    with pytest.raises(DatasetError, match="--dataset burstgpt needs --dataset-path"):
        DatasetConfig(name="burstgpt")
    with pytest.raises(DatasetError, match="prefix_repetition needs --num-prompts"):
        DatasetConfig(name="prefix_repetition", num_prefixes=2)
    with pytest.raises(DatasetError, match=r"--num-prompts \(3\) must be at least --prefix-repetition-num-prefixes"):
        DatasetConfig(name="prefix_repetition", num_prefixes=10, num_prompts=3)


# ------------------------------------------------------------------------------------ command line


def test_vllms_dataset_flags_translate_with_vllms_defaults():
    url = "http://127.0.0.1:1/v1/completions"
    d = parse_bench(url, "--dataset-name", "prefix_repetition", "--num-prompts", "20").dataset
    assert (d.name, d.prefix_len, d.input_len, d.num_prefixes, d.output_len, d.num_prompts) == \
        ("prefix_repetition", 256, 256, 10, 128, 20)
    d = parse_bench(url, "--dataset-name", "prefix_repetition", "--num-prompts", "8", "--prefix-repetition-prefix-len",
                    "100", "--prefix-repetition-suffix-len", "30", "--prefix-repetition-num-prefixes", "4",
                    "--prefix-repetition-output-len", "7", "--random-range-ratio", "0.5").dataset
    assert (d.prefix_len, d.input_len, d.num_prefixes, d.output_len, d.input_dist, d.output_dist) == \
        (100, 30, 4, 7, "fixed", "fixed")
    d = parse_bench(url, "--dataset-name", "sonnet", "--dataset-path", "s.txt", "--skip-chat-template").dataset
    assert (d.name, d.path, d.input_len, d.output_len, d.prefix_len) == ("sonnet", "s.txt", 550, 150, 200)
    d = parse_bench(url, "--dataset-name", "sonnet", "--dataset-path", "s.txt", "--sonnet-input-len", "300",
                    "--sonnet-output-len", "20", "--sonnet-prefix-len", "50").dataset
    assert (d.input_len, d.output_len, d.prefix_len) == (300, 20, 50)
    d = parse_bench(url, "--dataset-name", "burstgpt", "--dataset-path", "b.csv").dataset
    assert (d.name, d.path, d.burstgpt_model) == ("burstgpt", "b.csv", "GPT-4")
    assert parse_bench(url, "--dataset-name", "burstgpt", "--dataset-path", "b.csv", "--burstgpt-model",
                       "ChatGPT").dataset.burstgpt_model == "ChatGPT"
    # another dataset's flags are ignored, as vLLM ignores them (and as --sharegpt-output-len is)
    d = parse_bench(url, "--sonnet-input-len", "999", "--prefix-repetition-num-prefixes", "5",
                    "--input-len", "64").dataset
    assert (d.name, d.input_len, d.num_prefixes, d.prefix_len, d.num_prompts) == ("random", 64, 1, 512, None)


@pytest.mark.parametrize("flags, message", [
    (("--dataset-name", "prefix_repetition", "--num-prompts", "5", "--prefix-repetition-suffix-len", "0"),
     "--prefix-repetition-suffix-len must be at least 1, got 0"),
    (("--dataset-name", "prefix_repetition", "--num-prompts", "5", "--prefix-repetition-num-prefixes", "-1"),
     "--prefix-repetition-num-prefixes must be at least 1, got -1"),
    (("--dataset-name", "prefix_repetition", "--duration", "5"), "needs --num-prompts"),
    (("--dataset-name", "prefix_repetition", "--num-prompts", "5"), r"--num-prompts \(5\) must be at least"),
    (("--dataset-name", "sonnet", "--dataset-path", "s", "--sonnet-output-len", "0"),
     "--sonnet-output-len must be at least 1"),
    (("--dataset-name", "sonnet"), "--dataset sonnet needs --dataset-path"),
    (("--dataset-name", "burstgpt"), "--dataset burstgpt needs --dataset-path"),
])
def test_vllms_dataset_flag_errors(flags, message):
    with pytest.raises((BenchConfigError, DatasetError), match=message):
        parse_bench("http://127.0.0.1:1/v1/completions", *flags)


def _run(server: FakeOpenAIServer, tokenizer_dir: str, json_path: Path, *flags: str) -> dict:
    assert main(["bench", "--base-url", server.base_url, "--endpoint", "/v1/completions", "--max-concurrency", "4",
                 "--no-progress", "--tokenizer", tokenizer_dir, "--seed", "2", "--json", str(json_path),
                 *flags]) == 0
    return json.loads(json_path.read_text())


def test_the_three_datasets_end_to_end(fake_server, tiny_model_dir, tokenizer, tmp_path):
    tokenizer_dir = tiny_model_dir("llama")
    server = fake_server(stop_after_tokens=2)
    data = _run(server, tokenizer_dir, tmp_path / "p.json", "--dataset-name", "prefix_repetition", "--num-prompts",
                "6", "--prefix-repetition-prefix-len", "40", "--prefix-repetition-suffix-len", "20",
                "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "5")
    prompts = [body["prompt"] for body in server.state.bodies]
    assert len(prompts) == 6 and {body["max_tokens"] for body in server.state.bodies} == {5}
    assert all(len(_ids(tokenizer, p)) == 60 for p in prompts)
    assert sorted(Counter(tuple(_ids(tokenizer, p)[:40]) for p in prompts).values()) == [3, 3]
    dataset = data["config"]["dataset"]
    assert {k: dataset[k] for k in ("name", "prefix_len", "input_len", "num_prefixes", "output_len", "num_prompts",
                                    "seed")} == {"name": "prefix_repetition", "prefix_len": 40, "input_len": 20,
                                                 "num_prefixes": 2, "output_len": 5, "num_prompts": 6, "seed": 2}

    server = fake_server(stop_after_tokens=2)
    data = _run(server, tokenizer_dir, tmp_path / "s.json", "--dataset-name", "sonnet", "--dataset-path",
                str(_sonnet_file(tmp_path)), "--num-prompts", "3", "--sonnet-input-len", "120", "--sonnet-prefix-len",
                "40", "--sonnet-output-len", "6")
    assert len(server.state.bodies) == 3 and {body["max_tokens"] for body in server.state.bodies} == {6}
    assert all(SONNET_INSTRUCTION in body["prompt"] and len(_ids(tokenizer, body["prompt"])) <= 120
               for body in server.state.bodies)
    dataset = data["config"]["dataset"]
    assert (dataset["name"], dataset["input_len"], dataset["prefix_len"], dataset["output_len"]) == \
        ("sonnet", 120, 40, 6)

    server = fake_server(stop_after_tokens=2)
    csv_path = _burstgpt_file(tmp_path, [("GPT-4", 20 + k, 3 + k) for k in range(4)] + [("ChatGPT", 9, 9)])
    data = _run(server, tokenizer_dir, tmp_path / "b.json", "--dataset-name", "burstgpt", "--dataset-path",
                str(csv_path), "--num-prompts", "4")
    assert sorted(body["max_tokens"] for body in server.state.bodies) == [3, 4, 5, 6]
    dataset = data["config"]["dataset"]
    assert (dataset["name"], dataset["path"], dataset["burstgpt_model"]) == ("burstgpt", str(csv_path), "GPT-4")


def test_a_bad_dataset_file_stops_the_command_with_its_message(fake_server, tiny_model_dir, tmp_path, capsys):
    server = fake_server()
    path = tmp_path / "b.csv"
    path.write_text("Model,Request tokens\nGPT-4,12\n")
    assert main(["bench", "--base-url", server.base_url, "--num-prompts", "2", "--no-progress", "--tokenizer",
                 tiny_model_dir("llama"), "--dataset-name", "burstgpt", "--dataset-path", str(path)]) == 2
    assert "no 'Response tokens' column" in capsys.readouterr().err
    assert not server.state.bodies
