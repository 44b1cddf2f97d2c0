"""kvserve as a Triton Inference Server Python-backend model (`kvserve triton-repo` writes the repository).

Triton runs this model's `TritonPythonModel` in its Python stub process. `initialize` starts a kvserve engine
(the engine-core process, as `kvserve serve` does) with the engine arguments of `kvserve.json` beside the
model file; requests go to it as they arrive, and the engine batches them continuously, so Triton's own
dynamic batching only groups requests that arrive together.

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
  generated text unless this is true. A stream never carries the prompt: false with `stream` is refused.

Output `text_output` (STRING): one element a sample (`n` of them), each streamed response one delta a sample.
A bad request (no prompt, bad JSON or parameters, a prompt too long for the model) gets an error response with
the reason; other requests are unaffected. A request cancelled by its client is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvserve.integrations.triton.repo import GPUS_PARAMETER

try:  # provided by Triton's Python backend inside its stub process
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - outside Triton (tests install a stand-in under that name)
    pb_utils = None

ENGINE_ARGS_FILE = "kvserve.json"


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


def _pb() -> Any:
    import sys

    return sys.modules.get("triton_python_backend_utils", pb_utils)


def _input(request: Any, name: str) -> Any:
    tensor = _pb().get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = np.asarray(tensor.as_numpy()).reshape(-1)
    return values[0] if values.size else None


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)


def _output(texts: list[str], error: str | None = None) -> Any:
    pb = _pb()
    if error is not None:
        return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(error))
    tensor = pb.Tensor("text_output", np.array([t.encode("utf-8") for t in texts], dtype=np.object_))
    return pb.InferenceResponse(output_tensors=[tensor])


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        from kvserve.config import EngineArgs
        from kvserve.engine.async_llm import AsyncLLM

        pb = _pb()
        self.model_config = json.loads(args["model_config"])
        self.decoupled = bool(pb.using_decoupled_model_transaction_policy(self.model_config))
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(version_dir, ENGINE_ARGS_FILE)) as f:
            engine_args = json.load(f)
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

    def _run(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    # ------------------------------------------------------------------ requests

    def _parse(self, request: Any) -> tuple[list[int], str, Any, bool, bool]:
        """(prompt ids, prompt, SamplingParams, stream, exclude_input_in_output); ValueError on bad input."""
        from kvserve.model.generation_defaults import apply_cap
        from kvserve.protocol.sampling_params import SamplingParams

        prompt_value = _input(request, "text_input")
        if prompt_value is None:
            raise ValueError("text_input is required")
        prompt = _text(prompt_value)
        stream_value, exclude_value = _input(request, "stream"), _input(request, "exclude_input_in_output")
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
        return ids, prompt, params, stream, bool(exclude_value or False)

    async def _generate(self, request: Any, parsed: tuple[list[int], str, Any, bool, bool], sender: Any | None
                        ) -> Any:
        """Run one parsed request: its final response (None after streaming its pieces through `sender`). One
        text a sample; a streamed response holds each sample's new text (empty where it has none)."""
        ids, prompt, params, stream, exclude = parsed
        request_id = f"triton-{next(self._ids)}"
        texts = [""] * params.n
        try:
            async for update in self.engine.generate(request_id, ids, params, prompt=prompt):
                if _cancelled(request):
                    self.engine.abort(request_id)
                    break
                deltas = [""] * params.n
                for out in update.outputs:
                    texts[out.index], deltas[out.index] = out.text, out.text_delta
                if stream and sender is not None and any(deltas):
                    sender.send(_output(deltas))
        except ValueError as exc:  # refused by the engine (e.g. too long for max_model_len)
            return _output([], error=str(exc))
        return None if stream else _output([text if exclude else prompt + text for text in texts])

    async def _respond(self, request: Any, parsed: tuple[list[int], str, Any, bool, bool], sender: Any | None
                       ) -> Any:
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
            outcomes.append(self._run(self._respond(request, parsed, sender)))
        if self.decoupled:
            return None
        return [o.result() if isinstance(o, Future) else o for o in outcomes]

    def finalize(self) -> None:
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


def _read_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Sampling fields as vLLM's Triton backend reads them: a number or boolean given as a string is read as
    the field's type ("0.7", "128", "true"), `structured_outputs` may be a JSON string, and vLLM's older
    `guided_decoding` is its other name. ValueError for a string that is not of the field's type."""
    from kvserve.protocol.sampling_params import BOOL_FIELDS, FLOAT_FIELDS, INT_FIELDS

    out = dict(fields)
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
