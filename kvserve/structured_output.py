"""Structured output: a request's grammar (a JSON schema, any JSON object, a regex, a choice of strings, or a
Lark / GBNF grammar) restricts each sampled token to those that keep the output a prefix of the grammar's
language. The grammar engine is llguidance (one of vLLM's backends): it compiles a grammar against the
tokenizer and gives, for each step, one bit per token id.

Where each part runs:
* the API process (and the offline `LLM`) turns the request's spec into a grammar and validates it without
  the tokenizer (`grammar_for`, from `SamplingParams`' validation): a bad schema or regex is a 400;
* the engine core compiles it against the tokenizer (`GrammarCompiler`, in a worker thread: the tokenizer
  is built on first use, which takes seconds for a large vocabulary) and keeps one matcher per request
  (`StructuredOutputs`): a step's mask rows come from the matchers, and each sampled token advances its
  matcher;
* the model runner's sampler sets every token outside a row's mask to -inf before anything else, so the
  logprobs are those of the constrained distribution (as vLLM's).
A matcher that has reached its grammar's end allows only EOS; once it has consumed EOS (`ignore_eos`), the
request runs unconstrained.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase

    from kvserve.protocol.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# The spec's kinds, as vLLM's StructuredOutputsParams names them.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class GrammarError(ValueError):
    """The request's grammar cannot be compiled (its message says why)."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's mask: one bit per token id."""
    return (vocab_size + 31) // 32


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec, validated (without the tokenizer). GrammarError when invalid."""
    import llguidance

    matcher = llguidance.LLMatcher
    # vLLM's defaults: JSON may carry whitespace where JSON allows it, unless disable_any_whitespace.
    options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    try:
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}")
            if spec.disable_additional_properties:
                schema = _no_additional_properties(schema)
            grammar = matcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        elif spec.json_object:
            grammar = matcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        elif spec.regex is not None:
            grammar = matcher.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            grammar = matcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in spec.choice))
        elif spec.grammar is not None:
            grammar = llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF (converted)
        else:
            raise GrammarError(f"structured output needs one of {', '.join(KINDS)}")
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError, a GBNF that does not convert, depth
        raise GrammarError(f"invalid {spec.kind}: {e}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {spec.kind}: {error.strip()}")
    return grammar


def _lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _no_additional_properties(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not set it."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# --------------------------------------------------------------------------------------------- engine core


class GrammarCompiler:
    """Compiles grammars against the tokenizer in one worker thread. The llguidance tokenizer is built there
    on the first grammar, from `load_tokenizer()` (the HF tokenizer; the engine core loads it only now)."""

    def __init__(self, load_tokenizer: Callable[[], PreTrainedTokenizerBase], vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def set_tokenizer_loader(self, load_tokenizer: Callable[[], PreTrainedTokenizerBase]) -> None:
        """Where the HF tokenizer comes from, when the llguidance tokenizer is not built yet."""
        with self._lock:
            self._load_tokenizer = load_tokenizer

    def submit(self, grammar: str) -> concurrent.futures.Future[llguidance.LLMatcher]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
        return self._pool.submit(self.compile, grammar)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip())
        return matcher

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    hf_tokenizer = self._load_tokenizer()
                    eos = list(dict.fromkeys(
                        [*self._eos_token_ids, *([hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None
                                                 else [])]))
                    self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=eos or None)
                except Exception as e:
                    raise GrammarError(f"structured output needs the model's tokenizer, which could not be "
                                       f"loaded: {e}") from e
            return self._tokenizer

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@dataclass
class _Grammar:
    matcher: llguidance.LLMatcher
    done: bool = False  # consumed EOS (or failed): no longer constrains


class StructuredOutputs:
    """The engine core's matchers, one per live request with a grammar."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.words = bitmask_words(compiler.vocab_size)
        self._grammars: dict[str, _Grammar] = {}
        # Tokens a matcher refused (the mask allowed them: never, unless a bug); counted for the tests.
        self.num_refused_tokens = 0

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._grammars

    def __len__(self) -> int:
        return len(self._grammars)

    @property
    def req_ids(self) -> set[str]:
        return set(self._grammars)

    def add(self, req_id: str, matcher: llguidance.LLMatcher) -> None:
        self._grammars[req_id] = _Grammar(matcher)

    def release(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._grammars.pop(req_id, None)

    def bitmasks(self, req_ids: Sequence[str]) -> dict[str, bytes]:
        """The next token's mask of each request in `req_ids` that has a grammar still constraining it."""
        import llguidance.torch
        import torch

        live = [(req_id, g) for req_id in req_ids if (g := self._grammars.get(req_id)) is not None and not g.done]
        if not live:
            return {}
        masks = torch.empty((len(live), self.words), dtype=torch.int32)
        for i, (_, g) in enumerate(live):
            llguidance.torch.fill_next_token_bitmask(g.matcher, masks, i)
        return {req_id: masks[i].numpy().tobytes() for i, (req_id, _) in enumerate(live)}

    def accept(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Advance a request's matcher past its newly sampled tokens."""
        g = self._grammars.get(req_id)
        if g is None or g.done:
            return
        for token_id in token_ids:
            if g.matcher.is_stopped():  # past the grammar's end: EOS taken under ignore_eos
                g.done = True
                return
            if not g.matcher.consume_token(token_id):
                self.num_refused_tokens += 1
                logger.warning("request %s: the grammar refused token %d (%s); the request continues "
                               "unconstrained", req_id, token_id, g.matcher.get_error())
                g.done = True
                return

    def check_invariants(self, live_req_ids: set[str]) -> None:
        assert set(self._grammars) <= live_req_ids, \
            f"grammars kept for requests that are not live: {sorted(set(self._grammars) - live_req_ids)}"
