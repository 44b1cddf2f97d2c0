"""Unit-test fixtures (the SmolLM2 tokenizer, `smollm_tokenizer`, comes from tests/conftest.py)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

# English and Chinese; the emoji and rare CJK characters used by the tests are left out on purpose so
# that the SentencePiece model spells them with byte-fallback tokens (one UTF-8 byte per token).
_SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a small test corpus for streaming.",
    "Machine learning models generate text one token at a time.",
    "Streaming detokenization must never break a character in two.",
    "我们今天去公园散步。",
    "你好，世界！这是一个测试。",
    "天气很好，我们去吃饭吧。",
    "模型一次生成一个词元。",
]


@pytest.fixture(scope="session")
def sp_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A tiny SentencePiece BPE model with byte fallback, trained here and wrapped as a Llama tokenizer."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from transformers import LlamaTokenizer

    directory: Path = tmp_path_factory.mktemp("sp_tokenizer")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_SP_CORPUS * 10),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer = LlamaTokenizer.from_pretrained(str(directory), legacy=False)
    assert len(tokenizer) > 256, "byte-fallback pieces missing: the SentencePiece model was not loaded"
    return tokenizer
