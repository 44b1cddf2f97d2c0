"""Structured output's pieces: the spec's validation, the grammar of each kind, the mask applied to the logits
(against a hand-built mask), the sampler under a mask, and the engine core's matchers against a tokenizer."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from kvserve.layers.sampler import Sampler, SamplingRow, apply_grammar_masks_
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.protocol.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from kvserve.structured_output import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputs,
    _no_additional_properties,
    bitmask_words,
    grammar_for,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


# ------------------------------------------------------------------------------------------ the spec


@pytest.mark.parametrize("fields", [{}, {"json": SCHEMA, "regex": "a+"}, {"choice": ["a"], "json_object": True}])
def test_exactly_one_kind(fields):
    with pytest.raises(SamplingParamsError, match="exactly one") as info:
        StructuredOutputsParams(**fields)
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("fields", [{"choice": []}, {"choice": ["a", ""]}, {"choice": ["a", 3]}, {"regex": ""},
                                    {"grammar": 5}, {"json": 3}])
def test_malformed_kinds_are_refused(fields):
    with pytest.raises(SamplingParamsError):
        StructuredOutputsParams(**fields)


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(regex="[a-"),
    StructuredOutputsParams(json="{not json"),
    StructuredOutputsParams(json='["a list"]'),
    StructuredOutputsParams(json={"type": "nonsense"}),
    StructuredOutputsParams(grammar="start: undefined_rule"),
    StructuredOutputsParams(grammar='root ::= "a" ('),
    StructuredOutputsParams(json="[" * 100_000),
    StructuredOutputsParams(json="true"),  # a schema that is not an object
])
def test_invalid_grammars_are_a_sampling_params_error(spec):
    with pytest.raises(GrammarError):
        grammar_for(spec)
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs=spec)
    assert info.value.param == "structured_outputs" and f"invalid {spec.kind}" in str(info.value)


@pytest.mark.parametrize(("fields", "words"), [
    ({"choice": "yes"}, "choice must be a list"),
    ({"choice": 5}, "choice must be a list"),
    ({"regex": "a", "disable_any_whitespace": "false"}, "disable_any_whitespace must be a boolean"),
    ({"json_object": 1}, "json_object must be a boolean"),
    ({"regex": "a", "whitespace_pattern": 3}, "whitespace_pattern must be a string"),
])
def test_field_types_are_checked(fields, words):
    with pytest.raises(SamplingParamsError, match=words):
        StructuredOutputsParams(**fields)


def test_a_spec_of_another_type_is_refused():
    with pytest.raises(SamplingParamsError, match="must be StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")  # type: ignore[arg-type]


def test_a_dict_spec_becomes_params_and_unknown_keys_are_refused():
    params = SamplingParams(structured_outputs={"regex": "a+"})  # type: ignore[arg-type]
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(SamplingParamsError, match="unknown structured_outputs field"):
        SamplingParams(structured_outputs={"regex": "a+", "backend": "x"})  # type: ignore[arg-type]


def test_the_spec_crosses_into_the_engine_core():
    """msgspec carries it, schema dict and all, as it carries the rest of SamplingParams."""
    for spec in (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                 StructuredOutputsParams(choice=["yes", "no"])):
        request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=spec), 8)
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
        assert decoded.sampling_params.structured_outputs == spec


def test_no_additional_properties_reaches_nested_objects_and_keeps_explicit_ones():
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {}}},
                                               "free": {"type": "object", "additionalProperties": True}},
              "items": [{"properties": {"y": {}}}]}
    out = _no_additional_properties(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["inner"]["additionalProperties"] is False
    assert out["properties"]["free"]["additionalProperties"] is True
    assert out["items"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    # Data is left alone: const, enum and default values, and a properties map itself (whose names are not
    # schema keywords, here one called "properties").
    nested = {"anyOf": [{"type": "object", "properties": {"x": {}}}],
              "additionalProperties": {"type": "object", "properties": {"y": {}}}}
    out = _no_additional_properties(nested)
    assert out["anyOf"][0]["additionalProperties"] is False
    assert out["additionalProperties"]["additionalProperties"] is False
    data = {"type": "object", "properties": {"properties": {"type": "string"}},
            "anyOf": [{"const": {"properties": {}}}, {"enum": [{"type": "object"}]}],
            "$defs": {"d": {"properties": {"z": {}}}}, "default": {"properties": {}}}
    out = _no_additional_properties(data)
    assert set(out["properties"]) == {"properties"} and "additionalProperties" not in out["properties"]["properties"]
    assert out["anyOf"] == data["anyOf"] and out["default"] == data["default"]
    assert out["$defs"]["d"]["additionalProperties"] is False


def test_the_grammar_is_kept_on_the_spec_and_not_carried():
    spec = StructuredOutputsParams(regex="a+")
    assert grammar_for(spec) is grammar_for(spec)
    params = SamplingParams(n=3, structured_outputs=spec)
    assert params.for_sample(2).structured_outputs is spec  # the samples share it: validated once
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineCoreRequest("r", [1], params, 4)),
                                     type=EngineCoreRequest)
    assert decoded.sampling_params.structured_outputs == spec and "_grammar" not in msgspec.to_builtins(
        decoded.sampling_params.structured_outputs)


# ------------------------------------------------------------------------------------------ the mask


def _bits(allowed: list[set[int]], vocab_size: int) -> list[bytes]:
    """Hand-built masks: bit t of word t // 32 set for each allowed token."""
    words = bitmask_words(vocab_size)
    out = []
    for tokens in allowed:
        row = [0] * words
        for t in tokens:
            row[t // 32] |= 1 << (t % 32)
        out.append(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in row], dtype=torch.int32)
                   .numpy().tobytes())
    return out


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                    reason="no GPU")])]


@pytest.mark.parametrize("device", DEVICES)
def test_masks_set_minus_inf_outside_the_allowed_tokens(device):
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(4, vocab, device=device)
    out = logits.clone()
    allowed = [{0, 7, 8, 31, 32, 63, 69}, set(range(vocab)), {5}]  # bit 31 is the int32's sign bit
    apply_grammar_masks_(out, [2, 0, 3], _bits(allowed, vocab))
    for row, tokens in zip([2, 0, 3], allowed, strict=True):
        expected = torch.full((vocab,), float("-inf"), device=device)
        expected[sorted(tokens)] = logits[row, sorted(tokens)]
        assert torch.equal(out[row], expected)
    assert torch.equal(out[1], logits[1])  # rows without a mask are untouched


def test_tokens_past_the_mask_are_not_allowed():
    logits = torch.zeros(1, 40)
    apply_grammar_masks_(logits, [0], _bits([{1, 31}], 32))  # one word for 40 logits
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 31]


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_under_a_mask_picks_allowed_tokens_and_reports_constrained_logprobs(device):
    vocab = 64
    torch.manual_seed(0)
    logits = torch.randn(3, vocab, device=device)
    allowed = [{3, 40, 41}, {7}, {10, 50}]
    masks = _bits(allowed, vocab)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.5, seed=3)]
    sampler = Sampler()
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(200):
        rows = [SamplingRow(p, [1], [], None, grammar_mask=m) for p, m in zip(params, masks, strict=True)]
        out = sampler(logits.clone(), rows, eos_token_ids=[0])
        for i, t in enumerate(out.sampled_token_ids.tolist()):
            seen[i].add(t)
    assert seen[0] == {max(allowed[0], key=lambda t: logits[0, t].item())}  # greedy: the best allowed one
    assert seen[1] == {7} and seen[2] == allowed[2]
    assert out.logprobs is not None and out.logprob_token_ids is not None
    constrained = torch.log_softmax(logits[0, sorted(allowed[0])].cpu(), dim=0)
    top = out.logprobs[0, 1:4].tolist()
    assert top == pytest.approx(sorted(constrained.tolist(), reverse=True), abs=1e-6)
    assert set(out.logprob_token_ids[0, 1:4].tolist()) == allowed[0]
    assert all(math.isinf(v) for v in out.logprobs[0, 4:].tolist())  # the rest of the top 5: not allowed


# ------------------------------------------------------------------------------------------ the matchers


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def _allowed(masks: dict[str, bytes], req_id: str) -> set[int]:
    words = torch.frombuffer(bytearray(masks[req_id]), dtype=torch.int32)
    bits = ((words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return set(bits.nonzero().flatten().tolist())


def test_matchers_follow_the_grammar_to_eos(tokenizer):
    vocab = len(tokenizer) + 7  # the model's vocabulary may be larger than the tokenizer's
    eos = tokenizer.eos_token_id
    compiler = GrammarCompiler(lambda: tokenizer, vocab, [eos])
    outputs = StructuredOutputs(compiler)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outputs.add("a", compiler.compile(grammar_for(spec)))
    outputs.add("b", compiler.submit(grammar_for(StructuredOutputsParams(choice=["yes", "no"]))).result(timeout=60))
    text = json.dumps({"name": "Bob", "age": 42}, separators=(",", ":"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token in enumerate(ids):
        masks = outputs.bitmasks(["a", "b", "c"])  # "c": no grammar
        assert set(masks) == {"a", "b"} and len(masks["a"]) == 4 * bitmask_words(vocab)
        allowed = _allowed(masks, "a")
        assert token in allowed and eos not in allowed, i
        assert max(allowed) < len(tokenizer)  # ids past the tokenizer are never allowed
        outputs.accept("a", [token])
    assert _allowed(outputs.bitmasks(["a"]), "a") == {eos}  # the object is complete: EOS only
    outputs.accept("a", [eos])
    assert outputs.bitmasks(["a"]) == {}  # past the end (ignore_eos): unconstrained
    outputs.accept("a", [5, 6])  # and never refuses
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert yes[0] in _allowed(outputs.bitmasks(["b"]), "b")
    # Not allowed: refused, with the reason the caller fails the request with; the matcher constrains no more.
    error = outputs.accept("b", [tokenizer.encode("}", add_special_tokens=False)[0]])
    assert error is not None and "doesn't satisfy the grammar" in error and "allowed_token_ids" in error, error
    assert outputs.num_refused_tokens == 1 and outputs.bitmasks(["b"]) == {}
    outputs.release(["a", "b"])
    assert len(outputs) == 0
    outputs.check_invariants({})
    compiler.shutdown()


def test_a_model_eos_id_past_the_tokenizer_is_left_out_of_the_grammar(tokenizer):
    """A model whose EOS id the tokenizer lacks (another model's tokenizer): grammars still compile, and end
    with the EOS the tokenizer has."""
    eos, foreign = tokenizer.eos_token_id, len(tokenizer) + 3
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer) + 10, [foreign, eos])
    outputs = StructuredOutputs(compiler)
    outputs.add("r", compiler.compile(grammar_for(StructuredOutputsParams(choice=["yes"]))))
    outputs.accept("r", tokenizer.encode("yes", add_special_tokens=False))
    assert _allowed(outputs.bitmasks(["r"]), "r") == {eos}
    assert compiler.eos_token_ids == {eos, foreign}
    outputs.accept("r", [eos])
    assert outputs.num_constraining == 0 and outputs.num_refused_tokens == 0
    compiler.shutdown()


def test_a_tokenizer_that_fails_to_load_is_a_grammar_error_once():
    calls = []

    def broken():
        calls.append(1)
        raise OSError("no tokenizer.json here")

    compiler = GrammarCompiler(broken, 100, [2])
    for _ in range(2):
        future = compiler.submit(grammar_for(StructuredOutputsParams(regex="a+")))
        with pytest.raises(GrammarError, match="tokenizer.*no tokenizer.json here"):
            future.result(timeout=60)
    assert len(calls) == 1  # not loaded again for every request
    compiler.shutdown()


def test_eos_where_the_grammar_may_end_ends_its_constraint(tokenizer):
    """Under ignore_eos, EOS taken where the text could go on (regex a+ after "a") ends the constraint: the
    next token is not forced to be another EOS."""
    eos = tokenizer.eos_token_id
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), [eos])
    outputs = StructuredOutputs(compiler)
    outputs.add("r", compiler.compile(grammar_for(StructuredOutputsParams(regex="a+"))))
    a = tokenizer.encode("a", add_special_tokens=False)
    outputs.accept("r", a)
    allowed = _allowed(outputs.bitmasks(["r"]), "r")
    assert eos in allowed and a[0] in allowed and not outputs.ended("r")
    outputs.accept("r", [eos])
    assert outputs.bitmasks(["r"]) == {} and outputs.num_refused_tokens == 0 and outputs.num_constraining == 0


def test_many_masks_at_once_equal_one_at_a_time_and_compiles_are_fresh_copies(tokenizer):
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    together, alone = StructuredOutputs(compiler), StructuredOutputs(compiler)
    grammars = [grammar_for(StructuredOutputsParams(json=SCHEMA)), grammar_for(StructuredOutputsParams(regex="[0-9]+x")),
                grammar_for(StructuredOutputsParams(choice=["alpha", "beta"]))]
    prefixes = ['{"name": "A', "12", "al"]
    for i, (grammar, prefix) in enumerate(zip(grammars, prefixes, strict=True)):
        for outputs in (together, alone):
            outputs.add(str(i), compiler.compile(grammar))  # the second compile: a copy of the first's
            outputs.accept(str(i), tokenizer.encode(prefix, add_special_tokens=False))
    masks = together.bitmasks(["0", "1", "2"])
    for i in range(3):
        assert masks[str(i)] == alone.bitmasks([str(i)])[str(i)]
    fresh = StructuredOutputs(compiler)
    fresh.add("f", compiler.compile(grammars[2]))  # unaffected by the copies' progress
    assert tokenizer.encode("beta", add_special_tokens=False)[0] in _allowed(fresh.bitmasks(["f"]), "f")
    compiler.shutdown()


def test_a_model_vocabulary_smaller_than_the_tokenizer(tokenizer):
    """Masks are as wide as the tokenizer (the logits use their own width; ids past it are never allowed)."""
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer) - 40, [tokenizer.eos_token_id])
    outputs = StructuredOutputs(compiler)
    outputs.add("r", compiler.compile(grammar_for(StructuredOutputsParams(regex="[a-z]+"))))
    assert len(outputs.bitmasks(["r"])["r"]) == 4 * bitmask_words(len(tokenizer))
    logits = torch.zeros(1, len(tokenizer) - 40)
    apply_grammar_masks_(logits, [0], [outputs.bitmasks(["r"])["r"]])
    assert torch.isfinite(logits).any()


def _first_allowed(tokenizer, spec: StructuredOutputsParams, prefix: str) -> set[int]:
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    outputs = StructuredOutputs(compiler)
    outputs.add("r", compiler.compile(grammar_for(spec)))
    outputs.accept("r", tokenizer.encode(prefix, add_special_tokens=False) if prefix else [])
    assert outputs.num_refused_tokens == 0
    return _allowed(outputs.bitmasks(["r"]), "r")


def _token(tokenizer, text: str) -> int:
    [token] = tokenizer.encode(text, add_special_tokens=False)
    return token


def test_the_json_options_change_what_the_grammar_allows(tokenizer):
    space, newline, comma = _token(tokenizer, " "), _token(tokenizer, "\n"), _token(tokenizer, ",")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    flexible = _first_allowed(tokenizer, StructuredOutputsParams(json=schema), "{")
    assert space in flexible and newline in flexible
    newlines_only = _first_allowed(tokenizer, StructuredOutputsParams(json=schema, whitespace_pattern="\n"), "{")
    assert newline in newlines_only and space not in newlines_only
    compact = dict(json=schema, disable_any_whitespace=True)
    assert comma in _first_allowed(tokenizer, StructuredOutputsParams(**compact), '{"a":1')  # more keys may come
    closed = _first_allowed(tokenizer, StructuredOutputsParams(**compact, disable_additional_properties=True), '{"a":1')
    assert comma not in closed  # "a" is the only property


def test_json_object_allows_only_an_object(tokenizer):
    first = _first_allowed(tokenizer, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), "")
    assert _token(tokenizer, "{") in first
    assert not first & {_token(tokenizer, t) for t in ("[", '"', "1", "t", "n")}


def test_a_grammar_of_the_empty_text_has_ended_before_its_first_token(tokenizer):
    """llguidance does not mark such a matcher stopped until a token, but it allows only EOS: ended() says so
    (the engine core then applies min_tokens' rule at admission). A grammar that also allows more text, or
    that needs some, has not ended."""
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    outputs = StructuredOutputs(compiler)
    for req_id, spec in (("empty", StructuredOutputsParams(grammar='start: ""')),
                         ("maybe", StructuredOutputsParams(regex="a*")), ("some", StructuredOutputsParams(regex="a+"))):
        outputs.add(req_id, compiler.compile(grammar_for(spec)))
    assert _allowed(outputs.bitmasks(["empty"]), "empty") == {tokenizer.eos_token_id}
    assert [outputs.ended(r) for r in ("empty", "maybe", "some")] == [True, False, False]
    outputs.accept("maybe", tokenizer.encode("a", add_special_tokens=False))
    assert not outputs.ended("maybe")
    compiler.shutdown()
