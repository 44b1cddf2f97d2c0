"""OpenAI's chat logprobs `bytes`: each token's own bytes, so that a character split over several tokens (an
emoji in byte-level BPE, a byte-fallback piece in SentencePiece-style vocabularies) joins back from them, where
each token's text alone is U+FFFD."""

from __future__ import annotations

from typing import Any

from kvserve.entrypoints.openai.serving_common import chat_logprobs
from kvserve.model.tokenizer import token_bytes
from kvserve.protocol.outputs import Logprob

TEXT = "Party 🎉 at the café, 日本"


def test_byte_level_pieces_join_back_into_the_text(smollm_tokenizer: Any) -> None:
    ids = smollm_tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [smollm_tokenizer.decode([i]) for i in ids]
    assert "\ufffd" in texts  # the emoji's bytes are split over tokens that decode to U+FFFD alone
    entries = [{i: Logprob(-0.5, 1, t)} for i, t in zip(ids, texts, strict=True)]
    content = chat_logprobs(smollm_tokenizer, ids, entries, 1)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == TEXT.encode("utf-8")
    assert [c["token"] for c in content] == texts  # `token` stays the decoded text, as vLLM shows it
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
    # A whole character's token: its bytes are its text's.
    whole = [(i, t) for i, t in zip(ids, texts, strict=True) if "\ufffd" not in t]
    assert whole and all(token_bytes(smollm_tokenizer, i, t) == t.encode() for i, t in whole)
    # An added (special) token: its text.
    end = smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(smollm_tokenizer, end, "<|im_end|>") == b"<|im_end|>"


def _sentencepiece_style() -> Any:
    """A unigram vocabulary with byte-fallback pieces <0x00>..<0xFF> and ▁ for spaces (Llama 2's scheme)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), *((f"<0x{b:02X}>", -10.0) for b in range(256)), ("▁Party", -1.0), ("▁at", -1.0),
             ("▁", -2.0)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_byte_fallback_pieces_are_their_byte() -> None:
    tokenizer = _sentencepiece_style()
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["▁", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    assert b"".join(token_bytes(tokenizer, i, tokenizer.decode([i])) for i in ids[1:]) == "🎉".encode()
    # A word keeps its leading space (▁), which decoding it alone strips: the words join back with their spaces.
    ids = tokenizer.encode("Party at 🎉", add_special_tokens=False)
    assert tokenizer.decode([ids[0]]) == "Party"
    assert b"".join(token_bytes(tokenizer, i, tokenizer.decode([i])) for i in ids) == " Party at 🎉".encode()


def test_each_piece_is_looked_up_once(smollm_tokenizer: Any, monkeypatch: Any) -> None:
    """token_bytes runs for every token and top logprob of a chat response: the vocabulary is asked once a
    token, and the added tokens once a tokenizer (rebuilt on every read of added_tokens_decoder)."""
    import copy

    tokenizer = copy.deepcopy(smollm_tokenizer)  # a tokenizer of its own: the lookups are kept per tokenizer
    looked_up: list[int] = []
    convert = tokenizer.convert_ids_to_tokens
    monkeypatch.setattr(tokenizer, "convert_ids_to_tokens", lambda i: looked_up.append(i) or convert(i))
    ids = smollm_tokenizer.encode(TEXT, add_special_tokens=False)
    first = [token_bytes(tokenizer, i, smollm_tokenizer.decode([i])) for i in ids]
    assert [token_bytes(tokenizer, i, smollm_tokenizer.decode([i])) for i in ids] == first
    assert sorted(looked_up) == sorted(set(ids))


def test_a_tokenizer_without_a_byte_scheme_gives_the_text() -> None:
    class Plain:
        def decode(self, ids: list[int]) -> str:
            return "é"

    assert token_bytes(Plain(), 5, "é") == "é".encode()  # type: ignore[arg-type]
