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
  `{"temperature": 0.7, "max_tokens": 128}`;
* `exclude_input_in_output` (BOOL, optional): without streaming, the output is the prompt followed by the
  generated text unless this is true.

Output `text_output` (STRING). A bad request (no prompt, bad JSON or parameters, a prompt too long for the
model) gets an error response with the reason; other requests are unaffected. A request cancelled by its
client is aborted in the engine.
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
        if args.get("model_instance_kind") == "GPU":
            # The engine process (spawned below) takes the GPU Triton gave this instance.
            devices = instance_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                               int(args.get("model_instance_device_id", 0)),
                                               int(engine_args.get("tensor_parallel_size", 1)))
            if devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = devices
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
        raw = _input(request, "sampling_parameters")
        fields: dict[str, Any] = {}
        if raw is not None and _text(raw).strip():
            try:
                fields = json.loads(_text(raw))
            except ValueError as exc:
                raise ValueError(f"sampling_parameters is not JSON: {exc}") from None
            if not isinstance(fields, dict):
                raise ValueError("sampling_parameters must be a JSON object")
        try:
            # What the request leaves out: the model's generation config, then SamplingParams' defaults.
            given = {key: value for key, value in fields.items() if value is not None}  # null: left out
            params = SamplingParams(**{**self.sampling_defaults, **given})
            # The generation config's cap lowers what a request asks for, as on the server (vLLM's rule).
            params = apply_cap(params, self.max_tokens_cap)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 (a field of the wrong type: TypeError, AttributeError, ...)
            raise ValueError(f"sampling_parameters: {type(exc).__name__}: {exc}") from None
        stream = bool(_input(request, "stream") or False)
        exclude = bool(_input(request, "exclude_input_in_output") or False)
        if stream and not self.decoupled:
            raise ValueError("stream=true needs the decoupled transaction policy (kvserve triton-repo --decoupled)")
        ids = self.engine.input_processor.tokenize(prompt).prompt_token_ids
        return ids, prompt, params, stream, exclude

    async def _generate(self, request: Any, parsed: tuple[list[int], str, Any, bool, bool], sender: Any | None
                        ) -> Any:
        """Run one parsed request: its final response (None after streaming its pieces through `sender`)."""
        ids, prompt, params, stream, exclude = parsed
        request_id = f"triton-{next(self._ids)}"
        text = ""
        try:
            async for update in self.engine.generate(request_id, ids, params, prompt=prompt):
                if _cancelled(request):
                    self.engine.abort(request_id)
                    break
                out = update.outputs[0]
                text = out.text
                if stream and sender is not None and out.text_delta:
                    sender.send(_output([out.text_delta]))
        except ValueError as exc:  # refused by the engine (e.g. too long for max_model_len)
            return _output([], error=str(exc))
        return None if stream else _output([text if exclude else prompt + text])

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


def _cancelled(request: Any) -> bool:
    is_cancelled = getattr(request, "is_cancelled", None)
    return bool(is_cancelled()) if callable(is_cancelled) else False
