"""The tokenizer (and chat template) of a model directory or a GGUF file."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve import envs
from kvserve.model.gguf import has_tokenizer
from kvserve.model.paths import ModelLoadError, read_chat_template

logger = logging.getLogger(__name__)

# Bump when what is stored changes, so older entries are never read.
_STORE_VERSION = 1


def load_tokenizer(model_path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """HF tokenizer for an HF directory, or for a .gguf file (vocabulary and chat template from its metadata).

    `chat_template` replaces the model's template: a path to a template file, or the template text itself.
    """
    path = os.path.abspath(os.path.expanduser(model_path))
    if os.path.isdir(path) and not _has_tokenizer_files(path):
        # Transformers builds some classes' tokenizers with no vocabulary from such a directory (Qwen2's
        # holds one token), and fails others' with a page on sentencepiece.
        raise ModelLoadError(
            f"cannot load a tokenizer from {model_path}: the directory has no tokenizer files "
            f"(tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, ...); pass --tokenizer "
            f"(LLM(tokenizer=...)): a directory, .gguf file or cached repo id with the model's tokenizer"
        )
    if path.endswith(".gguf") and os.path.isfile(path) and not has_tokenizer(path):
        # (Transformers' conversion fails with a bare KeyError)
        raise ModelLoadError(
            f"cannot load a tokenizer from {model_path}: the GGUF file carries none (no tokenizer.ggml.model / "
            f"tokenizer.ggml.tokens metadata); pass --tokenizer (LLM(tokenizer=...)): a directory, .gguf file or "
            f"cached repo id with the model's tokenizer"
        )
    try:
        if path.endswith(".gguf"):
            # Building a tokenizer from GGUF metadata takes seconds; engines started again in the same
            # process (tests, notebooks) reuse the conversion. A copy keeps callers independent.
            stat = os.stat(path)
            tokenizer = copy.deepcopy(_tokenizer_from_gguf(path, stat.st_size, stat.st_mtime_ns, stat.st_ino,
                                                           stat.st_ctime_ns))
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {model_path}: {exc}") from exc
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def _has_tokenizer_files(directory: str) -> bool:
    """Whether `directory` holds a file a Transformers tokenizer is read from (its vocabulary or settings):
    tokenizer*.json / tokenizer.model / vocab.* / merges.txt, a SentencePiece or tiktoken model, Mistral's tekken.json."""
    for name in os.listdir(directory):
        lower = name.lower()
        if lower.startswith(("tokenizer", "vocab")) or lower in ("merges.txt", "tekken.json") \
                or lower.endswith((".model", ".tiktoken")):
            return True
    return False


@functools.lru_cache(maxsize=4)
def _tokenizer_from_gguf(path: str, size: int, mtime_ns: int, inode: int, ctime_ns: int) -> PreTrainedTokenizerBase:
    # The file's size, times and inode are part of this process's key so a replaced file is converted again (a
    # copy that keeps the old mtime still changes ctime); the kept copy's key is the file's content.
    stored = _stored_conversion_dir(path)
    if os.path.isdir(stored):
        try:
            tokenizer = _load_stored(stored)
        except Exception as exc:  # noqa: BLE001 - tokenizers' own errors are bare Exceptions; converting again is safe
            logger.warning("the stored tokenizer %s could not be read (%s); converting %s again", stored, exc, path)
            _discard(stored)
        else:
            with contextlib.suppress(OSError):
                os.utime(stored)  # in use: pruning keeps it
            tokenizer.name_or_path = os.path.dirname(path)  # as the conversion names it
            return tokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _store_conversion(tokenizer, stored)
    return tokenizer


# A GGUF file's metadata, the tokenizer's source, comes before its tensors; the largest vocabularies with their
# merges take a few MB of it. The kept copy's key hashes this much of the file's start.
_KEY_BYTES = 32 << 20
# Kept copies unread for this long, and staging or discarded directories left by a killed process, are removed
# when another copy is stored.
_UNUSED_S = 30 * 86400
_ABANDONED_S = 3600


def _stored_conversion_dir(path: str) -> str:
    """Where the conversion of the GGUF file at `path` is kept: KVSERVE_CACHE_DIR/tokenizers/<file>-<key>, the key
    hashing the file's start (its metadata) and size, and naming the libraries that converted it."""
    digest = hashlib.sha256(json.dumps([_STORE_VERSION, os.path.getsize(path), transformers.__version__,
                                        tokenizers.__version__]).encode())
    with open(path, "rb") as f:
        remaining = _KEY_BYTES
        while remaining and (chunk := f.read(min(remaining, 1 << 20))):
            digest.update(chunk)
            remaining -= len(chunk)
    name = f"{os.path.basename(path).removesuffix('.gguf')}-{digest.hexdigest()[:16]}"
    return os.path.join(envs.KVSERVE_CACHE_DIR, "tokenizers", name)


# The conversion's switches that save_pretrained does not keep (Transformers 5 drops add_bos_token from the
# saved settings, though the saved post-processor still adds the BOS): given again when the directory is read.
_SWITCHES = ("add_bos_token", "add_eos_token")
_SWITCHES_FILE = "kvserve_gguf.json"


def _load_stored(stored: str) -> PreTrainedTokenizerBase:
    with open(os.path.join(stored, _SWITCHES_FILE), encoding="utf-8") as f:
        switches = json.load(f)
    # The saved tokenizer.json as it is: Transformers 5 builds some classes' pipelines from the class's own
    # defaults otherwise (Qwen2's adds an NFC normalizer the conversion does not have).
    backend = tokenizers.Tokenizer.from_file(os.path.join(stored, "tokenizer.json"))
    return AutoTokenizer.from_pretrained(stored, tokenizer_object=backend, **switches)


def _store_conversion(tokenizer: PreTrainedTokenizerBase, stored: str) -> None:
    """Keep a GGUF file's converted tokenizer as an HF tokenizer directory: loading that takes a fraction of a
    second, converting the file's vocabulary again seconds (every server process and engine core pays it).
    Kept only when reading it back gives the same tokenizer (`_same_tokenizer`). Written to a temporary
    directory, synced and renamed, so readers never see a partial one; any failure (read-only disk, another
    process first) keeps nothing and leaves the conversion as the tokenizer."""
    parent = os.path.dirname(stored)
    try:
        os.makedirs(parent, exist_ok=True)
        _prune(parent)
        staging = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    except OSError as exc:
        logger.debug("not keeping the converted tokenizer in %s: %s", parent, exc)
        return
    try:
        tokenizer.save_pretrained(staging)
        switches = {name: value for name in _SWITCHES if isinstance(value := getattr(tokenizer, name, None), bool)}
        with open(os.path.join(staging, _SWITCHES_FILE), "w", encoding="utf-8") as f:
            json.dump(switches, f)
        difference = _same_tokenizer(tokenizer, _load_stored(staging))
        if difference:
            logger.info("not keeping the converted tokenizer: read back, %s", difference)
            return
        _sync_tree(staging)
        os.chmod(staging, 0o755)  # mkdtemp's is 0700: a shared cache directory serves other users too
        os.rename(staging, stored)
    except OSError as exc:  # another process stored it first, or the disk refused
        logger.debug("not keeping the converted tokenizer as %s: %s", stored, exc)
    except Exception as exc:  # noqa: BLE001 - keeping a copy only saves time; the conversion stands
        logger.warning("not keeping the converted tokenizer as %s: %s: %s", stored, type(exc).__name__, exc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing left there once renamed


def _sync_tree(directory: str) -> None:
    """fsync a directory's files and the directory, so a rename after a crash never shows empty files."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(stored: str) -> None:
    """Remove a kept copy that could not be read, so the next conversion can take its place (renamed aside
    first: a directory is never half removed under its own name)."""
    aside = os.path.join(os.path.dirname(stored), f".stale-{os.path.basename(stored)}-{os.getpid()}")
    try:
        os.rename(stored, aside)
    except OSError as exc:
        logger.debug("could not remove the unreadable %s: %s", stored, exc)
        return
    shutil.rmtree(aside, ignore_errors=True)


def _prune(parent: str) -> None:
    """Remove kept copies unread for `_UNUSED_S` and staging or discarded directories older than `_ABANDONED_S`."""
    now = time.time()
    for entry in os.scandir(parent):
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        leftover = entry.name.startswith((".partial-", ".stale-"))
        if entry.is_dir(follow_symlinks=False) and age > (_ABANDONED_S if leftover else _UNUSED_S):
            shutil.rmtree(entry.path, ignore_errors=True)


# Plain, spaced, NFD and compatibility characters, and the spacing that clean_up_tokenization_spaces rewrites.
_PROBE_TEXTS = ("Hello world", "  two  spaces\n\n\ttab", "ünïcödé 日本語 🙂 ∑", "x=1234567; y = 3.14159", "<|im_start|>",
                "e\u0301 \ufb01 \u212b \uff21", "a . b , it 's do n't")


def _same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> str:
    """What differs between two tokenizers that should be the same ('' when nothing seen): class, settings,
    vocabulary, added tokens with their flags, the whole tokenizers pipeline (normalizer, pre-tokenizer, model,
    post-processor, decoder), and the ids and text of probe texts with and without special tokens (the special
    tokens' own text among them)."""
    for name in ("__class__", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "chat_template", "model_max_length", "clean_up_tokenization_spaces", "padding_side", *_SWITCHES):
        if getattr(a, name, None) != getattr(b, name, None):
            return f"its {name} differs"
    if a.get_vocab() != b.get_vocab():
        return "its vocabulary differs"
    if {i: repr(t) for i, t in a.added_tokens_decoder.items()} != {
            i: repr(t) for i, t in b.added_tokens_decoder.items()}:
        return "its added tokens differ"
    pipeline_a, pipeline_b = (json.loads(t.backend_tokenizer.to_str()) if hasattr(t, "backend_tokenizer") else None
                              for t in (a, b))
    if pipeline_a != pipeline_b:
        return "its tokenizers pipeline differs"
    for text in (*_PROBE_TEXTS, " ".join(a.all_special_tokens)):
        for special in (True, False):
            ids = a(text, add_special_tokens=special)["input_ids"]
            if ids != b(text, add_special_tokens=special)["input_ids"]:
                return f"{text!r} is tokenized differently"
            if a.decode(ids) != b.decode(ids) or a.decode(ids, skip_special_tokens=True) != b.decode(
                    ids, skip_special_tokens=True):
                return f"{text!r} is decoded differently"
    return ""


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's character for each byte (the GPT-2 scheme, which Llama 3, Qwen2 and SmolLM2 use): the
    printable Latin-1 bytes stand for themselves, the 68 others for U+0100 onwards in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars: dict[str, int] = {}
    others = 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(0x100 + others)] = byte
            others += 1
    return chars


_BYTE_OF_CHAR = _byte_level_chars()


@dataclass
class _PieceBytes:
    """A tokenizer's vocabulary pieces as bytes: how its pieces hold bytes ("byte_level": a ByteLevel decoder,
    each piece's characters map to bytes; "byte_fallback": <0xHH> pieces for single bytes and ▁ for a space,
    SentencePiece-style; "text": neither), its added tokens (their text is what they stand for), and the bytes
    of the pieces looked up so far (None: the piece says nothing more than the text)."""

    scheme: str
    added: frozenset[int]
    known: dict[int, bytes | None] = field(default_factory=dict)


@functools.lru_cache(maxsize=8)
def _piece_bytes(tokenizer: PreTrainedTokenizerBase) -> _PieceBytes:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        state = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except (AttributeError, TypeError, ValueError):
        state = {}
    types = {state.get("type"), *(d.get("type") for d in state.get("decoders") or () if isinstance(d, dict))}
    scheme = "byte_level" if "ByteLevel" in types else "byte_fallback" if "ByteFallback" in types else "text"
    added = frozenset(getattr(tokenizer, "added_tokens_decoder", {})) if scheme != "text" else frozenset()
    return _PieceBytes(scheme, added)


def _bytes_of_piece(piece: object, scheme: str) -> bytes | None:
    if not isinstance(piece, str):
        return None
    if scheme == "byte_level":
        return bytes(_BYTE_OF_CHAR[c] for c in piece) if all(c in _BYTE_OF_CHAR for c in piece) else None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        with contextlib.suppress(ValueError):
            return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int, text: str) -> bytes:
    """The bytes token `token_id` stands for (OpenAI's logprobs `bytes`): a piece of a character split over
    several tokens, whose `text` alone decodes to U+FFFD, keeps its own bytes, so a client can join them back;
    a SentencePiece word keeps its leading space, which decoding it alone strips. `text` (the token decoded)
    where the vocabulary piece says nothing more: added tokens, other schemes. Each piece is looked up once a
    tokenizer (this runs for every token and top logprob of a chat response)."""
    table = _piece_bytes(tokenizer)
    if table.scheme == "text" or token_id in table.added:
        return text.encode("utf-8")
    if token_id not in table.known:
        table.known[token_id] = _bytes_of_piece(tokenizer.convert_ids_to_tokens(token_id), table.scheme)
    found = table.known[token_id]
    return found if found is not None else text.encode("utf-8")
