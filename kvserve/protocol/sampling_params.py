"""Per-request sampling settings, validated on construction (names and meanings as in vLLM/OpenAI)."""

from __future__ import annotations

import copy
import math
import numbers
import sys
from dataclasses import dataclass, field, fields, replace

_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # the most logprobs / prompt_logprobs a request may ask for (OpenAI's top_logprobs limit)


class SamplingParamsError(ValueError):
    """An out-of-range or inconsistent sampling parameter. `param` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's `StructuredOutputsParams`); exactly one of:

    * ``json``: a JSON schema (a dict, or its JSON text);
    * ``json_object=True``: any JSON object;
    * ``regex``: a regular expression the whole output matches;
    * ``choice``: one of these strings;
    * ``grammar``: a Lark grammar, or a GBNF one (llama.cpp's, as vLLM's xgrammar takes).

    ``disable_any_whitespace`` gives JSON without optional whitespace; ``disable_additional_properties`` adds
    ``additionalProperties: false`` to every object schema that does not set it; ``whitespace_pattern`` is the
    regex of JSON's optional whitespace.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # vLLM's: there is one backend here, so nothing to fall back to

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise SamplingParamsError(message, "structured_outputs")

        if self.json_object is not None and not isinstance(self.json_object, bool):
            bad(f"json_object must be a boolean, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):  # (null too: the engine's decoder would refuse it)
                bad(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)):
                bad(f"choice must be a list of strings, got {type(self.choice).__name__}")
            self.choice = list(self.choice)
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            bad("structured output takes exactly one of json, regex, choice, grammar and json_object"
                + (f", got {', '.join(given)}" if given else ""))
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            bad("choice must be a non-empty list of non-empty strings")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            bad("whitespace_pattern must be a string")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"{name} must be a non-empty string", "structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise SamplingParamsError("json must be a JSON schema (an object or its JSON text)", "structured_outputs")

    @classmethod
    def from_dict(cls, spec: dict) -> StructuredOutputsParams:
        """From vLLM's field names (JSON); a key that is not a field is a SamplingParamsError."""
        unknown = sorted(set(spec) - {f.name for f in fields(cls)})
        if unknown:
            raise SamplingParamsError(f"unknown structured_outputs field(s): {', '.join(map(str, unknown))}",
                                      "structured_outputs")
        return cls(**spec)

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))


# The scalar fields by type, for `_normalize_scalars` (and the Triton backend, which reads strings into them).
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
              "truncate_prompt_tokens")
BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
               "spaces_between_special_tokens")
_INT64 = (-(1 << 63), (1 << 63) - 1)  # the engine's messages carry a seed as a 64-bit integer


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    * ``temperature=0`` is greedy; ``top_k=0`` or ``-1`` disables top-k; ``top_p=1`` disables top-p;
      ``min_p=0`` disables min-p.
    * Penalties follow vLLM: presence/frequency penalties apply to generated tokens (OpenAI semantics);
      ``repetition_penalty`` (1 = off) divides positive / multiplies negative logits of every token seen
      in the prompt or the output.
    * ``seed`` makes one request's samples reproducible whatever else is in the batch.
    * ``stop`` strings are cut from the output; ``stop_token_ids`` end generation (the token is not
      shown as text). EOS ends generation unless ``ignore_eos``. None of them ends a request within its
      first ``min_tokens`` tokens (stop strings count from the token after them, as in vLLM).
    * ``logprobs=k`` returns the sampled token's logprob and the top-k logprobs of each step
      (from the model's raw distribution, before temperature and penalties).
    * ``allowed_token_ids`` restricts every sampled token to those ids (applied after penalties and
      logit_bias; logprobs stay the raw distribution's).
    * ``structured_outputs`` (`StructuredOutputsParams`): the output follows a JSON schema, a regex, a choice
      or a grammar (`kvserve.structured_output`). Tokens the grammar does not allow are masked before
      everything else, so logprobs are the constrained distribution's (as vLLM's); the grammar is checked
      here, so an invalid one is a SamplingParamsError.
    * ``bad_words``: each word's token sequence is banned, i.e. its last token where the output so far ends
      with its other tokens (the prompt does not count). The sequences are the word's tokens as written and,
      where that gives as many tokens with a different first one, after a space (vLLM's rule); other
      tokenizations of the word are not banned. ``bad_words_token_ids`` holds them once resolved (given
      directly, they are used as they are).
    * ``truncate_prompt_tokens=k`` keeps the prompt's last k tokens (-1: the last max_model_len - 1).
    * ``detokenize=False`` leaves the text out (token ids only; logprobs without their decoded tokens).
    * ``prompt_logprobs=k`` returns each prompt token's logprob (the first has none) and the top-k at its
      position, from the raw distribution. Such a request takes no prefix-cache hits (every prompt position's
      logits are computed) and its prompt's steps run without CUDA graphs.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words as token sequences, filled from the tokenizer by the input processor (`resolve_bad_words`)
    bad_words_token_ids: list[list[int]] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):  # vLLM reads True as 1 (and False, an int there, as 0)
                setattr(self, name, int(getattr(self, name)))
        self._normalize_scalars()
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's (and OpenAI's) "no seed": a random sample, not a fixed seed of -1
            self.seed = None
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _normalize_scalars(self) -> None:
        """Each scalar field as the Python type it is declared with (numpy's numbers too, whose types are not
        Python's), or a SamplingParamsError naming it. A wrong type (a string, a bool for a number) passed
        here before and failed only where the engine process decoded the request, or was read as truthy."""
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise SamplingParamsError(f"{name} must be a number, got {value!r}", name)
            setattr(self, name, float(value))
        for name in INT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise SamplingParamsError(f"{name} must be an integer, got {value!r}", name)
            setattr(self, name, int(value))
        if self.seed is not None and not _INT64[0] <= self.seed <= _INT64[1]:
            raise SamplingParamsError(f"seed must be a 64-bit integer, got {self.seed}", "seed")
        numpy = sys.modules.get("numpy")  # (not imported: no value is a numpy bool)
        for name in BOOL_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))):
                raise SamplingParamsError(f"{name} must be true or false, got {value!r}", name)
            setattr(self, name, bool(value))

    def _validate(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise SamplingParamsError(msg, param)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n}", "n")
        # NaN passes every comparison below (and inf the penalty's): the sampler then returned token 0 or one
        # token over and over, silently. vLLM refuses both.
        for name in ("temperature", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)}", name)
        if self.temperature < 0.0:
            bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens}", "max_tokens")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value}", name)
        if any(not isinstance(s, str) or s == "" for s in self.stop):  # type: ignore[union-attr]
            bad("stop strings must be non-empty strings", "stop")
        for s in self.stop:  # type: ignore[union-attr]
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: no output text can hold it
                bad(f"stop string {s!r} is not valid text: {e.reason} at position {e.start}", "stop")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            bad("bad_words must be a list of words (non-empty strings)", "bad_words")
        if self.bad_words_token_ids is not None and (
            not isinstance(self.bad_words_token_ids, list)
            or any(not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids)
                   for ids in self.bad_words_token_ids)
        ):
            bad("bad_words_token_ids must be a list of non-empty lists of token ids", "bad_words")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or not (self.truncate_prompt_tokens >= 1
                                                                     or self.truncate_prompt_tokens == -1)
        ):
            bad(f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), got "
                f"{self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        if not self.detokenize and self.stop:
            bad("stop strings need the text: they cannot be used with detokenize=False", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            bad("stop_token_ids must be non-negative integers", "stop_token_ids")
        if self.structured_outputs is not None:
            self._check_structured_outputs()
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.logit_bias is not None:
            for value in self.logit_bias.values():
                if not -100.0 <= value <= 100.0:
                    bad(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")

    def _check_structured_outputs(self) -> None:
        from kvserve.structured_output import GrammarError, grammar_for

        spec = self.structured_outputs
        if isinstance(spec, dict):  # e.g. from JSON: vLLM's field names
            spec = self.structured_outputs = StructuredOutputsParams.from_dict(spec)
        if not isinstance(spec, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs must be StructuredOutputsParams", "structured_outputs")
        try:
            grammar_for(spec)
        except GrammarError as e:
            raise SamplingParamsError(str(e), "structured_outputs") from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling a token reads the tokens generated before it (penalties, min_tokens, bad words).
        Under async scheduling the newest of them may still be on the device: the model runner points the
        sampler at it (`SamplingRow.pending_row`)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.bad_words_token_ids)
        )

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's name for it)."""
        return copy.deepcopy(self)

    def for_sample(self, index: int) -> SamplingParams:
        """Parameters of sample `index` of an n>1 request: n=1, and a distinct seed when seeded. The prompt's
        logprobs are the same for every sample: only sample 0 computes them."""
        # seed + index, wrapped into the 64-bit range the engine carries (a seed near the top, valid for n=1,
        # would otherwise make its later samples' seeds, and so the whole request, invalid)
        seed = None if self.seed is None else (self.seed + index - _INT64[0]) % (1 << 64) + _INT64[0]
        sample = replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)
        sample.seed = seed  # seed + index may be -1, which __post_init__ (run again by replace) reads as no seed
        return sample
