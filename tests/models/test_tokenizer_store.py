"""A GGUF file's tokenizer, converted once and kept under KVSERVE_CACHE_DIR: later loads read the kept directory
instead of converting the file's vocabulary again, and read back the same tokenizer."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_models import write_bpe_tokenizer_gguf, write_tokenizer_gguf

from kvserve import envs
from kvserve.model import tokenizer as tokenizer_module
from kvserve.model.tokenizer import load_tokenizer


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty KVSERVE_CACHE_DIR, and no conversion remembered in this process (before and after)."""
    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer_module._tokenizer_from_gguf.cache_clear()
    yield tmp_path / "cache" / "tokenizers"
    tokenizer_module._tokenizer_from_gguf.cache_clear()


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The GGUF files Transformers is asked to convert, in order."""
    converted: list[str] = []
    real = tokenizer_module.AutoTokenizer.from_pretrained

    def from_pretrained(path: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("gguf_file"):
            converted.append(kwargs["gguf_file"])
        return real(path, *args, **kwargs)

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", from_pretrained)
    return converted


def _load_fresh(path: str) -> Any:
    tokenizer_module._tokenizer_from_gguf.cache_clear()  # as a new process would
    return load_tokenizer(path)


def test_the_default_models_tokenizer_is_kept_and_read_back_the_same(
        default_gguf_path: str, store: Path, conversions: list[str]) -> None:
    converted = load_tokenizer(default_gguf_path)
    assert conversions == [os.path.basename(default_gguf_path)]
    [entry] = store.iterdir()
    assert (entry / "tokenizer.json").is_file()

    kept = _load_fresh(default_gguf_path)
    assert conversions == [os.path.basename(default_gguf_path)]  # read, not converted again
    assert tokenizer_module._same_tokenizer(converted, kept) == ""
    assert kept.name_or_path == converted.name_or_path
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}]
    assert kept.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_the_kept_tokenizer_keeps_the_files_bos_switch(
        tmp_path: Path, store: Path, conversions: list[str], add_bos_token: bool) -> None:
    path = write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token)
    converted = load_tokenizer(path)
    kept = _load_fresh(path)
    assert conversions == ["tok.gguf"]
    assert kept.add_bos_token is converted.add_bos_token is add_bos_token
    expected = [1] if add_bos_token else []
    assert kept("hello world")["input_ids"][:1] == converted("hello world")["input_ids"][:1]
    assert kept("hello world")["input_ids"][: len(expected)] == expected
    assert kept.decode(kept("hello world")["input_ids"], skip_special_tokens=True) == "hello world"


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _pipeline(tokenizer: Any) -> dict[str, Any]:
    return json.loads(tokenizer.backend_tokenizer.to_str())


def test_a_qwen_style_tokenizer_is_kept_with_the_conversions_pipeline(
        tmp_path: Path, store: Path, conversions: list[str]) -> None:
    # Transformers 5 builds a Qwen2Tokenizer's pipeline from the class's defaults unless given the saved one
    # (an NFC normalizer the conversion lacks): decomposed text would then get other ids than the first start.
    path = write_bpe_tokenizer_gguf(str(tmp_path / "qwen.gguf"), CHATML)
    converted = load_tokenizer(path)
    kept = _load_fresh(path)
    assert conversions == ["qwen.gguf"]
    assert type(kept) is type(converted)
    assert _pipeline(kept) == _pipeline(converted)
    for text in ("e\u0301", "\u212b", "\ufb01", " hello <tool_call>"):
        assert kept(text)["input_ids"] == converted(text)["input_ids"], text
    assert {i: repr(t) for i, t in kept.added_tokens_decoder.items()} == {
        i: repr(t) for i, t in converted.added_tokens_decoder.items()}


def test_a_replaced_file_is_converted_again(tmp_path: Path, store: Path, conversions: list[str]) -> None:
    # Same size and modification time (a copy that keeps times): the kept copy's key is the file's content.
    path = write_bpe_tokenizer_gguf(str(tmp_path / "qwen.gguf"), CHATML)
    before = os.stat(path)
    assert "'role'" in load_tokenizer(path).chat_template
    write_bpe_tokenizer_gguf(path, CHATML.replace("'role'", "'ROLE'"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size
    assert "'ROLE'" in load_tokenizer(path).chat_template  # this process's own memory of it too
    assert "'ROLE'" in _load_fresh(path).chat_template
    assert conversions == ["qwen.gguf", "qwen.gguf"]
    assert len(list(store.iterdir())) == 2


def test_a_copy_of_the_file_reads_the_kept_conversion(tmp_path: Path, store: Path, conversions: list[str]) -> None:
    path = write_bpe_tokenizer_gguf(str(tmp_path / "qwen.gguf"), CHATML)
    load_tokenizer(path)
    (tmp_path / "elsewhere").mkdir()
    copy = str(tmp_path / "elsewhere" / "qwen.gguf")
    Path(copy).write_bytes(Path(path).read_bytes())
    assert load_tokenizer(copy).name_or_path == str(tmp_path / "elsewhere")
    assert conversions == ["qwen.gguf"]


def test_an_unreadable_entry_is_converted_again(
        tmp_path: Path, store: Path, conversions: list[str], caplog: pytest.LogCaptureFixture) -> None:
    path = write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token=True)
    load_tokenizer(path)
    [entry] = store.iterdir()
    (entry / "tokenizer.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="kvserve.model.tokenizer"):
        tokenizer = _load_fresh(path)
    assert tokenizer("hello")["input_ids"][0] == 1
    assert conversions == ["tok.gguf", "tok.gguf"]
    assert "could not be read" in caplog.text
    # The new conversion took the unreadable copy's place: the next start reads it.
    assert _load_fresh(path)("hello")["input_ids"][0] == 1
    assert conversions == ["tok.gguf", "tok.gguf"]
    assert [e.name for e in store.iterdir()] == [entry.name]


def test_nothing_is_kept_where_the_cache_cannot_be_written(
        tmp_path: Path, store: Path, conversions: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(blocker))
    path = write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token=True)
    assert load_tokenizer(path)("hello")["input_ids"][0] == 1
    assert _load_fresh(path)("hello")["input_ids"][0] == 1
    assert conversions == ["tok.gguf", "tok.gguf"]
    assert blocker.is_file()


def test_a_tokenizer_that_reads_back_differently_is_not_kept(
        tmp_path: Path, store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(tokenizer_module, "_same_tokenizer", lambda a, b: "its vocabulary differs")
    path = write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token=True)
    with caplog.at_level(logging.INFO, logger="kvserve.model.tokenizer"):
        load_tokenizer(path)
    assert list(store.iterdir()) == []  # neither the entry nor its staging directory
    assert "not keeping the converted tokenizer: read back, its vocabulary differs" in caplog.text


def test_a_second_writer_leaves_the_first_ones_entry(tmp_path: Path, store: Path) -> None:
    path = write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token=True)
    tokenizer = load_tokenizer(path)
    [entry] = store.iterdir()
    before = {f.name: f.read_bytes() for f in entry.iterdir()}
    tokenizer_module._store_conversion(tokenizer, str(entry))  # as another process finishing second
    assert list(store.iterdir()) == [entry]
    assert {f.name: f.read_bytes() for f in entry.iterdir()} == before


def test_same_tokenizer_names_what_differs(tmp_path: Path, store: Path) -> None:
    a = load_tokenizer(write_tokenizer_gguf(str(tmp_path / "a.gguf"), add_bos_token=True))
    b = load_tokenizer(str(tmp_path / "a.gguf"))
    assert tokenizer_module._same_tokenizer(a, b) == ""
    b.chat_template = "{{ messages }}"
    assert tokenizer_module._same_tokenizer(a, b) == "its chat_template differs"
    c = load_tokenizer(write_tokenizer_gguf(str(tmp_path / "c.gguf"), add_bos_token=False))
    assert tokenizer_module._same_tokenizer(a, c) == "its add_bos_token differs"


def test_a_failure_while_keeping_leaves_the_conversion(
        tmp_path: Path, store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def fails(a: Any, b: Any) -> str:
        raise RuntimeError("read-back broke")

    monkeypatch.setattr(tokenizer_module, "_same_tokenizer", fails)
    path = write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token=True)
    with caplog.at_level(logging.WARNING, logger="kvserve.model.tokenizer"):
        assert load_tokenizer(path)("hello")["input_ids"][0] == 1
    assert list(store.iterdir()) == []
    assert "RuntimeError: read-back broke" in caplog.text


def test_a_kept_copy_is_readable_by_other_users(tmp_path: Path, store: Path) -> None:
    load_tokenizer(write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token=True))
    [entry] = store.iterdir()
    assert entry.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in entry.iterdir())


def test_storing_prunes_unused_copies_and_leftovers(tmp_path: Path, store: Path) -> None:
    store.mkdir(parents=True)
    now = time.time()
    ages = {"old-entry": 31 * 86400, "recent-entry": 29 * 86400, ".partial-old": 7200, ".partial-new": 60,
            ".stale-old": 7200}
    for name, age in ages.items():
        (store / name).mkdir()
        (store / name / "tokenizer.json").write_text("{}")
        os.utime(store / name, (now - age, now - age))
    load_tokenizer(write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token=True))
    left = sorted(e.name for e in store.iterdir())
    assert left == sorted([".partial-new", "recent-entry", *(e for e in left if e.startswith("tok-"))])
    assert len(left) == 3


def test_reading_a_kept_copy_marks_it_used(tmp_path: Path, store: Path) -> None:
    path = write_tokenizer_gguf(str(tmp_path / "tok.gguf"), add_bos_token=True)
    load_tokenizer(path)
    [entry] = store.iterdir()
    long_ago = time.time() - 40 * 86400
    os.utime(entry, (long_ago, long_ago))
    _load_fresh(path)
    assert entry.stat().st_mtime > long_ago + 39 * 86400
