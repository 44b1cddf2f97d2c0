"""Workloads: what each benchmark request asks for (its messages and `max_tokens`).

Seven datasets, chosen by name (`DATASETS`):

* `random` — real English/Chinese prose cut to a token length drawn from a `LengthDist`
  (`fixed`, `uniform`, `normal`, or the long-tailed `chat` preset), with a task line on top.
* `shared-prefix` — a system prompt of `prefix_len` tokens that a fraction `prefix_reuse` of requests
  share (one of `num_prefixes`), then a per-request question: measures prefix caching.
* `file` — a JSONL file, one request per line: `{"prompt": str}` or `{"messages": [...]}`, optionally
  with `"output_len"` (or `"max_tokens"`).
* `sharegpt` — a ShareGPT JSON file, sampled as vLLM's benchmark samples it (`ShareGPTDataset`).
* `prefix_repetition`, `sonnet`, `burstgpt` — vLLM's datasets of those names (`PrefixRepetitionDataset`,
  `SonnetDataset`, `BurstGPTDataset`).

A dataset is a pure function of (seed, run, index): `get(i, run=k)` returns the same request whatever the
load shape or the order requests are issued in, so two benchmarks with the same seed send the same text.
The exception is the nonce: every generated prompt starts with a reference line holding a random nonce
(8 digits, of a fixed token count) drawn once per benchmark process, the measured run's number (a sweep's
point) and the request index. So neither requests of one run, nor a sweep's later points, nor a re-run
against the same server hit the prefix cache by accident (shared prefixes put the line inside the shared
part: shared within a run, cold at the start of each; the warm-up has prefixes of its own). Lengths and
prose depend on (seed, index) only, so a sweep's points get the same lengths. The `file` dataset sends its
lines as written: its later points and re-runs can hit the server's prefix cache, which the report's
"Cached input tokens" shows.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvserve.bench import corpus

DATASETS = ("random", "shared-prefix", "file", "sharegpt", "prefix_repetition", "sonnet", "burstgpt")
# vLLM's ShareGPT sampling: a conversation is kept when its prompt and answer have at least this many tokens,
# the prompt at most SHAREGPT_MAX_PROMPT and both together at most SHAREGPT_MAX_TOTAL.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
# sonnet: the instruction that opens every prompt (vLLM's wording), then the file's lines.
SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:"
# burstgpt: the columns read, and the Model whose rows are kept by default (vLLM's filter keeps GPT-4's).
BURSTGPT_COLUMNS = ("Model", "Request tokens", "Response tokens")
BURSTGPT_DEFAULT_MODEL = "GPT-4"
LENGTH_DISTS = ("fixed", "uniform", "normal", "chat")
LANGUAGES = ("en", "zh", "mixed")
# Share of Chinese prompts under --language mixed.
MIXED_ZH_FRACTION = 0.3
# Log-normal sigma of the `chat` preset. Public chat traces (ShareGPT, LMSYS-Chat-1M, Azure's LLM
# inference traces) have right-skewed lengths: most prompts short, mean about twice the median, a tail of
# long ones. sigma 1.1 gives mean = 1.83 x median, P90 = 4.1 x, P99 = 13 x; outputs are less skewed.
CHAT_INPUT_SIGMA = 1.1
CHAT_OUTPUT_SIGMA = 0.8
# The `chat` preset's cap, as a multiple of the median: keeps one draw from exceeding any context window.
CHAT_INPUT_CAP = 16
CHAT_OUTPUT_CAP = 8
# Tokens left for the chat template and special tokens when lengths are clipped to --max-model-len.
TEMPLATE_MARGIN_TOKENS = 64

# Random-number streams: measured requests, warm-up requests, shared prefixes and orders never share draws.
_STREAM_MEASURED, _STREAM_WARMUP, _STREAM_PREFIX, _STREAM_ORDER = 0, 1, 2, 3


class DatasetError(ValueError):
    """A dataset setting or file is unusable; the message says which and why."""


class TextTokenizer(Protocol):
    """The two methods of a Hugging Face tokenizer the benchmark uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request. `messages` are chat messages ({"role", "content"}); the completions API sends their
    contents joined by a blank line (`prompt()`). `input_tokens` is the length the dataset aimed for by its
    tokenizer (None for file prompts); the server's `usage` is what the report counts."""

    index: int
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    input_tokens: int | None = None
    language: str | None = None
    shared_prefix: bool = False

    def prompt(self) -> str:
        return "\n\n".join(m["content"] for m in self.messages)


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: `fixed` = `center`; `uniform` on center x [1 - ratio, 1 + ratio]; `normal` with
    std = ratio x center; `chat` log-normal with median `center` and shape `sigma`, capped at
    `cap` x center. Every draw is clipped to [1, `max_len`] when `max_len` is set."""

    kind: str
    center: int
    range_ratio: float = 0.0
    sigma: float = CHAT_INPUT_SIGMA
    cap: int = CHAT_INPUT_CAP
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_DISTS:
            raise DatasetError(f"length distribution must be one of {', '.join(LENGTH_DISTS)}, got {self.kind!r}")
        if self.center < 1:
            raise DatasetError(f"lengths must be at least 1 token, got {self.center}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise DatasetError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            value = float(self.center)
        elif self.kind == "uniform":
            value = rng.uniform(self.center * (1 - self.range_ratio), self.center * (1 + self.range_ratio))
        elif self.kind == "normal":
            value = rng.normal(self.center, self.center * self.range_ratio)
        else:
            value = min(rng.lognormal(math.log(self.center), self.sigma), self.cap * self.center)
        length = max(1, int(round(value)))
        return min(length, self.max_len) if self.max_len is not None else length


@dataclass(frozen=True)
class DatasetConfig:
    """What `make_dataset` builds. `max_model_len`, when set, clips input + output lengths to fit."""

    name: str = "random"
    input_len: int = 256
    input_dist: str = "fixed"
    output_len: int = 128
    output_dist: str = "fixed"
    range_ratio: float = 0.25
    language: str = "mixed"
    seed: int = 0
    max_model_len: int | None = None
    prefix_len: int = 512
    num_prefixes: int = 1
    prefix_reuse: float = 1.0
    path: str | None = None
    # sharegpt: every request's max_tokens (None: the token count of the conversation's answer).
    sharegpt_output_len: int | None = None
    # prefix_repetition: the requests of a run, spread evenly over the `num_prefixes` prefixes.
    num_prompts: int | None = None
    # burstgpt: the CSV's Model whose rows are sent.
    burstgpt_model: str = BURSTGPT_DEFAULT_MODEL
    # None: a fresh random nonce per run (see the module docstring); tests pass a fixed one.
    run_nonce: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise DatasetError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.name!r}")
        if self.language not in LANGUAGES:
            raise DatasetError(f"--language must be one of {', '.join(LANGUAGES)}, got {self.language!r}")
        if not 0.0 <= self.prefix_reuse <= 1.0:
            raise DatasetError(f"--prefix-reuse must be in [0, 1], got {self.prefix_reuse}")
        if self.num_prefixes < 1 or self.prefix_len < 1:
            raise DatasetError("--num-prefixes and --prefix-len must be at least 1")
        if self.name == "file" and not self.path:
            raise DatasetError("--dataset file needs --dataset-path FILE.jsonl")
        if self.name == "sharegpt" and not self.path:
            raise DatasetError("--dataset sharegpt needs --dataset-path FILE.json (e.g. "
                               "ShareGPT_V3_unfiltered_cleaned_split.json)")
        for name, what in (("sonnet", "a text file of lines (e.g. vLLM's benchmarks/sonnet.txt)"),
                           ("burstgpt", "the BurstGPT CSV (e.g. BurstGPT_without_fails_2.csv)")):
            if self.name == name and not self.path:
                raise DatasetError(f"--dataset {name} needs --dataset-path: {what}")
        if self.name == "prefix_repetition":
            if self.num_prompts is None:
                raise DatasetError("--dataset prefix_repetition needs --num-prompts: the prompts are spread "
                                   "evenly over the prefixes")
            if self.num_prompts < self.num_prefixes:
                raise DatasetError(f"--num-prompts ({self.num_prompts}) must be at least "
                                   f"--prefix-repetition-num-prefixes ({self.num_prefixes})")
        if self.name == "sonnet" and self.prefix_len > self.input_len:
            raise DatasetError(f"--sonnet-prefix-len ({self.prefix_len}) must not exceed --sonnet-input-len "
                               f"({self.input_len})")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise DatasetError(f"--sharegpt-output-len must be at least 1, got {self.sharegpt_output_len}")
        if self.max_model_len is not None and self.max_model_len <= TEMPLATE_MARGIN_TOKENS + 1:
            raise DatasetError(f"--max-model-len must exceed {TEMPLATE_MARGIN_TOKENS + 1} tokens")
        # Builds (and so validates) both length distributions now rather than at the first request.
        self.input_dist_obj()
        self.output_dist_obj()

    def output_dist_obj(self) -> LengthDist:
        max_len = None if self.max_model_len is None else self.max_model_len - TEMPLATE_MARGIN_TOKENS - 1
        return LengthDist(self.output_dist, self.output_len, self.range_ratio, CHAT_OUTPUT_SIGMA,
                          CHAT_OUTPUT_CAP, max_len)

    def input_dist_obj(self) -> LengthDist:
        return LengthDist(self.input_dist, self.input_len, self.range_ratio, CHAT_INPUT_SIGMA, CHAT_INPUT_CAP)

    def fit_input(self, input_len: int, output_len: int, fixed_len: int = 0) -> int:
        """`input_len` clipped so that fixed_len + input + output + margin <= max_model_len."""
        if self.max_model_len is None:
            return input_len
        room = self.max_model_len - TEMPLATE_MARGIN_TOKENS - output_len - fixed_len
        return max(1, min(input_len, room))


def _rng(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, index])


# ------------------------------------------------------------------------------------------------ text


_SENTENCE_END = {"en": re.compile(r"(?<=[.!?])\s+"), "zh": re.compile(r"(?<=[。！？；])")}


class TextSource:
    """Cuts real prose of an exact token length (by `tokenizer`) out of the corpus, starting at a
    sentence. The corpus is tokenized once per language, sentence by sentence, so any slice decodes to the
    text it came from; a slice longer than the corpus wraps around to its first sentence."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[str, list[int]] = {}
        self._starts: dict[str, list[int]] = {}
        for language, paragraphs in (("en", corpus.ENGLISH_PARAGRAPHS), ("zh", corpus.CHINESE_PARAGRAPHS)):
            ids: list[int] = []
            starts: list[int] = []
            for paragraph in paragraphs:
                for sentence in _SENTENCE_END[language].split(paragraph):
                    if not sentence.strip():
                        continue
                    starts.append(len(ids))
                    # English sentences carry their leading space so that joined slices read naturally.
                    ids.extend(tokenizer.encode((" " if language == "en" else "") + sentence.strip(),
                                                add_special_tokens=False))
            self._ids[language] = ids
            self._starts[language] = starts

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def start(self, language: str, rng: np.random.Generator) -> int:
        """A random sentence start in the corpus of `language` (a token index)."""
        return self._starts[language][int(rng.integers(len(self._starts[language])))]

    def text(self, language: str, start: int, num_tokens: int) -> str:
        """About `num_tokens` tokens of prose from token `start` (a cut inside a multi-byte character drops
        that character)."""
        ids = self._ids[language]
        picked: list[int] = []
        position = start
        while len(picked) < num_tokens:
            take = min(num_tokens - len(picked), len(ids) - position)
            picked.extend(ids[position:position + take])
            position = (position + take) % len(ids)
        # A slice can end inside a character's bytes: its replacement character is not real text.
        return self.tokenizer.decode(picked).strip().rstrip("\ufffd")


def _pick_language(config: DatasetConfig, rng: np.random.Generator) -> str:
    if config.language != "mixed":
        return config.language
    return "zh" if rng.random() < MIXED_ZH_FRACTION else "en"


def _task_prompt(source: TextSource, language: str, header: str, num_tokens: int,
                 rng: np.random.Generator, context: str = "") -> str:
    """`header` + a task line + prose, `num_tokens` long in total as the tokenizer counts the whole (where
    the pieces' tokens merge at the joins, the prose is re-cut, so that the prompt is not longer than asked
    and, but for a few cases of merges, exactly as long). The task line is left out when it would take more
    than half the budget; a budget below the header's own length gives the header + 1 token. With `context`,
    the length counted is what the text adds to `context` when it follows it (the text is not prefixed)."""
    instructions = corpus.CHINESE_INSTRUCTIONS if language == "zh" else corpus.ENGLISH_INSTRUCTIONS
    head = f"{header} {instructions[int(rng.integers(len(instructions)))]}\n\n"
    head_tokens = source.count(head)
    if 2 * head_tokens > num_tokens:
        head = f"{header}\n\n"
        head_tokens = source.count(head)
    start = source.start(language, rng)
    prose_len = max(1, num_tokens - head_tokens)
    context_len = source.count(context) if context else 0
    best: str | None = None  # the longest prompt so far that is not over num_tokens
    best_len = 0
    tried: set[int] = set()
    for _ in range(_RECUT_TRIES):
        prompt = head + source.text(language, start, prose_len)
        length = source.count(context + prompt) - context_len
        if length <= num_tokens and (best is None or length > best_len):
            best, best_len = prompt, length
        tried.add(prose_len)
        if length == num_tokens:
            break
        prose_len = max(1, prose_len + num_tokens - length)
        if prose_len in tried:
            break
    return best if best is not None else prompt


_RECUT_TRIES = 4  # re-cuts of the prose towards the exact length (merges at the joins move it by a token or two)


def _reference(language: str, nonce: str, tag: str) -> str:
    return f"编号 {tag}-{nonce}。" if language == "zh" else f"Ref {tag}-{nonce}."


_REFERENCE_NONCE = "00000000"


def _fresh_nonce(source: TextSource, tries: int = 200) -> str:
    """A random 8-digit nonce whose reference lines are as many tokens as `_REFERENCE_NONCE`'s, in both
    languages: the prose's budget is what the header leaves, so a nonce of another token count gave the same
    seed other prose (and dropped the task line now and then) in another process. Most tokenizers split
    digits evenly, and take the first; the last try is taken where none matches."""
    def counts(nonce: str) -> tuple[int, int]:
        return (source.count(_reference("en", nonce, "0")), source.count(_reference("zh", nonce, "0")))

    wanted = counts(_REFERENCE_NONCE)
    nonce = _REFERENCE_NONCE
    for _ in range(tries):
        nonce = f"{secrets.randbelow(10**8):08d}"
        if counts(nonce) == wanted:
            break
    return nonce


# -------------------------------------------------------------------------------------------- datasets


class Dataset(Protocol):
    """`get(index, run=k)` -> the request of that index in measured run k (0-based; warm-up requests,
    `warmup=True`, are the same whatever `run`); the same (config, run, index) always gives the same
    request. `size` is the number of distinct requests of one run (None: unbounded); requests past it
    repeat."""

    size: int | None

    def get(self, index: int, warmup: bool = False, run: int = 0) -> BenchRequest: ...


class Requests(Protocol):
    """What the load loop draws its requests from: a `Dataset`, or one run's `RunRequests`."""

    size: int | None

    def get(self, index: int, warmup: bool = False) -> BenchRequest: ...


class RunRequests:
    """The requests of measured run `run` of `dataset`, as `Requests`."""

    def __init__(self, dataset: Dataset, run: int) -> None:
        self.dataset = dataset
        self.run = run
        self.size = dataset.size

    def get(self, index: int, warmup: bool = False) -> BenchRequest:
        return self.dataset.get(index, warmup, self.run)


def _tag(tag: str, run: int) -> str:
    """A reference line's tag in measured run `run`: run 0 keeps it as it is."""
    return tag if run == 0 else f"{run}:{tag}"


class _SyntheticDataset:
    """Generated prompts: text source, the run's nonce and the length distributions."""

    def __init__(self, config: DatasetConfig, tokenizer: TextTokenizer) -> None:
        self.config = config
        self.source = TextSource(tokenizer)
        self.nonce = config.run_nonce if config.run_nonce is not None else _fresh_nonce(self.source)
        self.size: int | None = None
        self._input = config.input_dist_obj()
        self._output = config.output_dist_obj()


class RandomDataset(_SyntheticDataset):
    def get(self, index: int, warmup: bool = False, run: int = 0) -> BenchRequest:
        rng = _rng(self.config.seed, _STREAM_WARMUP if warmup else _STREAM_MEASURED, index)
        output_len = self._output.sample(rng)
        input_len = self.config.fit_input(self._input.sample(rng), output_len)
        language = _pick_language(self.config, rng)
        tag = f"w{index}" if warmup else _tag(str(index), run)
        text = _task_prompt(self.source, language, _reference(language, self.nonce, tag), input_len, rng)
        return BenchRequest(index, ({"role": "user", "content": text},), output_len, input_len, language)


class SharedPrefixDataset(_SyntheticDataset):
    def __init__(self, config: DatasetConfig, tokenizer: TextTokenizer) -> None:
        super().__init__(config, tokenizer)
        self._prefixes_by_run: dict[str, list[tuple[str, str]]] = {}

    def _prefixes(self, warmup: bool, run: int) -> list[tuple[str, str]]:
        """The shared system prompts of measured run `run`, or the warm-up's own (so that every measured
        run starts with its prefixes cold); built on first use."""
        key = "w" if warmup else str(run)
        if key not in self._prefixes_by_run:
            self._prefixes_by_run[key] = [
                self._system_prompt(_rng(self.config.seed, _STREAM_PREFIX, k),
                                    f"w:p{k}" if warmup else _tag(f"p{k}", run))
                for k in range(self.config.num_prefixes)]
        return self._prefixes_by_run[key]

    def _system_prompt(self, rng: np.random.Generator, tag: str) -> tuple[str, str]:
        language = _pick_language(self.config, rng)
        return _task_prompt(self.source, language, _reference(language, self.nonce, tag),
                            self.config.prefix_len, rng), language

    def get(self, index: int, warmup: bool = False, run: int = 0) -> BenchRequest:
        rng = _rng(self.config.seed, _STREAM_WARMUP if warmup else _STREAM_MEASURED, index)
        tag = f"w{index}" if warmup else _tag(str(index), run)
        shared = rng.random() < self.config.prefix_reuse
        if shared:
            prefixes = self._prefixes(warmup, run)
            system, language = prefixes[int(rng.integers(len(prefixes)))]
        else:
            system, language = self._system_prompt(rng, f"u{tag}")
        output_len = self._output.sample(rng)
        input_len = self.config.fit_input(self._input.sample(rng), output_len, self.config.prefix_len)
        question = _task_prompt(self.source, language, _reference(language, self.nonce, tag), input_len, rng)
        messages = ({"role": "system", "content": system}, {"role": "user", "content": question})
        return BenchRequest(index, messages, output_len, self.config.prefix_len + input_len, language, shared)


def _exact_task_prompt(source: TextSource, language: str, header: str, num_tokens: int,
                       rng: np.random.Generator, context: str = "") -> str:
    """`_task_prompt` redrawn (another task line and start in the prose) until it is exactly `num_tokens`
    after `context`; where no draw is, the longest that is not over (or the last draw)."""
    context_len = source.count(context) if context else 0
    best: str | None = None
    best_len = -1
    for _ in range(_EXACT_TRIES):
        text = _task_prompt(source, language, header, num_tokens, rng, context)
        length = source.count(context + text) - context_len
        if length == num_tokens:
            return text
        if best_len < length <= num_tokens:
            best, best_len = text, length
    return best if best is not None else text


_EXACT_TRIES = 8


class PrefixRepetitionDataset(SharedPrefixDataset):
    """vLLM's prefix_repetition: `num_prompts` prompts spread evenly over `num_prefixes` prefixes of
    `prefix_len` tokens (their counts differ by one at most; exactly num_prompts / num_prefixes each when it
    divides), each prompt its prefix followed by a suffix of its own of `input_len` tokens, in an order
    shuffled by the seed; `max_tokens` is `output_len`. The prompt is one user message (the completions API
    sends it as it is): exactly prefix_len + input_len tokens by the local tokenizer, the prefix's tokens its
    first prefix_len. The prefixes are shared-prefix's: shared within a run, new at each measured run and
    the warm-up's own. Index i takes position i mod num_prompts of the order."""

    def __init__(self, config: DatasetConfig, tokenizer: TextTokenizer) -> None:
        super().__init__(config, tokenizer)
        assert config.num_prompts is not None
        order = np.arange(config.num_prompts) % config.num_prefixes
        np.random.default_rng([config.seed, _STREAM_ORDER]).shuffle(order)
        self._prefix_of = [int(k) for k in order]
        self.size = config.num_prompts

    def _system_prompt(self, rng: np.random.Generator, tag: str) -> tuple[str, str]:
        language = _pick_language(self.config, rng)
        return _exact_task_prompt(self.source, language, _reference(language, self.nonce, tag),
                                  self.config.prefix_len, rng), language

    def prefix_index(self, index: int) -> int:
        """Which prefix request `index` has (0 .. num_prefixes - 1)."""
        return self._prefix_of[index % len(self._prefix_of)]

    def get(self, index: int, warmup: bool = False, run: int = 0) -> BenchRequest:
        rng = _rng(self.config.seed, _STREAM_WARMUP if warmup else _STREAM_MEASURED, index)
        tag = f"w{index}" if warmup else _tag(str(index), run)
        prefix, language = self._prefixes(warmup, run)[self.prefix_index(index)]
        suffix = _exact_task_prompt(self.source, language, "\n\n" + _reference(language, self.nonce, tag),
                                    self.config.input_len, rng, context=prefix)
        return BenchRequest(index, ({"role": "user", "content": prefix + suffix},), self.config.output_len,
                            self.config.prefix_len + self.config.input_len, language, True)


class FileDataset:
    """JSONL prompts, in file order; index i takes line i mod the number of lines."""

    def __init__(self, config: DatasetConfig) -> None:
        assert config.path is not None
        self.config = config
        self._output = config.output_dist_obj()
        self._entries = _read_jsonl(config.path)
        self.size: int | None = len(self._entries)

    def get(self, index: int, warmup: bool = False, run: int = 0) -> BenchRequest:
        # The lines as written, in every run.
        messages, output_len = self._entries[index % len(self._entries)]
        if output_len is None:
            output_len = self._output.sample(_rng(self.config.seed, _STREAM_WARMUP if warmup else
                                                  _STREAM_MEASURED, index))
        return BenchRequest(index, messages, output_len)


def _read_jsonl(path: str) -> list[tuple[tuple[dict[str, str], ...], int | None]]:
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file {path} does not exist")
    entries: list[tuple[tuple[dict[str, str], ...], int | None]] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{line_no}: not JSON ({exc})") from None
            entries.append(_parse_entry(item, f"{path}:{line_no}"))
    if not entries:
        raise DatasetError(f"dataset file {path} has no prompts")
    return entries


def _parse_entry(item: object, where: str) -> tuple[tuple[dict[str, str], ...], int | None]:
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected an object with 'prompt' or 'messages', or a string")
    if isinstance(item.get("prompt"), str):
        messages: tuple[dict[str, str], ...] = ({"role": "user", "content": item["prompt"]},)
    elif isinstance(item.get("messages"), list) and item["messages"]:
        for m in item["messages"]:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: each message needs string 'role' and 'content'")
        messages = tuple({"role": m["role"], "content": m["content"]} for m in item["messages"])
    else:
        raise DatasetError(f"{where}: expected a string 'prompt' or a non-empty 'messages' list")
    output_len = item.get("output_len", item.get("max_tokens"))
    if output_len is not None and (not isinstance(output_len, int) or isinstance(output_len, bool)
                                   or output_len < 1):
        raise DatasetError(f"{where}: output_len must be a positive integer, got {output_len!r}")
    return messages, output_len


class ShareGPTDataset:
    """A ShareGPT JSON file (a list of {"conversations": [{"from", "value"}, ...]}), sampled as vLLM's benchmark
    samples it: the conversations in an order shuffled by the seed, each as its first turn (the prompt) and
    its second (the answer, whose token count is max_tokens unless `sharegpt_output_len`), skipping those
    whose lengths are out of vLLM's bounds (SHAREGPT_*). Conversations are tokenized as requests need them (a
    few hundred microseconds a request, inside the run: a 94,000-conversation file is not tokenized up front);
    index i takes the i-th kept one, cycling once the file is used up."""

    def __init__(self, config: DatasetConfig, tokenizer: TextTokenizer) -> None:
        assert config.path is not None
        self.config = config
        self._tokenizer = tokenizer
        self._pairs = _read_sharegpt(config.path)
        np.random.default_rng(config.seed).shuffle(self._pairs)
        self._next = 0  # the next pair to look at
        self._kept: list[tuple[str, int, int]] = []  # (prompt, prompt tokens, output tokens)
        self.size: int | None = None

    def _fill(self, index: int) -> None:
        tok = self._tokenizer
        fixed = self.config.sharegpt_output_len
        while len(self._kept) <= index and self._next < len(self._pairs):
            prompt, answer = self._pairs[self._next]
            self._next += 1
            prompt_len = len(tok.encode(prompt, add_special_tokens=False))
            output_len = fixed if fixed is not None else len(tok.encode(answer, add_special_tokens=False))
            if (prompt_len < SHAREGPT_MIN_LEN or (fixed is None and output_len < SHAREGPT_MIN_LEN)
                    or prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + output_len > SHAREGPT_MAX_TOTAL):
                continue
            self._kept.append((prompt, prompt_len, output_len))
        if not self._kept:
            raise DatasetError(f"{self.config.path}: no conversation within the lengths vLLM's ShareGPT sampling "
                               f"keeps (prompt and answer of {SHAREGPT_MIN_LEN} tokens or more, prompt at most "
                               f"{SHAREGPT_MAX_PROMPT}, both at most {SHAREGPT_MAX_TOTAL})")

    def get(self, index: int, warmup: bool = False, run: int = 0) -> BenchRequest:
        self._fill(index)
        prompt, prompt_len, output_len = self._kept[index % len(self._kept)]
        return BenchRequest(index, ({"role": "user", "content": prompt},), output_len, prompt_len)


def _read_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of each conversation of two turns or more."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}}")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if (isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2])
                and isinstance(turns[0].get("value"), str) and isinstance(turns[1].get("value"), str)):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise DatasetError(f"{path}: no conversation of two turns or more")
    return pairs


def _read_text(path: str) -> str:
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None


class SonnetDataset(_SyntheticDataset):
    """vLLM's sonnet: a text file of lines (vLLM's benchmarks/sonnet.txt). Every prompt is a reference line and
    SONNET_INSTRUCTION, then the file's first lines (as many whole lines as keep these at most `prefix_len`
    tokens, wrapping round the file), the same in every request of a run, then lines drawn at random (with
    replacement, by the seed) for as long as the prompt stays within `input_len` tokens: at most input_len
    tokens by the local tokenizer and less by under one line's tokens (the first drawn line that would not
    fit ends it). Blank lines are skipped. `max_tokens` is `output_len`. The prompt is one user message; the
    completions API sends it as it is, without a chat template (vLLM applies the model's chat template to
    sonnet prompts unless --skip-chat-template): use the chat endpoint for templated prompts. The reference
    line holds the run's nonce, so the shared prefix is cold at each measured run (the warm-up has its own)."""

    def __init__(self, config: DatasetConfig, tokenizer: TextTokenizer) -> None:
        super().__init__(config, tokenizer)
        assert config.path is not None
        self._lines = [line.strip() + "\n" for line in _read_text(config.path).splitlines() if line.strip()]
        if not self._lines:
            raise DatasetError(f"dataset file {config.path} has no lines (the sonnet dataset takes a text file "
                               "of lines)")
        head = self._head("p")
        head_len = self.source.count(head)
        if head_len > config.prefix_len:
            raise DatasetError(f"--sonnet-prefix-len {config.prefix_len} is shorter than the instruction that "
                               f"opens each prompt ({head_len} tokens)")
        # Each line's tokens where it follows a line (the estimate that picks lines; the prompt is counted whole).
        self._line_len = [max(1, self.source.count(head + line) - head_len) for line in self._lines]
        self._prefix_by_run: dict[str, tuple[str, int]] = {}

    def _head(self, tag: str) -> str:
        return f"{_reference('en', self.nonce, tag)} {SONNET_INSTRUCTION}\n"

    def _first_lines(self, head: str) -> int:
        """How many of the file's first lines (wrapping round it) fit after `head` within prefix_len tokens."""
        count = 0
        text = head
        while True:
            line = self._lines[count % len(self._lines)]
            if self.source.count(text + line) > self.config.prefix_len:
                return count
            text += line
            count += 1

    def _prefix(self, warmup: bool, run: int) -> tuple[str, int]:
        """The shared part of measured run `run` (or of the warm-up) and its token count; built on first use."""
        key = "w" if warmup else str(run)
        if key not in self._prefix_by_run:
            head = self._head("w:p" if warmup else _tag("p", run))
            lines = (self._lines[k % len(self._lines)] for k in range(self._first_lines(head)))
            prefix = head + "".join(lines)
            self._prefix_by_run[key] = prefix, self.source.count(prefix)
        return self._prefix_by_run[key]

    def get(self, index: int, warmup: bool = False, run: int = 0) -> BenchRequest:
        rng = _rng(self.config.seed, _STREAM_WARMUP if warmup else _STREAM_MEASURED, index)
        prefix, prefix_len = self._prefix(warmup, run)
        budget = self.config.input_len - prefix_len
        drawn: list[str] = []
        while True:
            k = int(rng.integers(len(self._lines)))
            if self._line_len[k] > budget:
                break
            drawn.append(self._lines[k])
            budget -= self._line_len[k]
        text = prefix + "".join(drawn)
        length = self.source.count(text)
        while length > self.config.input_len and drawn:  # (the estimate missed merges at the joins)
            drawn.pop()
            text = prefix + "".join(drawn)
            length = self.source.count(text)
        return BenchRequest(index, ({"role": "user", "content": text},), self.config.output_len, length, "en",
                            True)


class BurstGPTDataset(_SyntheticDataset):
    """vLLM's burstgpt: the BurstGPT CSV's rows of one Model (`burstgpt_model`; vLLM keeps GPT-4's) with
    Response tokens > 0 (and, here, Request tokens > 0), in an order shuffled by the seed (vLLM samples rows by
    the seed), cycling once used up. Each row is a prompt of its Request tokens (prose cut to that length, as
    the random dataset's) with its Response tokens as max_tokens; --max-model-len clips them as it clips
    the random dataset's."""

    def __init__(self, config: DatasetConfig, tokenizer: TextTokenizer) -> None:
        super().__init__(config, tokenizer)
        assert config.path is not None
        rows = _read_burstgpt(config.path, config.burstgpt_model)
        order = np.random.default_rng([config.seed, _STREAM_ORDER]).permutation(len(rows))
        self._rows = [rows[int(k)] for k in order]
        self._max_output = config.output_dist_obj().max_len

    def get(self, index: int, warmup: bool = False, run: int = 0) -> BenchRequest:
        input_len, output_len = self._rows[index % len(self._rows)]
        if self._max_output is not None:
            output_len = min(output_len, self._max_output)
        input_len = self.config.fit_input(input_len, output_len)
        rng = _rng(self.config.seed, _STREAM_WARMUP if warmup else _STREAM_MEASURED, index)
        language = _pick_language(self.config, rng)
        tag = f"w{index}" if warmup else _tag(str(index), run)
        text = _task_prompt(self.source, language, _reference(language, self.nonce, tag), input_len, rng)
        return BenchRequest(index, ({"role": "user", "content": text},), output_len, input_len, language)


def _read_burstgpt(path: str, model: str) -> list[tuple[int, int]]:
    """(Request tokens, Response tokens) of the rows of `model` with both counts positive."""
    text = _read_text(path)
    reader = csv.DictReader(io.StringIO(text))
    if not reader.fieldnames:
        raise DatasetError(f"dataset file {path} is empty (the burstgpt dataset takes the BurstGPT CSV)")
    columns = [name.strip() for name in reader.fieldnames]
    for column in BURSTGPT_COLUMNS:
        if column not in columns:
            raise DatasetError(f"{path}: no {column!r} column (a BurstGPT CSV has {', '.join(BURSTGPT_COLUMNS)}; "
                               f"this one has {', '.join(repr(c) for c in columns)})")
    reader.fieldnames = columns
    rows: list[tuple[int, int]] = []
    models: dict[str, int] = {}
    for row in reader:
        name = (row.get("Model") or "").strip()
        models[name] = models.get(name, 0) + 1
        if name != model:
            continue
        lengths = [_token_count(row.get(column), path, reader.line_num, column) for column in BURSTGPT_COLUMNS[1:]]
        if lengths[0] > 0 and lengths[1] > 0:
            rows.append((lengths[0], lengths[1]))
    if not rows:
        seen = ", ".join(f"{name!r} ({count})" for name, count in sorted(models.items())) or "none"
        raise DatasetError(f"{path}: no row of Model {model!r} with Request tokens and Response tokens above 0 "
                           f"(rows by Model: {seen}; --burstgpt-model picks another)")
    return rows


def _token_count(cell: str | None, path: str, line: int, column: str) -> int:
    try:
        value = float((cell or "").strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value == int(value)):
        raise DatasetError(f"{path}:{line}: {column!r} must be a whole number of tokens, got {cell!r}")
    return int(value)


def make_dataset(config: DatasetConfig, tokenizer: Callable[[], TextTokenizer]) -> Dataset:
    """The dataset `config.name`; `tokenizer()` is called only by datasets that generate text or count it."""
    if config.name == "file":
        return FileDataset(config)
    if config.name == "prefix_repetition":
        return PrefixRepetitionDataset(config, tokenizer())
    if config.name == "sonnet":
        return SonnetDataset(config, tokenizer())
    if config.name == "burstgpt":
        return BurstGPTDataset(config, tokenizer())
    if config.name == "sharegpt":
        return ShareGPTDataset(config, tokenizer())  # (loaded before the run, not inside its first request)
    if config.name == "shared-prefix":
        return SharedPrefixDataset(config, tokenizer())
    return RandomDataset(config, tokenizer())
