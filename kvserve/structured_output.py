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
request runs unconstrained. With no EOS in the model or its tokenizer, llguidance ends grammars with an
end-of-text token it picks; the engine core makes it one of the request's EOS ids, so that it ends the request.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase

    from kvserve.core.request import Request
    from kvserve.protocol.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# The spec's kinds, as vLLM's StructuredOutputsParams names them.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


# Compiled grammars kept for reuse (`GrammarCompiler.compile`).
_COMPILED_KEPT = 64


class GrammarError(ValueError):
    """The request's grammar cannot be compiled (its message says why)."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's mask: one bit per token id."""
    return (vocab_size + 31) // 32


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec, validated (without the tokenizer). GrammarError when invalid. Kept on
    the spec: the samples of an n>1 request share it, and a large schema takes its time (about 0.1 s for
    270 kB). A spec is not to be changed once used."""
    cached = spec.__dict__.get("_grammar")
    if cached is not None:
        return cached
    grammar = _grammar_for(spec)
    spec.__dict__["_grammar"] = grammar  # not a field: msgspec does not carry it, == does not compare it
    return grammar


def _grammar_for(spec: StructuredOutputsParams) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    # vLLM's defaults: JSON may carry whitespace where JSON allows it, unless disable_any_whitespace.
    options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    try:
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if not isinstance(schema, dict):
                raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}")
            _check_integers(schema)
            if spec.disable_additional_properties:
                schema = _no_additional_properties(schema)
            grammar = matcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        elif spec.json_object:
            grammar = matcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        elif spec.regex is not None:
            grammar = matcher.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            # One terminal, the lexer's alternation: as parser alternatives, a list past 2,000 choices broke
            # llguidance's row limit while generating.
            grammar = matcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(_lark_string(c)
                                                                                   for c in spec.choice))
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


# The integers a JSON schema may hold: the requests' messages carry 64-bit ones, and llguidance 1.9 crashes
# the process on an enum or const value within 512 of -2**63.
_SCHEMA_INT_MIN, _SCHEMA_INT_MAX = -(2**63) + 1024, 2**63 - 1


def _check_integers(value: Any) -> None:
    """GrammarError for an integer anywhere in the schema outside [_SCHEMA_INT_MIN, _SCHEMA_INT_MAX]."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, int) and not isinstance(v, bool) and not _SCHEMA_INT_MIN <= v <= _SCHEMA_INT_MAX:
            raise GrammarError(f"integers in a JSON schema must be within [-2**63 + 1024, 2**63 - 1], got {v}")


def _lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas (values such
# as const, enum and default are data, left alone).
_SCHEMA_KEYWORDS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                    "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _map_subschemas(schema: dict, fn: Callable[[Any], Any]) -> dict:
    """A copy of `schema` with `fn` applied to each of its direct subschemas (the values of the keywords that
    take a schema, a list or a map of schemas; data such as const and enum is left alone)."""
    out = dict(schema)
    for key in _SCHEMA_KEYWORDS:
        if isinstance(out.get(key), (dict, list)):
            value = out[key]
            out[key] = [fn(v) for v in value] if isinstance(value, list) else fn(value)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(v) for v in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: fn(v) for name, v in out[key].items()}
    return out


def _no_additional_properties(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not set it (vLLM's
    disable_additional_properties). The caller's schema is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, _no_additional_properties)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def rebase_refs(schema: Any, base: str) -> Any:
    """The schema with its references within the document (`$ref` "#..."), which point from its root, pointing
    from `base` instead (a JSON pointer, "#/$defs/x"): for a schema placed there inside another. The caller's
    schema is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, lambda sub: rebase_refs(sub, base))
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):  # ("#name", an $anchor's, needs no base)
        out["$ref"] = base + ref[1:]
    return out


# --------------------------------------------------------------------------------------------- engine core


class GrammarCompiler:
    """Compiles grammars against the tokenizer in one worker thread. The llguidance tokenizer is built there
    on the first grammar, from `load_tokenizer()` (the HF tokenizer; the engine core loads it only now)."""

    def __init__(self, load_tokenizer: Callable[[], PreTrainedTokenizerBase], vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the model's: the logits' width
        self._eos_token_ids = list(eos_token_ids)
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)  # with the tokenizer's, once loaded
        # The tokens the grammars end with (llguidance's EOS), once the tokenizer is loaded: the known EOS ids,
        # or, where the model and its tokenizer have none, an end-of-text token llguidance picks itself.
        self.grammar_eos_token_ids: frozenset[int] = frozenset()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: GrammarError | None = None  # a failed load is not retried for every request
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Compiled grammars in their initial state, by grammar (the samples of an n>1 request, repeated
        # schemas): a copy of one is a fresh matcher. Used by the worker thread only.
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def set_tokenizer_loader(self, load_tokenizer: Callable[[], PreTrainedTokenizerBase]) -> None:
        """Where the HF tokenizer comes from, when the llguidance tokenizer is not built yet."""
        with self._lock:
            self._load_tokenizer = load_tokenizer
            self._tokenizer_error = None

    def submit(self, grammar: str) -> concurrent.futures.Future[llguidance.LLMatcher]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
        return self._pool.submit(self.compile, grammar)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        import llguidance

        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
            if compiled.is_error():
                raise GrammarError(compiled.get_error().strip())
            self._compiled[grammar] = compiled
            if len(self._compiled) > _COMPILED_KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled.deep_copy()

    def forget(self, grammar: str) -> None:
        """Drop `grammar`'s compiled matcher, so that the next request compiles it anew: its copies share the
        compiled lexer and its budget, and a request that spent it (a regex whose automaton grows past
        llguidance's limit) left every later copy able to end only (an empty text, "stop"). On the compile
        thread, after the compiles already submitted."""
        if self._pool is not None:
            self._pool.submit(self._compiled.pop, grammar, None)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                if self._tokenizer_error is not None:
                    raise self._tokenizer_error
                import llguidance.hf

                try:
                    hf_tokenizer = self._load_tokenizer()
                    eos = list(dict.fromkeys(
                        [*self._eos_token_ids, *([hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None
                                                 else [])]))
                    # At least the tokenizer's size (its ids past the model's can never be sampled).
                    n_vocab = max(self.vocab_size, len(hf_tokenizer))
                    # The grammar ends with an EOS the tokenizer has (a model's EOS id past it, as with another
                    # model's tokenizer, is refused by llguidance; it still ends an unconstrained text).
                    known_eos = [t for t in eos if 0 <= t < len(hf_tokenizer)]
                    self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab,
                                                                   eos_token=known_eos or None)
                    self.grammar_eos_token_ids = frozenset(self._tokenizer.eos_tokens)
                    self.eos_token_ids = frozenset(eos) | self.grammar_eos_token_ids
                except Exception as e:
                    self._tokenizer_error = GrammarError(
                        f"structured output needs the model's tokenizer, which could not be loaded: {e}")
                    raise self._tokenizer_error from e
            return self._tokenizer

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@dataclass
class _Grammar:
    matcher: llguidance.LLMatcher
    done: bool = False  # consumed EOS (or failed): no longer constrains
    started: bool = False  # has consumed a token


class StructuredOutputs:
    """The engine core's matchers, one per live request with a grammar."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._grammars: dict[str, _Grammar] = {}
        # Tokens a matcher refused (its request then fails): a limit of llguidance's reached, or the mask did
        # not allow them (a row left with no allowed token, when allowed_token_ids or bad_words exclude every
        # token the grammar allows); counted for the tests.
        self.num_refused_tokens = 0
        self._executor: llguidance.LLExecutor | None = None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._grammars

    def __len__(self) -> int:
        return len(self._grammars)

    @property
    def num_constraining(self) -> int:
        """Requests whose grammar still constrains their next token."""
        return sum(not g.done for g in self._grammars.values())

    def constrains_any(self, req_ids: Iterable[str]) -> bool:
        """Whether a grammar still constrains the next token of one of these requests."""
        grammars = self._grammars
        return any((g := grammars.get(req_id)) is not None and not g.done for req_id in req_ids)

    def ended(self, req_id: str) -> bool:
        """Whether the request's grammar has reached its end (it allows only EOS next)."""
        g = self._grammars.get(req_id)
        if g is None or g.done:
            return False
        if g.matcher.is_stopped():
            return True
        # llguidance marks a matcher stopped on the token that leaves it no way on. Before its first token, one
        # whose language is the empty text alone is not marked, though it allows only EOS: its mask tells.
        return not g.started and g.matcher.is_accepting() and self._allows_only_eos(req_id)

    def _allows_only_eos(self, req_id: str) -> bool:
        """Whether the request's next-token mask holds no token but the grammar's EOS (computed: a state the
        matcher does not report itself)."""
        import numpy as np

        mask = np.frombuffer(self.bitmasks([req_id])[req_id], dtype=np.uint32).copy()
        for token_id in self.compiler.grammar_eos_token_ids:
            if token_id < 32 * len(mask):
                mask[token_id // 32] &= ~np.uint32(1 << (token_id % 32))
        return not mask.any()

    def add(self, req_id: str, matcher: llguidance.LLMatcher) -> None:
        self._grammars[req_id] = _Grammar(matcher)

    def release(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._grammars.pop(req_id, None)

    def bitmasks(self, req_ids: Sequence[str]) -> dict[str, bytes]:
        """The next token's mask of each request in `req_ids` that has a grammar still constraining it."""
        import llguidance
        import numpy as np

        live = [(req_id, g) for req_id in req_ids if (g := self._grammars.get(req_id)) is not None and not g.done]
        if not live:
            return {}
        row_bytes = 4 * bitmask_words(self.compiler.tokenizer().vocab_size)
        masks = np.zeros((len(live), row_bytes // 4), dtype=np.int32)
        pointer = masks.ctypes.data
        if len(live) == 1:
            live[0][1].matcher.unsafe_compute_mask_ptr(pointer, row_bytes)
        else:  # llguidance's threads, one matcher each (the GIL is released meanwhile)
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, (_, g) in enumerate(live)], pointer,
                                                   row_bytes, len(live))
        return {req_id: masks[i].tobytes() for i, (req_id, _) in enumerate(live)}

    def accept(self, req_id: str, token_ids: Sequence[int]) -> str | None:
        """Advance a request's matcher past its newly sampled tokens. Returns why when the grammar cannot take
        them: a limit of llguidance's reached while generating, or a token it does not allow (sampled where
        allowed_token_ids, bad_words or logit_bias left no token it allows). The request cannot follow its
        grammar any further, and the caller fails it: going on unconstrained gave a text outside the grammar
        that ended as if it were whole."""
        g = self._grammars.get(req_id)
        if g is None or g.done:
            return None
        eos = self.compiler.eos_token_ids
        g.started = g.started or bool(token_ids)
        for token_id in token_ids:
            if token_id in eos and (g.matcher.is_accepting() or g.matcher.is_stopped()):
                g.done = True  # the grammar's text is complete; past it (ignore_eos) nothing is constrained
                return None
            if g.matcher.is_stopped() or not g.matcher.consume_token(token_id):
                g.done = True
                self.num_refused_tokens += 1
                # (the error's first line: the rest is a dump of the matcher's state)
                error = (g.matcher.get_error() or "").strip().splitlines()[:1]
                reason = error[0] if error else f"token {token_id} is past the grammar's end"
                if "doesn't satisfy the grammar" in reason or not error:
                    reason += (" (allowed_token_ids, bad_words or logit_bias may leave no token the grammar "
                               "allows)")
                logger.warning("request %s: its grammar failed while generating: %s", req_id, reason)
                return reason
        return None

    def check_invariants(self, live: Mapping[str, Request]) -> None:
        """`live`: the scheduler's requests. A grammar is kept for live requests only, and every live request
        with a grammar has its matcher (one still compiling is not in the scheduler yet): without it the
        request would sample unconstrained."""
        assert set(self._grammars) <= set(live), \
            f"grammars kept for requests that are not live: {sorted(set(self._grammars) - set(live))}"
        unmatched = sorted(req_id for req_id, request in live.items()
                           if request.sampling_params.structured_outputs is not None and req_id not in self._grammars)
        assert not unmatched, f"requests with a grammar but no matcher: {unmatched}"
