"""kvserve as a Triton Inference Server Python-backend model (`kvserve triton-repo` writes the repository).

Triton runs this model's `TritonPythonModel` in its Python stub process. `initialize` starts a kvserve engine
(the engine-core process, as `kvserve serve` does) with the engine arguments of `kvserve.json` beside the
model file (or of vLLM's `model.json` there, when there is no kvserve.json); requests go to it as they arrive,
and the engine batches them continuously, so Triton's own dynamic batching only groups requests that arrive
together.

Inputs (the names vLLM's Triton backend uses, so clients carry over):

* `text_input` (STRING): the prompt;
* `stream` (BOOL, optional): send the text piece by piece as it is generated (needs the decoupled
  transaction policy, which `kvserve triton-repo` sets by default);
* `sampling_parameters` (STRING, optional): JSON of kvserve/vLLM `SamplingParams` fields, e.g.
  `{"temperature": 0.7, "max_tokens": 128}`. Without it the request's parameters are read instead (Triton's
  generate endpoint puts a body's `"parameters"` object there), as vLLM's backend reads them; there `stream`
  and `exclude_input_in_output` may stand for the inputs, and Triton's own `triton_*` keys are skipped.
  Numbers and booleans given as strings (`"0.7"`, `"128"`, `"true"`) are read as such, and
  `structured_outputs` (or vLLM's older `guided_decoding`) may be a JSON string;
* `exclude_input_in_output` (BOOL, optional): without streaming, the output is the prompt followed by the
  generated text unless this is true. A stream never carries the prompt: false with `stream` is refused;
* `return_finish_reason`, `return_cumulative_logprob`, `return_logprobs`, `return_num_input_tokens`,
  `return_num_output_tokens` (BOOL, optional; vLLM's backend's): add the output of that name.

Output `text_output` (STRING): one element a sample (`n` of them), each streamed response one delta a sample.
The optional outputs, as vLLM's backend gives them: `finish_reason` (STRING, a sample's "stop", "length",
"abort", or "None" while it runs), `cumulative_logprob` (FP32, NaN without the `logprobs` sampling field),
`logprobs` (STRING, a sample's JSON list of `{token id: {"logprob", "rank", "decoded_token"}}` a token, or
`null` without the `logprobs` field), `num_input_tokens` (UINT32, the prompt's) and `num_output_tokens`
(UINT32, a sample's). A streamed response's logprobs and output token count are those of its delta; a stream
asking for any of them also gets its sample's last update when that adds no text, so the finish reason comes.
A bad request (no prompt, bad JSON or parameters, a prompt too long for the model) gets an error response with
the reason; other requests are unaffected. A request cancelled by its client is aborted in the engine, and
its final response is an error with Triton's CANCELLED code (as vLLM's backend answers it), not an empty success.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
from concurrent.futures import Future, wait
from typing import Any

import numpy as np

from kvserve.integrations.triton.repo import GPUS_PARAMETER, INPUTS, OUTPUTS

try:  # provided by Triton's Python backend inside its stub process
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - outside Triton (tests install a stand-in under that name)
    pb_utils = None

ENGINE_ARGS_FILE = "kvserve.json"
# How long finalize() lets the requests in flight finish before it aborts them (vLLM's backend waits for them).
FINALIZE_DRAIN_S = 60.0
VLLM_ENGINE_ARGS_FILE = "model.json"  # vLLM's backend's name, read when there is no kvserve.json
# vLLM AsyncEngineArgs that change nothing in this backend (it logs no requests), accepted at any value.
_IGNORED_BACKEND_ARGS = ("disable_log_requests", "enable_log_requests")
# vLLM's backend's optional outputs: input `return_<name>` (BOOL) asks for output `<name>`.
ADDITIONAL_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")


def instance_visible_devices(visible: str | None, device_id: int, tensor_parallel_size: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for the engine of a GPU instance Triton placed on `device_id` (CUDA's numbering,
    which counts the GPUs tritonserver itself sees: `visible`, when set, names them), or None to leave it as
    it is: a tensor-parallel engine takes the first `tensor_parallel_size` GPUs it sees."""
    if tensor_parallel_size > 1:
        return None
    names = [name.strip() for name in visible.split(",")] if visible else []
    if names:
        return names[device_id] if device_id < len(names) else None
    return str(device_id)


def model_visible_devices(visible: str | None, gpus: str) -> str:
    """CUDA_VISIBLE_DEVICES for a KIND_MODEL (tensor-parallel) engine given the GPU ids of its `kvserve_gpus`
    parameter (comma-separated, numbered among the GPUs tritonserver sees: `visible`, when set, names them).
    ValueError for an id that is not one of them."""
    ids = [int(g) for g in gpus.split(",")]
    names = [name.strip() for name in visible.split(",")] if visible else []
    if not names:
        return ",".join(map(str, ids))
    if max(ids) >= len(names):
        raise ValueError(f"kvserve_gpus {gpus} names GPUs beyond the {len(names)} that tritonserver sees "
                         f"(CUDA_VISIBLE_DEVICES={visible})")
    return ",".join(names[i] for i in ids)


def read_engine_args(version_dir: str) -> dict[str, Any]:
    """The engine arguments of the version directory's kvserve.json, or of vLLM's model.json when there is none
    (a vLLM repository's engine arguments carry over): vLLM's aliases renamed, its arguments that change
    nothing here (`disable_log_requests`, `trust_remote_code`, ...) dropped, and an argument kvserve does not
    take a ValueError naming it and the file (it was EngineArgs' bare TypeError)."""
    from kvserve.engine.llm import UnknownEngineArgument, _engine_args

    path = os.path.join(version_dir, ENGINE_ARGS_FILE)
    if not os.path.exists(path) and os.path.exists(os.path.join(version_dir, VLLM_ENGINE_ARGS_FILE)):
        path = os.path.join(version_dir, VLLM_ENGINE_ARGS_FILE)
    with open(path) as f:
        given = json.load(f)
    if not isinstance(given, dict):
        raise ValueError(f"{path} must hold a JSON object of engine arguments")
    try:  # (as LLM() reads its keyword arguments)
        return _engine_args({k: v for k, v in given.items() if k not in _IGNORED_BACKEND_ARGS})
    except UnknownEngineArgument as exc:
        raise ValueError(f"{path}: kvserve does not take the engine argument {exc.name}={exc.value!r}. It takes: "
                         f"{', '.join(exc.known)}") from None


def _pb() -> Any:
    import sys

    return sys.modules.get("triton_python_backend_utils", pb_utils)


def _input(request: Any, name: str) -> Any:
    """The input's one element (None when not given or empty). ValueError for more than one: a request of a
    model with max_batch_size > 0 may carry a batch of them ([2, 1]), which would answer the first alone."""
    tensor = _pb().get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = np.asarray(tensor.as_numpy()).reshape(-1)
    if values.size > 1:
        raise ValueError(f"{name} holds {values.size} elements (shape {list(np.shape(tensor.as_numpy()))}): one "
                         "prompt a request, so send each prompt of a batch as its own request (Triton's dynamic "
                         "batching and kvserve's engine run them together)")
    return values[0] if values.size else None


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)


def _output(texts: list[str], error: str | None = None, extra: dict[str, np.ndarray] | None = None) -> Any:
    pb = _pb()
    if error is not None:
        return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(error))
    tensors = [pb.Tensor("text_output", np.array([t.encode("utf-8") for t in texts], dtype=np.object_))]
    tensors += [pb.Tensor(name, value) for name, value in (extra or {}).items()]
    return pb.InferenceResponse(output_tensors=tensors)


CANCELLED_MESSAGE = "the request was cancelled"


def _cancelled_response() -> Any:
    """The final response of a request its client cancelled: an error with Triton's CANCELLED code (Tritons
    before 23.10 have no codes: the message alone)."""
    pb = _pb()
    code = getattr(pb.TritonError, "CANCELLED", None)
    error = pb.TritonError(CANCELLED_MESSAGE) if code is None else pb.TritonError(CANCELLED_MESSAGE, code)
    return pb.InferenceResponse(output_tensors=[], error=error)


class _Extras:
    """The optional outputs a request asked for (`ADDITIONAL_OUTPUTS`), from each sample's latest output; in a
    stream each response's logprobs and output token count cover what the previous response had not."""

    def __init__(self, wanted: frozenset[str], n: int) -> None:
        self.wanted = wanted
        self.samples: list[Any] = [None] * n  # each sample's latest CompletionOutput
        self.sent_logprobs, self.sent_tokens = [0] * n, [0] * n
        self.num_input_tokens = 0

    def update(self, update: Any) -> None:
        self.num_input_tokens = len(update.prompt_token_ids)
        for out in update.outputs:
            self.samples[out.index] = out

    def tensors(self, delta: bool) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        samples = self.samples
        if "finish_reason" in self.wanted:  # str(None) while running, as vLLM's backend
            out["finish_reason"] = np.array([str(s.finish_reason if s else None).encode() for s in samples],
                                            dtype=np.object_)
        if "cumulative_logprob" in self.wanted:
            out["cumulative_logprob"] = np.array(
                [np.nan if s is None or s.cumulative_logprob is None else s.cumulative_logprob for s in samples],
                dtype=np.float32)
        if "logprobs" in self.wanted:
            texts = []
            for i, s in enumerate(samples):
                if s is None or s.logprobs is None:
                    texts.append(b"null")
                    continue
                start = self.sent_logprobs[i] if delta else 0
                self.sent_logprobs[i] = len(s.logprobs)
                texts.append(json.dumps([
                    {token: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                     for token, lp in entry.items()} for entry in s.logprobs[start:]]).encode())
            out["logprobs"] = np.array(texts, dtype=np.object_)
        if "num_input_tokens" in self.wanted:
            out["num_input_tokens"] = np.array([self.num_input_tokens], dtype=np.uint32)
        if "num_output_tokens" in self.wanted:
            counts = []
            for i, s in enumerate(samples):
                total = len(s.token_ids) if s is not None else 0
                counts.append(total - (self.sent_tokens[i] if delta else 0))
                self.sent_tokens[i] = total
            out["num_output_tokens"] = np.array(counts, dtype=np.uint32)
        return out


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config: Any) -> Any:
        """Triton's auto-complete (on unless tritonserver runs with --disable-auto-complete-config) adds the
        inputs and outputs the config leaves out, as vLLM's backend adds its own: a vLLM repository's
        config.pbtxt names none, so its clients' requests were refused ("unexpected inference input"). A config
        that sets no transaction policy gets the decoupled one, as vLLM's backend requires; one that sets it
        (as `kvserve triton-repo` writes) keeps it, and the batch size stays as the config has it."""
        config = auto_complete_model_config.as_dict()
        inputs = {tensor["name"] for tensor in config.get("input") or []}
        outputs = {tensor["name"] for tensor in config.get("output") or []}
        for tensor in INPUTS:
            if tensor["name"] not in inputs:
                auto_complete_model_config.add_input(dict(tensor))
        for tensor in OUTPUTS:
            if tensor["name"] not in outputs:
                auto_complete_model_config.add_output(dict(tensor))
        if "model_transaction_policy" not in config:
            auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        return auto_complete_model_config

    def initialize(self, args: dict[str, str]) -> None:
        from kvserve.config import EngineArgs
        from kvserve.engine.async_llm import AsyncLLM

        pb = _pb()
        self.model_config = json.loads(args["model_config"])
        self.decoupled = bool(pb.using_decoupled_model_transaction_policy(self.model_config))
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        engine_args = read_engine_args(version_dir)
        gpus = self.model_config.get("parameters", {}).get(GPUS_PARAMETER, {}).get("string_value")
        if args.get("model_instance_kind") == "GPU":
            # The engine process (spawned below) takes the GPU Triton gave this instance.
            devices = instance_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                               int(args.get("model_instance_device_id", 0)),
                                               int(engine_args.get("tensor_parallel_size", 1)))
            if devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = devices
        elif args.get("model_instance_kind") == "MODEL" and gpus:
            # A tensor-parallel engine's GPUs, written by `kvserve triton-repo` (Triton places none).
            os.environ["CUDA_VISIBLE_DEVICES"] = model_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
        config = EngineArgs(**engine_args).create_engine_config()
        self.sampling_defaults = dict(config.model_config.sampling_defaults)
        self.max_tokens_cap = config.model_config.max_tokens_cap
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvserve-triton-loop", daemon=True)
        self._thread.start()
        self.engine = AsyncLLM(config)
        self._run(self.engine.start()).result()
        self._ids = itertools.count()
        self._in_flight: set[Future[Any]] = set()  # each request's response future, until it is answered
        self.drain_timeout_s = FINALIZE_DRAIN_S

    def _run(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    # ------------------------------------------------------------------ requests

    def _parse(self, request: Any) -> tuple[list[int], str, Any, bool, bool, frozenset[str]]:
        """(prompt ids, prompt, SamplingParams, stream, exclude_input_in_output, the optional outputs asked
        for); ValueError on bad input."""
        from kvserve.model.generation_defaults import apply_cap
        from kvserve.protocol.sampling_params import SamplingParams

        prompt_value = _input(request, "text_input")
        if prompt_value is None:
            raise ValueError("text_input is required")
        prompt = _text(prompt_value)
        stream_value, exclude_value = _input(request, "stream"), _input(request, "exclude_input_in_output")
        flags = {name: _input(request, f"return_{name}") for name in ADDITIONAL_OUTPUTS}
        raw = _input(request, "sampling_parameters")
        source = "sampling_parameters"
        if raw is None or not _text(raw).strip():
            raw, source = _request_parameters(request), "parameters"
        fields: dict[str, Any] = {}
        if isinstance(raw, dict):
            fields = dict(raw)
        elif raw is not None and _text(raw).strip():
            try:
                fields = json.loads(_text(raw))
            except ValueError as exc:
                raise ValueError(f"{source} is not JSON: {exc}") from None
            if not isinstance(fields, dict):
                raise ValueError(f"{source} must be a JSON object")
        if source == "parameters":
            fields = {k: v for k, v in fields.items() if not k.startswith("triton_")}  # Triton's own
            stream_param = _flag(fields.pop("stream", None), "stream")
            exclude_param = _flag(fields.pop("exclude_input_in_output", None), "exclude_input_in_output")
            stream_value = stream_param if stream_value is None else stream_value  # the input tensors first
            exclude_value = exclude_param if exclude_value is None else exclude_value
            for name in ADDITIONAL_OUTPUTS:
                flag = _flag(fields.pop(f"return_{name}", None), f"return_{name}")
                flags[name] = flag if flags[name] is None else flags[name]
        try:
            # What the request leaves out: the model's generation config, then SamplingParams' defaults.
            given = _read_fields({key: value for key, value in fields.items() if value is not None})  # null: left out
            params = SamplingParams(**{**self.sampling_defaults, **given})
            # The generation config's cap lowers what a request asks for, as on the server (vLLM's rule).
            params = apply_cap(params, self.max_tokens_cap)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (a field of the wrong type: TypeError, AttributeError, ...)
            raise ValueError(f"{source}: {type(exc).__name__}: {exc}") from None
        stream = bool(stream_value or False)
        if stream and not self.decoupled:
            raise ValueError("stream=true needs the decoupled transaction policy (kvserve triton-repo --decoupled)")
        if stream and exclude_value is not None and not exclude_value:
            raise ValueError("a stream never carries the prompt: exclude_input_in_output=false cannot be given with "
                             "stream=true")
        ids = self.engine.input_processor.tokenize(prompt).prompt_token_ids
        wanted = frozenset(name for name, flag in flags.items() if flag)
        return ids, prompt, params, stream, bool(exclude_value or False), wanted

    async def _generate(self, request: Any, parsed: tuple[list[int], str, Any, bool, bool, frozenset[str]],
                        sender: Any | None) -> Any:
        """Run one parsed request: its final response (None after streaming its pieces through `sender`). One
        text a sample; a streamed response holds each sample's new text (empty where it has none)."""
        ids, prompt, params, stream, exclude, wanted = parsed
        request_id = f"triton-{next(self._ids)}"
        texts = [""] * params.n
        extras = _Extras(wanted, params.n)
        try:
            async for update in self.engine.generate(request_id, ids, params, prompt=prompt):
                if _cancelled(request):
                    self.engine.abort(request_id)
                    return _cancelled_response()
                deltas = [""] * params.n
                for out in update.outputs:
                    texts[out.index], deltas[out.index] = out.text, out.text_delta
                extras.update(update)
                # With optional outputs a sample's last update goes out even without text: its finish reason.
                if stream and sender is not None and (
                        any(deltas) or (wanted and any(out.finished for out in update.outputs))):
                    sender.send(_output(deltas, extra=extras.tensors(delta=True)))
        except ValueError as exc:  # refused by the engine (e.g. too long for max_model_len)
            return _output([], error=str(exc))
        if stream:
            return None
        return _output([text if exclude else prompt + text for text in texts], extra=extras.tensors(delta=False))

    async def _respond(self, request: Any, parsed: tuple[list[int], str, Any, bool, bool, frozenset[str]],
                       sender: Any | None) -> Any:
        """The request's final response: sent through `sender` (decoupled) or returned. Whatever stops the
        generation (the engine gone, an error in a step) ends this request with an error response of its own:
        a decoupled client is not left waiting for a final response, nor the batch's others failed."""
        try:
            response = await self._generate(request, parsed, sender)
        except Exception as exc:  # noqa: BLE001 (any failure is this request's error response)
            response = _output([], error=f"{type(exc).__name__}: {exc}")
        if sender is None:
            return response
        sender.send(response, flags=_pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def execute(self, requests: list[Any]) -> list[Any] | None:
        # Each request is parsed and tokenized here, on Triton's thread, not on the engine's event loop.
        outcomes: list[Any] = []  # per request: its response, or the future of it
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            try:
                parsed = self._parse(request)
            except ValueError as exc:
                outcomes.append(_output([], error=str(exc)))
                if sender is not None:
                    sender.send(outcomes[-1], flags=_pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            future = self._run(self._respond(request, parsed, sender))
            self._in_flight.add(future)
            future.add_done_callback(self._in_flight.discard)
            outcomes.append(future)
        if self.decoupled:
            return None
        return [o.result() if isinstance(o, Future) else o for o in outcomes]

    def finalize(self) -> None:
        """Shut the engine down once the requests in flight (a decoupled model's outlive `execute`) have
        finished, as vLLM's backend waits for them; those still running after `drain_timeout_s` are aborted
        (finish reason "abort"), so each still gets its final response before the engine goes."""
        pending = list(self._in_flight)
        if wait(pending, timeout=self.drain_timeout_s).not_done:
            self.loop.call_soon_threadsafe(self.engine.abort_all)
            wait(pending, timeout=10)
        self._run(self.engine.shutdown()).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def _request_parameters(request: Any) -> Any:
    """The request's parameters (Triton's `InferenceRequest.parameters()`, a JSON object as text), or None."""
    parameters = getattr(request, "parameters", None)
    return parameters() if callable(parameters) else None


def _flag(value: Any, name: str) -> bool | None:
    """A boolean of the request's parameters: true / false, or their strings; None when not given."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"parameters: {name} must be true or false, got {value!r}")


# Sampling fields that hold a list (or, logit_bias, an object): what each must be.
_CONTAINER_FIELDS = {"stop": "a string or a list of strings", "stop_token_ids": "a list of token ids",
                     "allowed_token_ids": "a list of token ids", "logit_bias": "an object of token id: bias"}


def _read_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Sampling fields as vLLM's Triton backend reads them: a number or boolean given as a string is read as
    the field's type ("0.7", "128", "true"), `structured_outputs` may be a JSON string, and vLLM's older
    `guided_decoding` is its other name. ValueError for a string that is not of the field's type."""
    from kvserve.protocol.sampling_params import BOOL_FIELDS, FLOAT_FIELDS, INT_FIELDS

    out = dict(fields)
    for key, kind in _CONTAINER_FIELDS.items():  # else SamplingParams' bare TypeError, naming no field
        value = out.get(key)
        if value is not None and not (isinstance(value, dict) if key == "logit_bias" else
                                      isinstance(value, list) or (key == "stop" and isinstance(value, str))):
            raise ValueError(f"{key} must be {kind}, got {value!r}")
    if "guided_decoding" in out:
        if "structured_outputs" in out:
            raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
        out["structured_outputs"] = out.pop("guided_decoding")
    for key, value in out.items():
        if not isinstance(value, str):
            continue
        text = value.strip()
        try:
            if key in FLOAT_FIELDS:
                out[key] = float(text)
            elif key in INT_FIELDS:
                out[key] = int(text)
            elif key in BOOL_FIELDS:
                if text.lower() not in ("true", "false"):
                    raise ValueError
                out[key] = text.lower() == "true"
            elif key == "structured_outputs":
                out[key] = json.loads(text)
        except ValueError:
            kind = ("a number" if key in FLOAT_FIELDS else "an integer" if key in INT_FIELDS
                    else "true or false" if key in BOOL_FIELDS else "a JSON object")
            raise ValueError(f"{key} must be {kind}, got {value!r}") from None
    return out


def _cancelled(request: Any) -> bool:
    is_cancelled = getattr(request, "is_cancelled", None)
    return bool(is_cancelled()) if callable(is_cancelled) else False
