"""Structured output in the engine: every kind of grammar gives output in its language, pipelined or step by
step (the same tokens), beside unconstrained requests (whose tokens it does not change), under preemption,
and with logprobs of the constrained distribution; a grammar that cannot be compiled is an error that leaves
nothing behind."""

from __future__ import annotations

import json
import re

import pytest

from kvserve.engine.llm import LLM
from kvserve.protocol.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[0-9]{3}-[a-z]{2}"
GRAMMAR = 'root ::= "a" ("b" | "c")+ "."'  # GBNF, as vLLM's xgrammar takes it
LARK = 'start: "x" NUM\nNUM: /[0-9]{2}/'
PROMPTS = ["Hello", "Once upon a time", "1, 2, 3,", "The weather", "q", "Name and age:"]


def _in_language(spec: StructuredOutputsParams, text: str) -> bool:
    if spec.json is not None or spec.json_object:
        value = json.loads(text)
        if spec.json_object:
            return isinstance(value, dict)
        return (isinstance(value, dict) and set(value) == {"name", "age", "tags"} and isinstance(value["name"], str)
                and len(value["name"]) <= 6 and type(value["age"]) is int
                and isinstance(value["tags"], list) and len(value["tags"]) <= 2
                and all(t in ("a", "b") for t in value["tags"]))
    if spec.choice is not None:
        return text in spec.choice
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    if spec.grammar == GRAMMAR:
        return re.fullmatch(r"a[bc]+\.", text) is not None
    return re.fullmatch(r"x[0-9]{2}", text) is not None


SPECS = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), StructuredOutputsParams(choice=CHOICES),
         StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(grammar=GRAMMAR),
         StructuredOutputsParams(grammar=LARK), StructuredOutputsParams(json_object=True, disable_any_whitespace=True)]


@pytest.fixture(scope="module")
def engines(tiny_model_dir) -> dict[bool, LLM]:
    path = tiny_model_dir("llama")
    # 1024 blocks (64 requests of max_model_len at once, far more than any test here runs): the default pool
    # for the tiny model is 131072 blocks, which the invariant checks after every step walk (0.25 s a step).
    out = {pipelined: LLM(path, max_model_len=256, num_kv_blocks=1024, async_scheduling=pipelined)
           for pipelined in (False, True)}
    for llm in out.values():
        llm.engine.core.check_invariants_every_step = True
    return out


def _run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.core
    assert core.structured.num_refused_tokens == 0
    assert len(core.structured) == 0 and not core.has_unfinished_requests()  # nothing kept after the requests
    return [o.outputs[0] for o in outs]


def test_every_kind_gives_output_in_its_language_pipelined_or_not(engines):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=spec)
              for i, spec in enumerate(SPECS)]
    runs = {p: _run(llm, PROMPTS, params) for p, llm in engines.items()}
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    finished = 0
    for spec, out in zip(SPECS, runs[False], strict=True):
        if out.finish_reason == "stop":  # by EOS, which the grammar allows only at its end
            assert _in_language(spec, out.text), (spec, out.text)
            finished += 1
        else:  # cut by max_tokens: a prefix of the language (JSON, which a random model can make long)
            assert out.finish_reason == "length" and (spec.json is not None or spec.json_object), (spec, out)
            assert out.text.startswith("{"), out.text
    assert finished >= 4


def test_greedy_grammars_leave_the_other_requests_tokens_alone(engines):
    llm = engines[True]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = _run(llm, PROMPTS[:3], [plain] * 3)
    constrained = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec) for spec in SPECS[1:4]]
    mixed = _run(llm, PROMPTS[:3] + PROMPTS[3:6], [plain] * 3 + constrained)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    for spec, out in zip(SPECS[1:4], mixed[3:], strict=True):
        assert out.finish_reason == "stop" and _in_language(spec, out.text), (spec, out.text)


def test_preempted_requests_resume_their_grammar(tiny_model_dir):
    path = tiny_model_dir("llama")
    spec = StructuredOutputsParams(regex=r"[a-z ]{300}")  # longer than max_tokens: no request ends early
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec)
    roomy = _run(LLM(path, max_model_len=48), PROMPTS[:4], [params] * 4)
    small = LLM(path, max_model_len=48, num_kv_blocks=12, block_size=4, async_scheduling=True)
    small.engine.core.check_invariants_every_step = True
    tight = _run(small, PROMPTS[:4], [params] * 4)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(o.finish_reason == "length" and re.fullmatch("[a-z ]+", o.text) for o in tight)


def test_logprobs_are_those_of_the_allowed_tokens(engines):
    llm = engines[False]
    tokenizer = llm.get_tokenizer()
    # Any token that spells the start of a choice (the grammar allows every tokenization of it).
    firsts = {t for t in range(len(tokenizer))
              if (text := tokenizer.decode([t])) and any(c.startswith(text) for c in CHOICES)}
    assert len(firsts) <= 20  # so the top 20 hold every allowed token
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = _run(llm, ["Pick one:"], [params])[0]
    assert out.text in CHOICES and out.logprobs
    first = out.logprobs[0]
    finite = {t for t, lp in first.items() if lp.logprob > float("-inf")}
    assert finite and finite <= firsts  # the top 20 hold only allowed tokens with a probability
    assert sum(2.718281828459045 ** lp.logprob for t, lp in first.items() if t in finite) == pytest.approx(1.0)


def test_past_the_grammars_end_ignore_eos_runs_unconstrained(engines):
    llm = engines[True]
    spec = StructuredOutputsParams(choice=["yes"])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, structured_outputs=spec)
    out = _run(llm, ["Say yes:"], [params])[0]
    eos = llm.get_tokenizer().eos_token_id
    yes = llm.get_tokenizer().encode("yes", add_special_tokens=False)
    assert out.token_ids[: len(yes) + 1] == [*yes, eos] and len(out.token_ids) == 10
    # min_tokens does not end it at the grammar's end either: under ignore_eos EOS is an ordinary token.
    held = _run(llm, ["Say yes:"], [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=6,
                                                   structured_outputs=spec)])[0]
    assert held.token_ids == out.token_ids


def test_a_grammar_that_fails_to_compile_is_an_error_that_leaves_nothing(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), max_model_len=128)
    core = llm.engine.core

    def broken():
        raise OSError("tokenizer files missing")

    core.structured.compiler.set_tokenizer_loader(broken)
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    constrained = SamplingParams(temperature=0.0, max_tokens=4, n=2,
                                 structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="tokenizer files missing"):
        llm.generate(PROMPTS[:3], [plain, constrained, plain], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not core.unfinished_req_ids()
    core.check_invariants()
    assert llm.generate(PROMPTS[:1], plain, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_an_aborted_request_waiting_for_its_grammar_is_dropped(tiny_model_dir):
    import threading

    llm = LLM(tiny_model_dir("llama"), max_model_len=128)
    core = llm.engine.core
    release = threading.Event()
    tokenizer = llm.get_tokenizer()

    def slow():
        release.wait(30)
        return tokenizer

    core.structured.compiler.set_tokenizer_loader(slow)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    llm.engine.add_request("r", "Hello", params)
    assert core.has_unfinished_requests() and core.unfinished_req_ids() == {"r"}
    llm.engine.step()  # the grammar is still compiling: nothing scheduled
    assert "r" not in core.scheduler.requests
    assert core.step().stats.num_waiting_reqs == 1  # queued as far as the metrics go (as vLLM counts it)
    llm.engine.abort_request("r")
    release.set()
    assert not core.has_unfinished_requests() and len(core.structured) == 0
    assert core.make_stats().num_waiting_reqs == 0
    core.check_invariants()


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_grammar_that_ends_before_min_tokens_ends_the_request(engines, pipelined):
    """min_tokens holds EOS back, the finished grammar allows only EOS: the grammar wins, the request stops
    with its text complete (not a token outside the grammar, then unconstrained text)."""
    llm = engines[pipelined]
    for spec, min_tokens in ((StructuredOutputsParams(choice=["yes"]), 6),
                             (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), 200)):
        params = SamplingParams(temperature=0.0, max_tokens=250, min_tokens=min_tokens, logprobs=1,
                                structured_outputs=spec)
        out = _run(llm, ["Say yes:"], [params])[0]
        assert out.finish_reason == "stop" and _in_language(spec, out.text), out.text
        assert len(out.token_ids) < min_tokens
        assert all(lp[t].logprob > float("-inf") for t, lp in zip(out.token_ids, out.logprobs, strict=True))


def test_a_failed_grammar_loses_no_other_output_of_the_step(tiny_model_dir):
    """LLMEngine.step raises the failure; the step's other outputs come with the next call."""
    import threading

    llm = LLM(tiny_model_dir("llama"), max_model_len=128)
    engine = llm.engine
    release = threading.Event()

    def broken():
        release.wait(30)
        raise OSError("tokenizer files missing")

    engine.core.structured.compiler.set_tokenizer_loader(broken)
    engine.add_request("s", "Hello", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")))
    engine.add_request("p", "Hello", SamplingParams(temperature=0.0, max_tokens=1))
    release.set()
    engine.core._awaiting_grammar["s"][2].exception(timeout=30)  # failed before the step: p's only step raises
    finished: dict[str, str | None] = {}
    failures = []
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except ValueError as e:
            failures.append(str(e))
            continue
        finished.update({o.request_id: o.outputs[0].finish_reason for o in outputs if o.finished})
    assert failures == ["structured output needs the model's tokenizer, which could not be loaded: tokenizer "
                        "files missing"]
    assert finished == {"p": "length"} and not engine.has_unfinished_requests()


def test_the_engine_core_stops_a_request_whose_grammar_ended_before_min_tokens(engines):
    """The request leaves the scheduler with its "stop" (it does not go on computing to max_tokens)."""
    engine = engines[True].engine
    params = SamplingParams(temperature=0.0, max_tokens=60, min_tokens=30,
                            structured_outputs=StructuredOutputsParams(choice=["yes"]))
    engine.add_request("m", "Say yes:", params)
    for _ in range(200):
        outputs = engine.step()
        if any(o.finished for o in outputs):
            break
    assert [o.outputs[0].finish_reason for o in outputs if o.finished] == ["stop"]
    assert not engine.core.scheduler.requests
    # The step launched before the stop was known is drained; its token for the request is dropped.
    assert engine.step() == [] and not engine.has_unfinished_requests()


def test_aborting_a_constrained_request_drops_its_matcher(engines):
    engine = engines[True].engine
    core = engine.core
    engine.add_request("x", "Hello", SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(
        regex="[a-z ]{100}")))
    for _ in range(50):
        engine.step()
        if "x" in core.structured and core.scheduler.requests:
            break
    engine.step()
    assert core.structured.num_constraining == 1
    engine.abort_request("x")
    assert len(core.structured) == 0 and not core.scheduler.requests
    while engine.has_unfinished_requests():  # the step in flight
        engine.step()
    core.check_invariants()


def test_requests_are_checked_on_arrival(engines):
    from kvserve.core.scheduler import RequestRejected

    engine = engines[False].engine
    core = engine.core
    spec = StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="max_model_len"):  # refused before its grammar is compiled
        engine.add_request("long", "word " * 400, SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not core.unfinished_req_ids()
    request = engine.input_processor.make_engine_request("dup", [1, 2, 3], SamplingParams(
        max_tokens=4, structured_outputs=spec), None, None, 0.0, 0)
    core.add_request(request)
    with pytest.raises(RequestRejected, match="already in use"):  # while the first still compiles, or queued
        core.add_request(request)
    core.abort_requests(["dup"])
    assert not core.unfinished_req_ids()


def test_a_grammar_that_compiles_only_without_the_tokenizer_is_an_error(engines):
    """A special token the tokenizer does not have passes validation, then fails against the tokenizer."""
    spec = StructuredOutputsParams(grammar='start: <|no_such_special|> "a"')
    with pytest.raises(ValueError, match="no_such_special"):
        engines[False].generate(["Hello"], SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert not engines[False].engine.has_unfinished_requests()


def test_choices_with_quotes_and_backslashes(engines):
    choices = ['say "hi"', "a\\b", "plain"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, structured_outputs=StructuredOutputsParams(
        choice=choices)) for i in range(6)]
    outs = _run(engines[False], PROMPTS, params)
    assert all(o.text in choices for o in outs), [o.text for o in outs]


def _watch_halves(monkeypatch) -> list[tuple[bool, bool, int, int]]:
    """Per sampled step: whether the previous step's tokens were recorded when its forward was launched and
    when its sampling was, its masks, its sampled rows."""
    from kvserve.worker.model_runner import ModelRunner

    seen: list[tuple[bool, bool, int, int]] = []
    at_launch: list[bool] = []
    launch, sample = ModelRunner.launch_forward, ModelRunner.sample

    def recorded(runner) -> bool:
        return runner._last_output is None or runner._last_output.recorded

    def launching(self, scheduler_output):
        at_launch.append(recorded(self))
        return launch(self, scheduler_output)

    def sampling(self, launched, grammar_bitmask):
        if launched.logits is not None:
            seen.append((at_launch[-1], recorded(self), len(grammar_bitmask), len(launched.sampled_req_ids)))
        return sample(self, launched, grammar_bitmask)

    monkeypatch.setattr(ModelRunner, "launch_forward", launching)
    monkeypatch.setattr(ModelRunner, "sample", sampling)
    return seen


def test_pipelined_grammar_steps_launch_the_forward_before_the_previous_tokens_are_read(engines, monkeypatch):
    """While a grammar constrains, a step's forward is launched with the previous step still in flight; its
    tokens are read before the sampling, and the masks reach the sampler of that step."""
    seen = _watch_halves(monkeypatch)
    spec = StructuredOutputsParams(regex=r"[a-z ]{300}")
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=spec)
    outs = _run(engines[True], PROMPTS[:2], [params] * 2)
    assert all(o.finish_reason == "length" and re.fullmatch("[a-z ]+", o.text) for o in outs)
    split = [(masks, rows) for launched_read, sampled_read, masks, rows in seen if not launched_read and sampled_read]
    assert len(split) >= 15 and all(masks == rows for masks, rows in split), seen
    assert all(launched_read or sampled_read for launched_read, sampled_read, _, _ in seen), seen  # none pipelined


def test_steps_that_sample_no_constrained_request_stay_pipelined(tiny_model_dir, monkeypatch):
    """A grammar request whose prompt is still prefilling in chunks needs no mask yet: the steps that decode
    the other requests meanwhile sample without waiting for the previous step's tokens."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, max_num_batched_tokens=16, num_kv_blocks=1024,
              async_scheduling=True)  # a small pool: see `engines`
    llm.engine.core.check_invariants_every_step = True
    seen = _watch_halves(monkeypatch)
    spec = StructuredOutputsParams(regex=r"[a-z ]{300}")
    outs = _run(llm, ["Hi", "word " * 40], [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                                              SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=spec)])
    assert re.fullmatch("[a-z ]+", outs[1].text)
    pipelined = [masks for launched_read, sampled_read, masks, _ in seen if not launched_read and not sampled_read]
    split = [masks for launched_read, sampled_read, masks, _ in seen if not launched_read and sampled_read]
    assert len(pipelined) >= 5 and set(pipelined) == {0}, seen  # the prompt's chunks beside the decode
    assert len(split) >= 2 and set(split) == {1}, seen


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammars_beside_output_history_pipelined_or_not(engines, temperature):
    """Penalties, min_tokens and bad words read a request's earlier tokens: in a pipelined grammar step the
    previous step's tokens are read before sampling, and are counted from the requests' lists (once), for
    constrained and unconstrained requests alike. EOS, pushed up by a logit bias, comes as soon as min_tokens
    lets it: a count off by one shows in the lengths."""
    eos = engines[False].get_tokenizer().eos_token_id
    spec = StructuredOutputsParams(regex=r"[ab ]{1,300}")
    history = [dict(frequency_penalty=1.5, presence_penalty=0.3, bad_words=["ab"]),
               dict(min_tokens=7, logit_bias={eos: 30.0}),
               dict(repetition_penalty=1.6, min_tokens=4, logit_bias={eos: 30.0})]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=24,
                             structured_outputs=spec if i < 3 else None, **extra)
              for i, extra in enumerate(history * 2)]
    runs = {p: _run(llm, PROMPTS, params) for p, llm in engines.items()}
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    assert all(re.fullmatch("[ab ]+", o.text) for o in runs[True][:3])
    assert [len(o.token_ids) for o in runs[True]][1:3] == [8, 5]  # min_tokens, then EOS


def test_every_request_whose_grammar_fails_in_a_step_is_named_in_the_error(engines):
    """Two requests whose grammars fail in the same step (b's two samples both): LLMEngine.step raises one error
    naming each request once, with its message; neither is left live, neither is dropped without a word."""
    from kvserve.engine.llm_engine import RequestsFailedError

    engine = engines[False].engine
    core = engine.core
    missing = {"a": "no_such_special", "b": "other_missing"}
    for (req_id, token), n in zip(missing.items(), (1, 2), strict=True):
        spec = StructuredOutputsParams(grammar=f'start: <|{token}|> "a"')  # fails against the tokenizer only
        engine.add_request(req_id, "Hello", SamplingParams(n=n, max_tokens=4, structured_outputs=spec))
    for req_id in ("a", "0_b", "1_b"):
        core._awaiting_grammar[req_id][2].exception(timeout=30)  # all fail before the step
    with pytest.raises(RequestsFailedError) as info:
        engine.step()
    failures = info.value.failures
    assert set(failures) == set(missing) and all(missing[r] in failures[r] for r in missing), failures
    assert all(f"request {r!r}: " in str(info.value) for r in missing), str(info.value)
    assert not engine.has_unfinished_requests() and not core.unfinished_req_ids()
    core.check_invariants()



def test_after_one_sample_fails_no_update_of_its_request_comes_out(engines, monkeypatch):
    """n=2: sample 0's grammar compiles and it samples its first token in the step where sample 1's grammar
    fails. The error aborts the request: the step's other outputs come with the next call, none for it."""
    from kvserve.structured_output import GrammarError

    engine = engines[False].engine  # step by step: a step's tokens come out with it
    core = engine.core
    compiler = core.structured.compiler
    compile_ok, calls = compiler.compile, []

    def second_fails(grammar: str):
        calls.append(grammar)
        if len(calls) == 2:
            raise GrammarError("sample 1's grammar failed")
        return compile_ok(grammar)

    monkeypatch.setattr(compiler, "compile", second_fails)
    spec = StructuredOutputsParams(regex="[a-z]{20}")
    engine.add_request("n2", "Hello", SamplingParams(n=2, max_tokens=8, structured_outputs=spec))
    core._awaiting_grammar["1_n2"][2].exception(timeout=30)  # both compiles done before the step
    with pytest.raises(ValueError, match="sample 1's grammar failed"):
        engine.step()
    later = []
    for _ in range(10):
        if not engine.has_unfinished_requests():
            break
        later.extend(engine.step())
    assert [o.request_id for o in later] == [] and not engine.has_unfinished_requests()
    core.check_invariants()



def test_without_any_eos_the_grammars_end_still_ends_the_request(tiny_model_dir):
    """A model and a tokenizer with no EOS: llguidance ends grammars with an end-of-text token of its own
    choice. Sampling it ends the request as EOS does (it does not run on unconstrained to max_tokens)."""
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.model.tokenizer import load_tokenizer

    path = tiny_model_dir("llama", eos_token_id=None)
    tokenizer = load_tokenizer(path)
    tokenizer.eos_token = None
    engine = LLMEngine(EngineArgs(model=path, max_model_len=128, num_kv_blocks=1024).create_engine_config(),
                       tokenizer)  # a small pool: see `engines`
    assert not engine.core.eos_token_ids and not engine.input_processor.eos_token_ids
    engine.core.check_invariants_every_step = True
    spec = StructuredOutputsParams(choice=["yes"])
    engine.add_request("r", "Say yes:", SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec))
    finished = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        finished.extend(o.outputs[0] for o in engine.step() if o.finished)
    [out] = finished
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert out.finish_reason == "stop" and out.text == "yes", (out.finish_reason, out.text)
    assert out.token_ids[:-1] == yes and out.token_ids[-1] in engine.core.structured.compiler.eos_token_ids
    assert engine.core.structured.num_refused_tokens == 0 and not engine.has_unfinished_requests()



@pytest.mark.parametrize("pipelined", [False, True])
def test_a_grammar_of_the_empty_text_under_min_tokens_ends_before_any_token(engines, pipelined):
    """The grammar allows only EOS from the first token on (llguidance does not mark it stopped yet), which
    min_tokens holds back: the request ends with no token, as one whose grammar ends before min_tokens does,
    instead of sampling outside the grammar and running on unconstrained. Without min_tokens it ends on EOS."""
    llm = engines[pipelined]
    spec = StructuredOutputsParams(grammar='start: ""')
    held, free = _run(llm, ["Hello", "Hello"], [SamplingParams(temperature=0.0, max_tokens=10, min_tokens=m,
                                                               structured_outputs=spec) for m in (3, 0)])
    assert (held.finish_reason, held.token_ids, held.text) == ("stop", [], "")
    assert (free.finish_reason, free.token_ids, free.text) == ("stop", [llm.get_tokenizer().eos_token_id], "")



@pytest.mark.parametrize("pipelined", [False, True])
def test_a_request_that_ends_before_any_token_still_gets_its_prompt_logprobs(engines, pipelined):
    """The empty-text grammar under min_tokens ends the request with no token; with prompt_logprobs asked (also
    what completions' echo with logprobs asks) it runs its prompt first: the same prompt logprobs as a plain
    request of that prompt, still no token, and nothing left behind."""
    llm = engines[pipelined]
    spec = StructuredOutputsParams(grammar='start: ""')
    ended, plain = llm.generate(["Once upon a time", "Once upon a time"], [
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, logprobs=2, prompt_logprobs=2,
                       structured_outputs=spec),
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)], use_tqdm=False)
    core = llm.engine.core
    assert len(core.structured) == 0 and not core.has_unfinished_requests()
    out = ended.outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == ("stop", None, [], "")
    assert ended.prompt_logprobs is not None and plain.prompt_logprobs is not None
    assert len(ended.prompt_logprobs) == len(ended.prompt_token_ids) > 1 and ended.prompt_logprobs[0] is None
    for got, want in zip(ended.prompt_logprobs[1:], plain.prompt_logprobs[1:], strict=True):
        assert got is not None and want is not None
        assert got.keys() == want.keys()
        # A prompt token deep in the tail ranks among near-equal logits, which the two rows' float rounding may
        # order apart (rank 40,008 against 40,009 was seen): ranks within 3, logprobs within 1e-4.
        for token, lp in got.items():
            assert abs(lp.rank - want[token].rank) <= 3, (token, lp.rank, want[token].rank)
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-4)


def test_the_invariant_checks_catch_a_constrained_request_without_its_matcher(engines):
    engine = engines[False].engine
    core = engine.core
    spec = StructuredOutputsParams(regex="[a-z ]{100}")
    engine.add_request("m", "Hello", SamplingParams(max_tokens=50, structured_outputs=spec))
    for _ in range(50):
        engine.step()
        if "m" in core.scheduler.requests:
            break
    core.check_invariants()
    core.structured.release(["m"])  # its matcher lost while the request runs: it would sample unconstrained
    with pytest.raises(AssertionError, match="no matcher"):
        core.check_invariants()
    engine.abort_request("m")
    core.check_invariants()



@pytest.mark.parametrize("pipelined", [False, True])
def test_min_tokens_holds_eos_at_the_grammars_end_only_below_its_count(engines, pipelined):
    """At the grammar's end with min_tokens tokens out, EOS may come: the request ends on it. One token short
    of min_tokens, EOS is held back and the grammar ends the request without it."""
    llm = engines[pipelined]
    tokenizer = llm.get_tokenizer()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    spec = StructuredOutputsParams(choice=["yes"])
    at, short = _run(llm, ["Say yes:", "Say yes:"], [SamplingParams(temperature=0.0, max_tokens=10, min_tokens=m,
                                                                    structured_outputs=spec)
                                                     for m in (len(yes), len(yes) + 1)])
    assert (at.finish_reason, at.token_ids) == ("stop", [*yes, tokenizer.eos_token_id])
    assert (short.finish_reason, short.token_ids) == ("stop", yes)



def test_a_plain_request_cannot_take_the_id_of_one_whose_grammar_compiles(engines, monkeypatch):
    """The id is in use from arrival on, also while the grammar compiles outside the scheduler."""
    import concurrent.futures

    from kvserve.core.scheduler import RequestRejected

    engine = engines[False].engine
    core = engine.core
    compiling: concurrent.futures.Future = concurrent.futures.Future()  # a compile that has not finished
    monkeypatch.setattr(core.structured.compiler, "submit", lambda grammar: compiling)
    make = engine.input_processor.make_engine_request
    spec = StructuredOutputsParams(regex="a+")
    core.add_request(make("dup", [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=spec), None, None, 0.0, 0))
    with pytest.raises(RequestRejected, match="already in use"):
        core.add_request(make("dup", [1, 2, 3], SamplingParams(max_tokens=4), None, None, 0.0, 0))
    assert "dup" not in core.scheduler.requests
    core.abort_requests(["dup"])
    assert compiling.cancelled() and not core.unfinished_req_ids()


def test_a_choice_among_thousands_stays_among_them(engines):
    """A choice list past 2,000 items broke llguidance's row limit as parser alternatives while generating,
    and the request went on unconstrained to a text that was none of them (finish_reason "stop"). The choice
    is one lexer terminal now."""
    choices = [f"item-{i:05d}" for i in range(2001)]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(choice=choices)) for seed in range(3)]
    for out in _run(engines[True], ["Pick one item."] * 3, params):
        assert out.text in choices and out.finish_reason == "stop", out.text


def test_a_grammar_that_fails_while_generating_fails_its_request_each_time(engines):
    """A regex whose automaton grows past llguidance's limit fails while generating. The request went on
    unconstrained ("aaaaa\n", "stop"); the next one with the same grammar got a spent copy of the cached
    matcher and ended at once with "" and "stop". Each now fails with the grammar's error; the engine keeps
    nothing, and other requests run on."""
    from kvserve.engine.llm_engine import RequestsFailedError

    llm = engines[False]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex="a{1000}{1000}"))
    for _ in range(2):
        with pytest.raises(RequestsFailedError, match="the structured output's grammar failed while generating: "
                                                       "lexer error: too many expressions constructed$"):
            llm.generate(["Say a"], params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests() and not llm.engine.core.unfinished_req_ids()
        assert len(llm.engine.core.structured) == 0
    plain = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert plain.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("pipelined", [False, True])
def test_constraints_that_leave_no_token_of_the_grammar_fail_the_request(engines, pipelined):
    """allowed_token_ids that exclude every token the grammar allows: the sampler must take a token outside
    it. The request went on unconstrained ("maybemaybe...", "stop"); it fails, saying what may have caused it.
    (Pipelined, the step launched before the failure was read finishes with the next call.)"""
    from kvserve.engine.llm_engine import RequestsFailedError

    llm = engines[pipelined]
    maybe = llm.get_tokenizer().encode("maybe", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=[maybe],
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(RequestsFailedError, match="doesn't satisfy the grammar.*allowed_token_ids, bad_words or "
                                                   "logit_bias may leave no token the grammar allows"):
        llm.generate(["Answer:"], params, use_tqdm=False)
    plain = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert plain.outputs[0].finish_reason == "length"
    assert not llm.engine.has_unfinished_requests() and len(llm.engine.core.structured) == 0
