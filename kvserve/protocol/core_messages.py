"""Messages between the API process and the engine-core process (msgspec, msgpack on ZMQ sockets).

Two one-way channels, one message per ZMQ frame:

* API -> engine (``EngineInput``): `AddRequests`, `AbortRequests`, `ClientGone`, `Shutdown`.
* engine -> API (``EngineMessage``): `EngineReady` once after start-up (model loaded, KV cache
  allocated), then `EngineOutputs` after every step (and after an add/abort that did not lead to a step,
  so gauges such as KV usage stay current), `RequestFailed` when the core rejects a request, and
  `EngineDead` (start-up failed, or a step raised) right before the process exits non-zero.

Each message is a tagged `msgspec.Struct`, so one decoder per direction reads any of them.
"""

from __future__ import annotations

import msgspec

from kvserve.core.outputs import EngineCoreOutput, SchedulerStats
from kvserve.protocol.engine import EngineCoreRequest


class AddRequests(msgspec.Struct, tag="add"):
    """Queue requests; the samples of one n>1 request travel together. `client_index`: which API process
    sent them (its outputs go back to that process only; 0 when there is one)."""

    requests: list[EngineCoreRequest]
    client_index: int = 0


class AbortRequests(msgspec.Struct, tag="abort"):
    """Abort requests in any state (frees their KV blocks); unknown or finished ids, and those another API
    process added, are ignored."""

    req_ids: list[str]
    client_index: int = 0


class ClientGone(msgspec.Struct, tag="client_gone"):
    """API process `client_index` has exited (sent by the first one): abort its requests, send it nothing more."""

    client_index: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Leave the busy loop and exit 0 (unfinished requests are dropped)."""


EngineInput = AddRequests | AbortRequests | ClientGone | Shutdown


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded and the KV cache allocated."""

    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: list[int]
    # The model's vocabulary (its embedding's rows), which the core refuses prompt and allowed token ids past:
    # the API process refuses them first (a stream's 200 must not go out for a request the core will refuse),
    # tokenizers can hold more ids than the model.
    vocab_size: int
    startup_s: float
    capacity_description: str  # KVCapacity.describe(): blocks, tokens, concurrency at max_model_len


class EngineOutputs(msgspec.Struct, tag="outputs"):
    """What one step (or one batch of adds/aborts) produced, with the scheduler's gauges after it."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float  # time.time() in the engine process when the message was made


class RequestFailed(msgspec.Struct, tag="failed"):
    """The core refused a request (`RequestRejected` / ValueError); `param` names the cause."""

    req_id: str
    message: str
    param: str | None = None


class EngineDead(msgspec.Struct, tag="dead"):
    """The engine core cannot go on (start-up failed or a step raised); the process exits next."""

    message: str


EngineMessage = EngineReady | EngineOutputs | RequestFailed | EngineDead


def make_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInput)


class UnreadableRequests(msgspec.Struct):
    """Not sent: what the engine core's receiver makes of an `AddRequests` frame it cannot decode (a field
    of a type the API process should have refused), so that each of its requests gets an error instead of
    no answer."""

    req_ids: list[str]
    client_index: int
    error: str


def unreadable_requests(frame: bytes | memoryview, error: Exception) -> UnreadableRequests | None:
    """The request ids and sender of an `AddRequests` frame that fails to decode, read without the types;
    None when the frame is not one."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, dict) or raw.get("type") != "add" or not isinstance(raw.get("requests"), list):
        return None
    req_ids = [r["req_id"] for r in raw["requests"] if isinstance(r, dict) and isinstance(r.get("req_id"), str)]
    client = raw.get("client_index", 0)
    if not req_ids or not isinstance(client, int):
        return None
    return UnreadableRequests(req_ids, client, str(error))


def make_message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineMessage)
