"""The Triton Inference Server Python-backend model and `kvserve triton-repo`.

Triton itself is not installable here (it ships as a container), so the model runs under a stand-in for
`triton_python_backend_utils` with the calls the Python backend provides (tensors, responses, errors,
response senders, the decoupled-policy check). The engine behind it is real: a tiny model on the CPU, whose
text is compared with the offline `LLM`'s.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from kvserve.integrations.triton.repo import config_pbtxt, write_repository

from .conftest import REPO_ROOT, wait_for

FINAL = 1


class Tensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self._name, self._value = name, value

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value


class TritonError:
    CANCELLED = 6  # one of the codes Tritons since 23.10 give TritonError

    def __init__(self, message: str, code: int | None = None) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int | None:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor], error: TritonError | None = None) -> None:
        self._outputs, self._error = output_tensors, error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def text(self) -> str:
        (tensor,) = self._outputs
        assert tensor.name() == "text_output"
        return b"".join(tensor.as_numpy().tolist()).decode()

    def texts(self) -> list[str]:
        (tensor,) = self._outputs
        return [t.decode() for t in tensor.as_numpy().tolist()]

    def outputs(self) -> dict[str, np.ndarray]:
        return {t.name(): t.as_numpy() for t in self._outputs}


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.done = threading.Event()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        assert not self.done.is_set(), "a response after the final flag"
        self.sent.append((response, flags))
        if flags & FINAL:
            self.done.set()


class Request:
    def __init__(self, parameters: dict[str, Any] | None = None, **inputs: Any) -> None:
        # With max_batch_size > 0 each input has a batch dimension: [1, 1].
        self._inputs = {k: Tensor(k, np.array([[v.encode() if isinstance(v, str) else v]],
                                              dtype=np.object_ if isinstance(v, str) else np.bool_))
                        for k, v in inputs.items()}
        self._parameters = json.dumps(parameters or {})
        self.sender = Sender()
        self.cancelled = False

    def parameters(self) -> str:  # Triton's: the request's parameters as a JSON object's text ("{}": none)
        return self._parameters

    def inputs(self) -> list[Tensor]:
        return list(self._inputs.values())

    def get_response_sender(self) -> Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.cancelled


def _stand_in() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor = Tensor  # type: ignore[attr-defined]
    pb.TritonError = TritonError  # type: ignore[attr-defined]
    pb.InferenceResponse = InferenceResponse  # type: ignore[attr-defined]
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL  # type: ignore[attr-defined]
    pb.get_input_tensor_by_name = lambda request, name: request._inputs.get(name)  # type: ignore[attr-defined]
    pb.using_decoupled_model_transaction_policy = (  # type: ignore[attr-defined]
        lambda config: bool(config.get("model_transaction_policy", {}).get("decoupled", False)))
    return pb


@pytest.fixture
def triton_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                 tiny_model_dir: Callable[..., str]) -> Iterator[Callable[..., Any]]:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stand_in())
    from kvserve.integrations.triton.model import TritonPythonModel

    started: list[Any] = []

    def start(decoupled: bool, **engine_args: Any) -> Any:
        out = tmp_path / ("dec" if decoupled else "plain")
        args = {"model": tiny_model_dir("llama"), "device": "cpu", "max_model_len": 256, "kv_cache_memory": "64MiB",
                **engine_args}
        model_dir = write_repository(str(out), "tiny", args, max_batch_size=8, decoupled=decoupled, device="cpu")
        model = TritonPythonModel()
        config = {"name": "tiny", "max_batch_size": 8, "model_transaction_policy": {"decoupled": decoupled}}
        model.initialize({"model_config": json.dumps(config), "model_repository": model_dir,
                          "model_version": "1", "model_instance_kind": "CPU"})
        started.append(model)
        return model

    yield start
    for model in started:
        model.finalize()


def _reference(path: str, prompt: str, max_tokens: int) -> str:
    llm = LLM(path, max_model_len=256, kv_cache_memory="64MiB")
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0].text


def test_decoupled_streams_the_engines_text(triton_model: Callable[[bool], Any],
                                            tiny_model_dir: Callable[..., str]) -> None:
    model = triton_model(True)
    params = json.dumps({"temperature": 0, "max_tokens": 12})
    streamed = Request(text_input="Hello, my name is", stream=True, sampling_parameters=params)
    whole = Request(text_input="Hello, my name is", sampling_parameters=params)
    assert model.execute([streamed, whole]) is None  # decoupled: responses go through the senders
    assert streamed.sender.done.wait(60) and whole.sender.done.wait(60)
    expected = _reference(tiny_model_dir("llama"), "Hello, my name is", 12)
    pieces = [r.text() for r, _ in streamed.sender.sent if r is not None]
    assert len(pieces) > 1 and "".join(pieces) == expected
    assert [flags for _, flags in streamed.sender.sent] == [0] * len(pieces) + [FINAL]
    ((response, flags),) = whole.sender.sent
    assert flags == FINAL and response is not None and response.text() == "Hello, my name is" + expected


class CancelledAfter(Request):
    """A request its client cancels once the model has asked `checks` times."""

    def __init__(self, checks: int, **inputs: Any) -> None:
        super().__init__(**inputs)
        self.checks = checks

    def is_cancelled(self) -> bool:
        self.checks -= 1
        return self.checks < 0


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_cancelled_request_is_aborted_and_ends_with_a_cancelled_error(triton_model: Callable[[bool], Any],
                                                                         decoupled: bool) -> None:
    """A request cancelled by its client mid-way is aborted in the engine, and its final response is an error
    with Triton's CANCELLED code, as vLLM's backend answers it; it was an empty response (decoupled) or the text
    so far, both read as a success."""
    model = triton_model(decoupled)
    params = json.dumps({"temperature": 0, "max_tokens": 60, "ignore_eos": True})
    request = CancelledAfter(3, text_input="Hello, my name is", stream=decoupled, sampling_parameters=params)
    responses = model.execute([request])
    if decoupled:
        assert responses is None and request.sender.done.wait(60)
        *pieces, (final, flags) = request.sender.sent
        assert flags == FINAL and all(r is not None and not r.has_error() for r, _ in pieces)
    else:
        (final,) = responses
    assert final is not None and final.has_error()
    assert final.error().code() == TritonError.CANCELLED and "cancelled" in final.error().message()
    wait_for(lambda: model.engine.num_unfinished_requests == 0, 10, "the engine to drop the request")


def test_one_response_per_request_and_errors_stay_with_their_request(triton_model: Callable[[bool], Any],
                                                                     tiny_model_dir: Callable[..., str]) -> None:
    model = triton_model(False)
    good = Request(text_input="The capital of France",
                   sampling_parameters=json.dumps({"temperature": 0, "max_tokens": 8}), exclude_input_in_output=True)
    requests = [
        good,
        Request(text_input="x", stream=True),
        Request(text_input="x", sampling_parameters="{not json"),
        Request(text_input="x", sampling_parameters=json.dumps({"temperature": -1})),
        Request(sampling_parameters="{}"),
        Request(text_input="word " * 400),  # longer than max_model_len
        Request(text_input="x", sampling_parameters=json.dumps({"logit_bias": [1, 2]})),  # not a mapping
        Request(text_input="x"),  # a client's batch of two prompts in one request (max_batch_size > 0): [2, 1]
        Request(text_input="x", sampling_parameters=json.dumps({"stop": 5})),
        Request(text_input="x", sampling_parameters=json.dumps({"stop_token_ids": 7})),
    ]
    requests[7]._inputs["text_input"] = Tensor("text_input", np.array([[b"one"], [b"two"]], dtype=np.object_))
    responses = model.execute(requests)
    assert len(responses) == len(requests)
    assert not responses[0].has_error()
    assert responses[0].text() == _reference(tiny_model_dir("llama"), "The capital of France", 8)
    errors = [r.error().message() for r in responses[1:]]
    assert "decoupled" in errors[0]
    assert "not JSON" in errors[1]
    assert "temperature" in errors[2]
    assert "text_input is required" in errors[3]
    assert "max_model_len" in errors[4] or "too long" in errors[4], errors[4]
    assert errors[5].startswith("sampling_parameters: "), errors[5]  # an AttributeError escaped execute
    # It answered the first prompt alone, one text where the client waits for two
    assert "text_input holds 2 elements (shape [2, 1]): one prompt a request" in errors[6], errors[6]
    # SamplingParams' "TypeError: 'int' object is not iterable" named no field
    assert errors[7] == "sampling_parameters: stop must be a string or a list of strings, got 5", errors[7]
    assert errors[8] == "sampling_parameters: stop_token_ids must be a list of token ids, got 7", errors[8]


@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "plain"])
def test_a_failure_while_generating_is_that_requests_error(triton_model: Callable[[bool], Any], decoupled: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An error other than a refusal while a request generates (the engine gone, a failed step) ends that
    request with an error response: it escaped before, failing the whole batch, or (decoupled) never sent the
    final response, leaving the client waiting."""
    model = triton_model(decoupled)
    real = model.engine.generate

    def generate(request_id: str, ids: list[int], params: Any, **kwargs: Any) -> Any:
        if kwargs.get("prompt") != "boom":
            return real(request_id, ids, params, **kwargs)

        async def failing() -> Any:
            raise RuntimeError("engine core died")
            yield  # an async generator

        return failing()

    monkeypatch.setattr(model.engine, "generate", generate)
    bad = Request(text_input="boom", sampling_parameters=json.dumps({"max_tokens": 2}))
    good = Request(text_input="fine", sampling_parameters=json.dumps({"temperature": 0, "max_tokens": 2}))
    responses = model.execute([bad, good])
    if decoupled:
        assert bad.sender.done.wait(60) and good.sender.done.wait(60)
        ((response, flags),) = bad.sender.sent
        assert flags == FINAL and response.error().message() == "RuntimeError: engine core died"
        assert not good.sender.sent[-1][0].has_error()
    else:
        assert responses[0].error().message() == "RuntimeError: engine core died"
        assert not responses[1].has_error()


def test_requests_take_the_models_generation_config(triton_model: Callable[..., Any],
                                                   tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    """What a request's sampling_parameters leave out comes from the model's generation config (here top_k 1,
    greedy whatever the temperature, and 5 tokens); what they give wins, except that a --generation-config
    directory's max_new_tokens also caps the length (vLLM's rule: 9 asked, 5 given; 3 asked, 3)."""
    settings = tmp_path / "generation"
    settings.mkdir()
    (settings / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 1.3,
                                                                "max_new_tokens": 5}))
    model = triton_model(False, generation_config=str(settings))
    prompt = "The capital of France"
    left_out, given = Request(text_input=prompt, exclude_input_in_output=True), Request(
        text_input=prompt, exclude_input_in_output=True, sampling_parameters=json.dumps({"max_tokens": 9}))
    null = Request(text_input=prompt, exclude_input_in_output=True,  # null is left out, as on the server
                   sampling_parameters=json.dumps({"max_tokens": None, "temperature": None, "top_k": None}))
    shorter = Request(text_input=prompt, exclude_input_in_output=True,
                      sampling_parameters=json.dumps({"max_tokens": 3}))
    too_few = Request(text_input=prompt, exclude_input_in_output=True,
                      sampling_parameters=json.dumps({"max_tokens": 9, "min_tokens": 7}))
    responses = model.execute([left_out, given, null, shorter, too_few])
    expected = [_reference(tiny_model_dir("llama"), prompt, n) for n in (5, 3)]
    assert expected[0] != expected[1]  # no end of sequence within 5 tokens: the lengths show
    assert [r.text() for r in responses[:4]] == [expected[0], expected[0], expected[0], expected[1]]
    assert "min_tokens" in responses[4].error().message() and "capped at 5" in responses[4].error().message()


def test_vllms_model_json_is_read(triton_model: Callable[..., Any], tiny_model_dir: Callable[..., str],
                                  tmp_path: Path) -> None:
    """A vLLM repository's 1/model.json (its engine arguments, with vLLM's own such as disable_log_requests)
    starts the engine when there is no kvserve.json: it was never read (the model failed to load, no
    kvserve.json), and those arguments in kvserve.json failed with EngineArgs' bare TypeError. An argument
    kvserve does not take is named, with the file; kvserve.json wins over model.json."""
    from kvserve.integrations.triton.model import TritonPythonModel

    version = tmp_path / "vllm_model" / "1"
    version.mkdir(parents=True)
    vllm_args = {"model": tiny_model_dir("llama"), "disable_log_requests": True, "gpu_memory_utilization": 0.5,
                 "enforce_eager": True, "max_model_len": 128, "trust_remote_code": True, "device": "cpu",
                 "kv_cache_memory": "64MiB"}
    (version / "model.json").write_text(json.dumps(vllm_args))
    model = TritonPythonModel()
    model.initialize({"model_config": json.dumps({"name": "vllm_model"}), "model_repository": str(version.parent),
                      "model_version": "1", "model_instance_kind": "CPU"})
    try:
        assert model.engine.config.model_config.max_model_len == 128
        (response,) = model.execute([Request(text_input="Hi", sampling_parameters=json.dumps({"max_tokens": 2}))])
        assert not response.has_error()
    finally:
        model.finalize()
    from kvserve.integrations.triton.model import read_engine_args

    (version / "model.json").write_text(json.dumps({**vllm_args, "enable_lora": True}))
    with pytest.raises(ValueError, match=re.escape("model.json: kvserve does not take the engine argument "
                                                   "enable_lora=True")):
        read_engine_args(str(version))
    (version / "kvserve.json").write_text(json.dumps({"model": "m", "max_model_len": 64}))
    assert read_engine_args(str(version)) == {"model": "m", "max_model_len": 64}


def test_finalize_lets_requests_in_flight_finish(triton_model: Callable[..., Any],
                                                 tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    """finalize() while a decoupled request still streams: the request finishes and gets its final response
    before the engine shuts down, as vLLM's backend waits for its ongoing requests. The engine was shut down
    under it: the stream stopped without a final response (the client left waiting) and its task was
    destroyed pending."""
    from kvserve.integrations.triton.model import TritonPythonModel

    model_dir = write_repository(str(tmp_path), "tiny", {"model": tiny_model_dir("llama"), "device": "cpu",
                                                         "max_model_len": 256, "kv_cache_memory": "64MiB"},
                                 device="cpu")
    model = TritonPythonModel()
    model.initialize({"model_config": json.dumps({"model_transaction_policy": {"decoupled": True}}),
                      "model_repository": model_dir, "model_version": "1", "model_instance_kind": "CPU"})
    streamed = Request(text_input="Hello", stream=True, return_num_output_tokens=True, return_finish_reason=True,
                       sampling_parameters=json.dumps({"max_tokens": 64, "ignore_eos": True}))
    model.execute([streamed])
    model.finalize()
    assert streamed.sender.done.is_set() and streamed.sender.sent[-1] == (None, FINAL)
    pieces = [r.outputs() for r, _ in streamed.sender.sent if r is not None]
    assert sum(int(p["num_output_tokens"][0]) for p in pieces) == 64
    assert pieces[-1]["finish_reason"].tolist() == [b"length"]


class AutoCompleteConfig:
    """Triton's ModelConfig of auto_complete_config: the config as a dict, and its setters."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def as_dict(self) -> dict[str, Any]:
        return self.config

    def add_input(self, tensor: dict[str, Any]) -> None:
        self.config.setdefault("input", []).append(tensor)

    def add_output(self, tensor: dict[str, Any]) -> None:
        self.config.setdefault("output", []).append(tensor)

    def set_model_transaction_policy(self, policy: dict[str, bool]) -> None:
        self.config["model_transaction_policy"] = policy


def test_auto_complete_fills_a_vllm_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM repository's config.pbtxt names no inputs or outputs (vLLM's backend adds them in
    auto_complete_config): with kvserve's model it had none, so every request was refused. The inputs and
    outputs it leaves out are added (those it names kept), and with no transaction policy it is decoupled,
    as vLLM's; a policy the config sets stays."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stand_in())
    from kvserve.integrations.triton.model import TritonPythonModel

    vllm = TritonPythonModel.auto_complete_config(AutoCompleteConfig({"name": "vllm_model", "backend": "python"}))
    config = vllm.as_dict()
    assert [t["name"] for t in config["input"]] == [
        "text_input", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
        "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens", "return_num_output_tokens"]
    assert config["input"][0] == {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}
    assert all(t["optional"] for t in config["input"][1:])
    assert {t["name"]: t["data_type"] for t in config["output"]} == {
        "text_output": "TYPE_STRING", "finish_reason": "TYPE_STRING", "cumulative_logprob": "TYPE_FP32",
        "logprobs": "TYPE_STRING", "num_input_tokens": "TYPE_UINT32", "num_output_tokens": "TYPE_UINT32"}
    assert config["model_transaction_policy"] == {"decoupled": True}
    own = {"input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
           "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}],
           "model_transaction_policy": {"decoupled": False}}
    config = TritonPythonModel.auto_complete_config(AutoCompleteConfig(own)).as_dict()
    assert [t["name"] for t in config["input"]].count("text_input") == 1 and len(config["input"]) == 9
    assert [t["name"] for t in config["output"]].count("text_output") == 1 and len(config["output"]) == 6
    assert config["model_transaction_policy"] == {"decoupled": False}


def test_a_gpu_instance_takes_the_gpu_triton_gave_it() -> None:
    """Triton numbers an instance's GPU among those tritonserver sees: with CUDA_VISIBLE_DEVICES set, the
    engine takes that entry of it (it took the first visible GPU for every instance); a tensor-parallel engine
    keeps every GPU it sees (it was narrowed to one)."""
    from kvserve.integrations.triton.model import instance_visible_devices

    assert instance_visible_devices(None, 1, 1) == "1"
    assert instance_visible_devices("4,5", 1, 1) == "5"
    assert instance_visible_devices("GPU-aa, GPU-bb", 0, 1) == "GPU-aa"
    assert instance_visible_devices("4,5", 3, 1) is None  # not one of them: left as it is
    assert instance_visible_devices(None, 0, 2) is None and instance_visible_devices("4,5", 1, 2) is None


def test_repository_layout_and_command(tmp_path: Path, tiny_model_dir: Callable[..., str]) -> None:
    text = config_pbtxt("qwen2_7b", 32, True, 1, "KIND_GPU", [0])
    for line in ('name: "qwen2_7b"', 'backend: "python"', "max_batch_size: 32", "decoupled: true",
                 'name: "text_input", data_type: TYPE_STRING', 'name: "text_output"', "kind: KIND_GPU",
                 "gpus: [ 0 ]", "dynamic_batching"):
        assert line in text
    assert text.count("{") == text.count("}") and text.count("[") == text.count("]")
    assert "dynamic_batching" not in config_pbtxt("m", 0, True, 1, "KIND_CPU", None)

    model = Path(tiny_model_dir("llama"))
    done = subprocess.run([sys.executable, "-m", "kvserve", "triton-repo", "--name", "tiny", "--out", str(tmp_path),
                           "--model", str(model), "--device", "cpu", "--max-model-len", "128"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    engine_args = json.loads((tmp_path / "tiny" / "1" / "kvserve.json").read_text())
    assert engine_args["model"] == str(model.resolve()) and engine_args["max_model_len"] == 128
    assert "TritonPythonModel" in (tmp_path / "tiny" / "1" / "model.py").read_text()
    assert "kind: KIND_CPU" in (tmp_path / "tiny" / "config.pbtxt").read_text()
    again = subprocess.run([sys.executable, "-m", "kvserve", "triton-repo", "--name", "tiny", "--out", str(tmp_path),
                            "--model", str(model), "--device", "cpu"], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 2 and "already holds a model" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "kvserve", "triton-repo", "--name", "tiny2", "--out", str(tmp_path),
                          "--model", str(model), "--device", "cpu", "--max-model-len", "999999"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "max_model_len" in bad.stderr and not (tmp_path / "tiny2").exists()


def test_truncate_prompt_tokens_applies(triton_model: Callable[[bool], Any], tiny_model_dir: Callable[..., str]) -> None:
    """sampling_parameters' truncate_prompt_tokens keeps the prompt's last tokens, as on the server: a prompt
    longer than max_model_len is then served, as its tail alone is."""
    model = triton_model(False)
    prompt = "word " * 400
    params = json.dumps({"temperature": 0, "max_tokens": 6, "truncate_prompt_tokens": 20})
    (response,) = model.execute([Request(text_input=prompt, sampling_parameters=params, exclude_input_in_output=True)])
    assert not response.has_error(), response.error().message()
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, kv_cache_memory="64MiB")
    ids = llm.get_tokenizer()(prompt)["input_ids"]
    tail = llm.generate([ids[-20:]], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert response.text() == tail.outputs[0].text


def test_structured_outputs_apply(triton_model: Callable[[bool], Any]) -> None:
    """sampling_parameters' structured_outputs (vLLM's field names) constrain the text; a bad one is the
    request's error."""
    model = triton_model(False)
    params = json.dumps({"temperature": 0.7, "seed": 3, "max_tokens": 12,
                         "structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}})
    bad = json.dumps({"structured_outputs": {"regex": "[0-"}})
    good, refused = model.execute([Request(text_input="Time:", sampling_parameters=params, exclude_input_in_output=True),
                                   Request(text_input="x", sampling_parameters=bad)])
    assert not good.has_error(), good.error().message()
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", good.text()), good.text()
    assert refused.has_error() and "invalid regex" in refused.error().message()


def test_request_parameters_stand_in_for_sampling_parameters(triton_model: Callable[[bool], Any],
                                                            tiny_model_dir: Callable[..., str]) -> None:
    """Without a sampling_parameters input the request's parameters are read (Triton's generate endpoint
    puts a body's "parameters" there; vLLM's backend reads them): they were ignored, so temperature 0 and
    max_tokens 3 gave 16 random tokens. stream and exclude_input_in_output may stand there for the inputs;
    Triton's own triton_* keys are skipped; numbers and booleans may come as strings."""
    model = triton_model(True)
    prompt = "The capital of France"
    expected = _reference(tiny_model_dir("llama"), prompt, 3)
    whole = Request(text_input=prompt, parameters={"temperature": 0, "max_tokens": 3, "exclude_input_in_output": True,
                                                   "triton_enable_empty_final_response": True})
    streamed = Request(text_input=prompt, parameters={"temperature": "0", "max_tokens": "3", "stream": "true",
                                                      "ignore_eos": "false"})
    tensor_first = Request(text_input=prompt, sampling_parameters=json.dumps({"temperature": 0, "max_tokens": 3}),
                           parameters={"max_tokens": 9})  # the input wins, as in vLLM's backend
    bad = Request(text_input=prompt, parameters={"temperature": "warm"})
    unknown = Request(text_input=prompt, parameters={"temprature": 0})
    model.execute([whole, streamed, tensor_first, bad, unknown])
    for request in (whole, streamed, tensor_first, bad, unknown):
        assert request.sender.done.wait(60)
    assert whole.sender.sent[-1][0].text() == expected
    assert "".join(r.text() for r, _ in streamed.sender.sent if r is not None) == expected
    assert tensor_first.sender.sent[-1][0].text() == prompt + expected
    assert bad.sender.sent[-1][0].error().message() == "parameters: temperature must be a number, got 'warm'"
    assert "temprature" in unknown.sender.sent[-1][0].error().message()


def test_return_flags_add_vllms_optional_outputs(triton_model: Callable[[bool], Any],
                                                 tiny_model_dir: Callable[..., str]) -> None:
    """vLLM's backend's return_finish_reason / _cumulative_logprob / _logprobs / _num_input_tokens /
    _num_output_tokens inputs add those outputs (they were not inputs of the repository, so Triton refused such
    requests, and the model ignored them): whole, the request's; streamed, each response's delta of logprobs
    and tokens, the finish reason "None" until the last. Without the flags only text_output comes."""
    model = triton_model(True)
    prompt = "Hello, my name is"
    flags = {f"return_{name}": True for name in ("finish_reason", "cumulative_logprob", "logprobs",
                                                 "num_input_tokens", "num_output_tokens")}
    params = json.dumps({"temperature": 0, "max_tokens": 5, "logprobs": 1})
    whole = Request(text_input=prompt, sampling_parameters=params, exclude_input_in_output=True, **flags)
    streamed = Request(text_input=prompt, sampling_parameters=params, stream=True, **flags)
    plain = Request(text_input=prompt, sampling_parameters=params)
    no_logprobs = Request(text_input=prompt, sampling_parameters=json.dumps({"max_tokens": 2}), **flags)
    model.execute([whole, streamed, plain, no_logprobs])
    from transformers import AutoTokenizer

    for request in (whole, streamed, plain, no_logprobs):
        assert request.sender.done.wait(60)
    num_prompt = len(AutoTokenizer.from_pretrained(tiny_model_dir("llama"))(prompt)["input_ids"])
    out = whole.sender.sent[-1][0].outputs()
    assert [t.decode() for t in out["finish_reason"].tolist()] == ["length"]
    assert out["num_input_tokens"].dtype == np.uint32 and out["num_input_tokens"].tolist() == [num_prompt]
    assert out["num_output_tokens"].dtype == np.uint32 and out["num_output_tokens"].tolist() == [5]
    (logprobs,) = [json.loads(t) for t in out["logprobs"].tolist()]
    assert len(logprobs) == 5 and all({"logprob", "rank", "decoded_token"} <= set(next(iter(d.values())))
                                      for d in logprobs)
    sampled = [max(d.values(), key=lambda e: e["logprob"])["logprob"] for d in logprobs]  # greedy: the top one
    assert out["cumulative_logprob"].dtype == np.float32
    assert out["cumulative_logprob"].tolist() == pytest.approx([sum(sampled)], abs=1e-4)
    pieces = [r.outputs() for r, _ in streamed.sender.sent if r is not None]
    assert "".join(p["text_output"][0].decode() for p in pieces) == out["text_output"][0].decode()
    assert [p["finish_reason"][0].decode() for p in pieces] == ["None"] * (len(pieces) - 1) + ["length"]
    assert sum(int(p["num_output_tokens"][0]) for p in pieces) == 5
    streamed_logprobs = sum((json.loads(p["logprobs"][0]) for p in pieces), [])
    assert [{k: e["decoded_token"] for k, e in d.items()} for d in streamed_logprobs] == [
        {k: e["decoded_token"] for k, e in d.items()} for d in logprobs]
    assert pieces[-1]["cumulative_logprob"].tolist() == pytest.approx(out["cumulative_logprob"].tolist(), abs=1e-4)
    assert set(plain.sender.sent[-1][0].outputs()) == {"text_output"}
    bare = no_logprobs.sender.sent[-1][0].outputs()
    assert bare["logprobs"].tolist() == [b"null"] and np.isnan(bare["cumulative_logprob"]).all()
    text = config_pbtxt("m", 0, True, 1, "KIND_CPU", None)
    for name in flags:
        assert f'name: "{name}", data_type: TYPE_BOOL, dims: [ 1 ], optional: true' in text
    for line in ('name: "finish_reason", data_type: TYPE_STRING', 'name: "cumulative_logprob", data_type: TYPE_FP32',
                 'name: "logprobs", data_type: TYPE_STRING', 'name: "num_input_tokens", data_type: TYPE_UINT32',
                 'name: "num_output_tokens", data_type: TYPE_UINT32'):
        assert line in text


def test_n_samples_each_get_their_text(triton_model: Callable[[bool], Any],
                                       tiny_model_dir: Callable[..., str]) -> None:
    """sampling_parameters' n: one text_output element a sample, as vLLM's backend (only the first came back);
    streamed, each response holds each sample's new text. Seeded, the samples are the offline LLM's."""
    model = triton_model(True)
    prompt = "Hello, my name is"
    fields = {"n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 6}
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, kv_cache_memory="64MiB")
    (reference,) = llm.generate([prompt], SamplingParams(**fields), use_tqdm=False)
    expected = [o.text for o in sorted(reference.outputs, key=lambda o: o.index)]
    assert len(set(expected)) > 1
    whole = Request(text_input=prompt, sampling_parameters=json.dumps(fields), exclude_input_in_output=True)
    streamed = Request(text_input=prompt, sampling_parameters=json.dumps(fields), stream=True)
    model.execute([whole, streamed])
    assert whole.sender.done.wait(60) and streamed.sender.done.wait(60)
    assert whole.sender.sent[-1][0].texts() == expected
    pieces = [r.texts() for r, _ in streamed.sender.sent if r is not None]
    assert all(len(p) == 3 for p in pieces)
    assert ["".join(p[i] for p in pieces) for i in range(3)] == expected


@pytest.mark.parametrize("fields, message", [
    ({"ignore_eos": "yes"}, "sampling_parameters: ignore_eos must be true or false, got 'yes'"),
    ({"ignore_eos": 1}, "sampling_parameters: ignore_eos must be true or false, got 1"),
    ({"temperature": True}, "sampling_parameters: temperature must be a number, got True"),
    ({"max_tokens": True}, "sampling_parameters: max_tokens must be an integer, got True"),
    ({"max_tokens": "4.5"}, "sampling_parameters: max_tokens must be an integer, got '4.5'"),
    ({"seed": 2**70}, "sampling_parameters: seed must be a 64-bit integer"),
    ({"structured_outputs": "{not json"}, "sampling_parameters: structured_outputs must be a JSON object"),
    ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, "not both"),
])
def test_sampling_fields_of_the_wrong_type_are_the_requests_error(triton_model: Callable[[bool], Any],
                                                                 fields: dict[str, Any], message: str) -> None:
    """Refused with the field's name before the engine: such values passed and the engine process could not
    decode the request (an error of its own, with a traceback in its log), or overflowed its encoder."""
    model = triton_model(False)
    (response,) = model.execute([Request(text_input="x", sampling_parameters=json.dumps(fields))])
    assert response.has_error() and message in response.error().message(), response.error().message()


def test_strings_and_older_names_of_vllms_backend_are_read(triton_model: Callable[[bool], Any],
                                                           tiny_model_dir: Callable[..., str]) -> None:
    """vLLM's backend reads "0"/"4" as numbers, structured_outputs as a JSON string and guided_decoding as
    its older name; each was refused here. And a stream never carries the prompt, so an explicit
    exclude_input_in_output false with stream is refused (as vLLM's), not silently ignored."""
    model = triton_model(True)
    prompt = "Time:"
    strings = Request(text_input=prompt, exclude_input_in_output=True,
                      sampling_parameters=json.dumps({"temperature": "0", "max_tokens": "4"}))
    regex = {"regex": "[0-9]{2}:[0-9]{2}"}
    as_text = Request(text_input=prompt, exclude_input_in_output=True, sampling_parameters=json.dumps(
        {"temperature": 0.7, "seed": 3, "max_tokens": 12, "structured_outputs": json.dumps(regex)}))
    older = Request(text_input=prompt, exclude_input_in_output=True, sampling_parameters=json.dumps(
        {"temperature": 0.7, "seed": 3, "max_tokens": 12, "guided_decoding": regex}))
    refused = Request(text_input=prompt, stream=True, exclude_input_in_output=False)
    model.execute([strings, as_text, older, refused])
    for request in (strings, as_text, older, refused):
        assert request.sender.done.wait(60)
    assert strings.sender.sent[-1][0].text() == _reference(tiny_model_dir("llama"), prompt, 4)
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", as_text.sender.sent[-1][0].text())
    assert older.sender.sent[-1][0].text() == as_text.sender.sent[-1][0].text()
    ((response, flags),) = refused.sender.sent
    assert flags == FINAL and "exclude_input_in_output=false cannot be given with stream=true" in (
        response.error().message())


def test_instance_groups_place_each_engine_once() -> None:
    """Triton's KIND_GPU count is per listed GPU, and with no list per GPU of the host: the repository had no
    list, so a 4-GPU host started 4 engines, and --instances 2 --gpus 0,1 four (two a GPU at 0.9 each, the
    second refused at start). Now: the GPUs listed (GPU 0 by default); engines sharing a GPU must fit in it;
    a tensor-parallel engine is one KIND_MODEL instance told its GPUs (KIND_GPU would place it on one)."""
    from kvserve.integrations.triton.repo import instance_group

    assert instance_group("cuda", 1, None, 1, 0.9, False) == ("KIND_GPU", [0], {})
    assert instance_group("cuda", 1, [2, 3], 1, 0.9, False) == ("KIND_GPU", [2, 3], {})
    assert instance_group("cuda", 2, [0, 1], 1, 0.45, False) == ("KIND_GPU", [0, 1], {})
    assert instance_group("cuda", 2, None, 1, 0.9, True) == ("KIND_GPU", [0], {})  # --kv-cache-memory sizes each
    assert instance_group("cpu", 3, None, 1, 0.9, False) == ("KIND_CPU", None, {})
    assert instance_group("cuda", 1, None, 2, 0.9, False) == ("KIND_MODEL", None, {"kvserve_gpus": "0,1"})
    assert instance_group("cuda", 1, [2, 3], 2, 0.9, False) == ("KIND_MODEL", None, {"kvserve_gpus": "2,3"})
    for args, message in [
        (("cuda", 2, [0, 1], 1, 0.9, False), "at most 0.50"),
        (("cuda", 2, None, 2, 0.9, False), "one engine"),
        (("cuda", 1, [0, 1, 2], 2, 0.9, False), "lists 3 GPUs for --tensor-parallel-size 2"),
        (("cuda", 1, [0, 0], 1, 0.9, False), "distinct"),
        (("cuda", 0, None, 1, 0.9, False), ">= 1"),
        (("cpu", 1, [0], 1, 0.9, False), "--device cuda"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            instance_group(*args)  # type: ignore[arg-type]
    text = config_pbtxt("m", 0, True, 1, "KIND_MODEL", None, {"kvserve_gpus": "2,3"})
    assert "kind: KIND_MODEL" in text and "gpus:" not in text
    assert 'parameters {\n  key: "kvserve_gpus"\n  value: { string_value: "2,3" }\n}' in text
    assert text.count("{") == text.count("}")


def test_a_tensor_parallel_instance_takes_its_gpus() -> None:
    """KIND_MODEL: the engine's GPUs come from the kvserve_gpus parameter, numbered among the GPUs
    tritonserver sees (every TP engine took the first N GPUs, whatever --gpus said)."""
    from kvserve.integrations.triton.model import model_visible_devices

    assert model_visible_devices(None, "2,3") == "2,3"
    assert model_visible_devices("4,5,6,7", "2,3") == "6,7"
    with pytest.raises(ValueError, match="beyond the 2 that tritonserver sees"):
        model_visible_devices("4,5", "1,2")


def test_triton_repo_writes_the_placement(tmp_path: Path, tiny_model_dir: Callable[..., str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The command writes the group of `instance_group` and refuses what cannot run (exit 2), writing
    nothing. vLLM's --disable-log-requests (in command lines written for its backend) is taken: this backend
    logs no requests, so it changes nothing written (it was an unrecognized argument)."""
    from kvserve.entrypoints.cli import main

    model = tiny_model_dir("llama")
    assert main(["triton-repo", "--name", "one", "--out", str(tmp_path), "--model", model, "--max-model-len", "64",
                 "--gpus", "1", "--instances", "2", "--gpu-memory-utilization", "0.4", "--disable-log-requests"]) == 0
    text = (tmp_path / "one" / "config.pbtxt").read_text()
    assert "count: 2" in text and "kind: KIND_GPU" in text and "gpus: [ 1 ]" in text
    assert "log_requests" not in (tmp_path / "one" / "1" / "kvserve.json").read_text()
    assert main(["triton-repo", "--name", "two", "--out", str(tmp_path), "--model", model, "--max-model-len", "64",
                 "--instances", "2"]) == 2
    assert "at most 0.50 (it is 0.9)" in capsys.readouterr().err
    assert main(["triton-repo", "--name", "three", "--out", str(tmp_path), "--model", model, "--gpus", "a,b"]) == 2
    assert "--gpus must list GPU ids separated by commas" in capsys.readouterr().err
    assert not (tmp_path / "two").exists() and not (tmp_path / "three").exists()
