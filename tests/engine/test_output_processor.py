"""OutputProcessor: deltas, n>1 groups, stop strings (driven with hand-made engine outputs)."""

from __future__ import annotations

import dataclasses

from kvserve.core.outputs import EngineCoreOutput
from kvserve.engine.output_processor import OutputProcessor, child_request_id
from kvserve.protocol.outputs import CompletionOutput, Logprob
from kvserve.protocol.sampling_params import SamplingParams


def test_n_samples_deltas_do_not_repeat(smollm_tokenizer) -> None:
    proc = OutputProcessor(smollm_tokenizer)
    ids = smollm_tokenizer("Hello world, how are you", add_special_tokens=False)["input_ids"]
    children = proc.add_request("r", "p", [1, 2, 3], SamplingParams(n=2, max_tokens=8))
    c0, c1 = (cid for cid, _ in children)
    assert (c0, c1) == (child_request_id("r", 0, 2), child_request_id("r", 1, 2))

    outs, _ = proc.process_outputs([EngineCoreOutput(c0, [ids[0]]), EngineCoreOutput(c1, [ids[1]])])
    first = outs[0].outputs
    assert [o.token_ids_delta for o in first] == [[ids[0]], [ids[1]]]
    assert all(o.text_delta for o in first)

    # Only sample 0 produces a token: sample 1's delta must be empty, not a repeat of the last one.
    outs, _ = proc.process_outputs([EngineCoreOutput(c0, [ids[2]])])
    second = outs[0].outputs
    assert second[0].token_ids_delta == [ids[2]]
    assert second[1].token_ids_delta == [] and second[1].text_delta == ""
    # The earlier snapshot is unchanged by later steps.
    assert first[1].token_ids_delta == [ids[1]]

    outs, _ = proc.process_outputs(
        [EngineCoreOutput(c0, [ids[3]], finish_reason="length"), EngineCoreOutput(c1, [ids[4]], finish_reason="length")]
    )
    final = outs[0]
    assert final.finished
    assert final.outputs[0].token_ids == [ids[0], ids[2], ids[3]]
    assert final.outputs[1].token_ids == [ids[1], ids[4]]
    assert final.outputs[0].text == smollm_tokenizer.decode([ids[0], ids[2], ids[3]])
    assert not proc.has_unfinished()


def test_stop_string_ends_request_and_asks_for_abort(smollm_tokenizer) -> None:
    proc = OutputProcessor(smollm_tokenizer)
    ids = smollm_tokenizer(" one two three four", add_special_tokens=False)["input_ids"]
    proc.add_request("s", None, [5, 6], SamplingParams(stop=[" three"], max_tokens=20))
    streamed = ""
    aborted: list[str] = []
    for token_id in ids:
        outs, to_abort = proc.process_outputs([EngineCoreOutput("s", [token_id])])
        aborted += to_abort
        if not outs:
            break
        streamed += outs[0].outputs[0].text_delta
        if outs[0].finished:
            break
    assert aborted == ["s"]
    assert streamed == " one two"
    assert not proc.has_unfinished()


def test_completion_output_copy_carries_every_field() -> None:
    """`copy()` lists the fields by hand (for speed): a field added later must be added there too."""
    values = {"index": 3, "text": "abc", "token_ids": [1, 2], "cumulative_logprob": -1.5,
              "logprobs": [{1: Logprob(-0.5, 1)}], "finish_reason": "stop", "stop_reason": "END",
              "text_delta": "c", "token_ids_delta": [2]}
    assert {f.name for f in dataclasses.fields(CompletionOutput)} == set(values)
    original = CompletionOutput(**values)
    copied = original.copy()
    assert copied is not original and copied == original == dataclasses.replace(original)
    copied.text_delta = ""
    assert original.text_delta == "c"
