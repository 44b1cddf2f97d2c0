"""`kvserve chat` and `kvserve complete`: talk to a running OpenAI-compatible server from a terminal (vLLM's
`vllm chat` / `vllm complete`, same flags).

A small synchronous client on the standard library's http.client: these commands import neither torch nor
the server's packages, so they start in a fraction of a second. Answers are streamed (`stream: true`) and
printed piece by piece as the server's events arrive. Failures end as one line on stderr (no traceback): in
interactive mode the turn is dropped and the next prompt comes; otherwise the exit status is 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

DEFAULT_URL = "http://localhost:8000/v1"
# Reaching the server is quick or it is not there; an answer may take as long as the model takes (the
# OpenAI client's default read timeout is 600 s too).
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0
# The exit status of a command stopped by Ctrl-C outside the interactive prompt (128 + SIGINT).
INTERRUPTED = 130


class ClientError(Exception):
    """A failure shown to the user as one line."""


def add_client_args(parser: argparse.ArgumentParser, chat: bool) -> None:
    """The flags of `kvserve chat` (chat=True) or `kvserve complete`."""
    from kvserve.entrypoints.vllm_compat import positive_int

    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"base URL of the running OpenAI-compatible server (default {DEFAULT_URL})")
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="the model to ask (default: the first one the server's GET <url>/models lists)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, as vLLM's client; "
                        "else the server's variables as `kvserve serve` reads them: $KVSERVE_API_KEY, where set "
                        "empty means no key, then $VLLM_API_KEY; else no key)")
    if chat:
        parser.add_argument("--system-prompt", default=None, metavar="TEXT",
                            help="a system message put first in the conversation")
    what = "message" if chat else "prompt"
    parser.add_argument("-q", "--quick", default=None, metavar=what.upper(),
                        help=f"send this one {what}, print the answer and exit")
    parser.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                        help="most tokens of each answer (default: none sent, the server's default)")


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key; else OPENAI_API_KEY (what vLLM's `vllm chat` sends); else the key a `kvserve serve` started in
    this environment requires, found as `kvserve route` finds it (KVSERVE_API_KEY, set empty: none; then
    VLLM_API_KEY); else None (no Authorization header)."""
    from kvserve import envs
    from kvserve.entrypoints.openai.cli_args import api_key_from

    if flag:
        return flag
    if envs.OPENAI_API_KEY:
        return envs.OPENAI_API_KEY
    return api_key_from(None, envs.KVSERVE_API_KEY, envs.VLLM_API_KEY)[0]


def error_message(body: bytes) -> str:
    """The message of an error answer: OpenAI's `{"error": {"message": ...}}`, else a framework's `detail` or
    `message`, else the start of the body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:300] or "(empty body)"
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("error", "detail", "message"):
            if isinstance(payload.get(key), str) and payload[key]:
                return payload[key]
    return text[:300]


class Client:
    """Requests to one server's OpenAI API at `url` (its base, e.g. http://localhost:8000/v1)."""

    def __init__(self, url: str, api_key: str | None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"--url must be an http(s) URL such as {DEFAULT_URL}, got {url!r}")
        self.url = url.rstrip("/")
        self._parts = parts
        self._base_path = parts.path.rstrip("/")
        self.api_key = api_key

    def _hint(self) -> str:
        return "" if self._base_path.endswith("/v1") else f" (--url is the API's base, e.g. {DEFAULT_URL})"

    @contextmanager
    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Iterator[http.client.HTTPResponse]:
        """The response to `method` `path` (under the base URL) with a 2xx status; ClientError for anything else."""
        p = self._parts
        try:
            port = p.port
        except ValueError:
            raise ClientError(f"--url has a bad port: {self.url!r}") from None
        conn_type = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        conn = conn_type(p.hostname, port, timeout=CONNECT_TIMEOUT_S)  # type: ignore[arg-type]
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise ClientError(f"cannot reach the server at {self.url} ({exc.strerror or exc}): is it "
                                  "running? Start one with `kvserve serve MODEL`, or give its address with --url") from None
            if conn.sock is not None:
                conn.sock.settimeout(READ_TIMEOUT_S)
            headers = {"Accept": "application/json, text/event-stream", "User-Agent": "kvserve-cli"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            url = self.url + path
            try:
                conn.request(method, self._base_path + path, body=data, headers=headers)
                response = conn.getresponse()
            except TimeoutError:
                raise ClientError(f"{url} did not answer within {READ_TIMEOUT_S:.0f} s") from None
            except (OSError, http.client.HTTPException) as exc:
                raise ClientError(f"{url} did not answer ({exc!r})") from None
            if not 200 <= response.status < 300:
                try:
                    message = error_message(response.read())
                except (OSError, http.client.HTTPException):
                    message = response.reason
                hint = self._hint() if response.status == 404 else ""
                raise ClientError(f"{method} {url}: HTTP {response.status}: {message}{hint}")
            yield response
        finally:
            conn.close()

    def first_model(self) -> str:
        """The id of the first model GET /models lists."""
        with self.request("GET", "/models") as response:
            try:
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:
                raise ClientError(f"{self.url}/models: the answer broke off ({exc!r})") from None
        try:
            ids = [str(model["id"]) for model in json.loads(raw)["data"]]
        except (ValueError, KeyError, TypeError):
            raise ClientError(f"{self.url}/models did not answer with a list of models{self._hint()}") from None
        if not ids:
            raise ClientError(f"the server at {self.url} lists no models; name one with --model-name")
        return ids[0]


def _event_text(payload: str, chat: bool) -> tuple[str, str] | None:
    """What one SSE `data:` payload adds to the answer: (its reasoning, its text); None at `[DONE]`. A chat
    delta's reasoning is vLLM's `reasoning` field, or the older `reasoning_content` (servers may send both, with
    the same text)."""
    if payload.strip() == "[DONE]":
        return None
    try:
        event = json.loads(payload)
    except ValueError:
        raise ClientError(f"the server sent an event that is not JSON: {payload[:200]!r}") from None
    if not isinstance(event, dict):
        raise ClientError(f"the server sent an unexpected event: {payload[:200]!r}")
    if event.get("error") is not None:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise ClientError(f"the server reported an error in the answer: {message or error}")
    reasoning: list[str] = []
    pieces: list[str] = []
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        if chat:
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning")
            if not isinstance(thought, str):
                thought = delta.get("reasoning_content")
            if isinstance(thought, str):
                reasoning.append(thought)
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str):
            pieces.append(text)
    return "".join(reasoning), "".join(pieces)


def stream_text(response: http.client.HTTPResponse, chat: bool) -> Iterator[tuple[str, str]]:
    """The answer's (reasoning, text) pieces, in order, from a server-sent event stream, up to `data: [DONE]`."""
    data: list[str] = []
    try:
        while True:
            raw = response.readline()
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line:  # a blank line ends an event (the end of the body too)
                if data:
                    piece = _event_text("\n".join(data), chat)
                    if piece is None:
                        return
                    data = []
                    if piece[0] or piece[1]:
                        yield piece
                if not raw:
                    break
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    except TimeoutError:
        raise ClientError(f"the server sent nothing for {READ_TIMEOUT_S:.0f} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise ClientError(f"the answer broke off ({exc!r})") from None
    raise ClientError("the answer ended before the server's `data: [DONE]` (the stream broke off)")


def answer_pieces(response: http.client.HTTPResponse, chat: bool) -> Iterator[tuple[str, str]]:
    """`stream_text`'s pieces, or, from a server that answered with one JSON body although `stream` was asked
    (some proxies and servers ignore it), that answer's (reasoning, text) at once."""
    if not (response.getheader("Content-Type") or "").lower().startswith("application/json"):
        yield from stream_text(response, chat)
        return
    try:
        raw = response.read()
    except TimeoutError:
        raise ClientError(f"the server sent nothing for {READ_TIMEOUT_S:.0f} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise ClientError(f"the answer broke off ({exc!r})") from None
    try:
        choice = json.loads(raw)["choices"][0]
        if chat:
            message = choice["message"]
            thought = message.get("reasoning")
            if not isinstance(thought, str):
                thought = message.get("reasoning_content")
            text = message.get("content")
        else:
            thought, text = None, choice["text"]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise ClientError(f"the server answered with JSON that is no completion: {raw[:200]!r}") from None
    yield (thought if isinstance(thought, str) else ""), (text if isinstance(text, str) else "")


def print_answer(client: Client, path: str, body: dict[str, Any], chat: bool, out: TextIO,
                 thoughts: TextIO | None = None) -> str:
    """Stream one answer to `out` as it arrives, ending with a newline; returns its text. A reasoning model's
    thinking (a server started with a reasoning parser) goes to `thoughts` (stderr), after "thinking: ": seen
    while it comes, kept out of `out` (what a script reads) and out of the conversation."""
    pieces: list[str] = []
    thinking = False
    try:
        with client.request("POST", path, body) as response:
            for thought, piece in answer_pieces(response, chat):
                if thought and thoughts is not None:
                    if not thinking:
                        thoughts.write("thinking: ")
                        thinking = True
                    thoughts.write(thought)
                    thoughts.flush()
                if piece:
                    if thinking and thoughts is not None:
                        thoughts.write("\n")
                        thoughts.flush()
                        thinking = False
                    out.write(piece)
                    out.flush()
                    pieces.append(piece)
    finally:
        if thinking and thoughts is not None:
            thoughts.write("\n")
            thoughts.flush()
        if pieces:  # the error or the interruption shows on a line of its own
            out.write("\n")
            out.flush()
    if not pieces:
        out.write("\n")
        out.flush()
    return "".join(pieces)


def _run(ns: argparse.Namespace, chat: bool) -> int:
    command = "kvserve chat" if chat else "kvserve complete"
    out = sys.stdout

    def show(exc: ClientError) -> None:
        print(f"{command}: error: {exc}", file=sys.stderr, flush=True)

    try:
        client = Client(ns.url, resolve_api_key(ns.api_key))
        model = ns.model_name or client.first_model()
    except ClientError as exc:
        show(exc)
        return 1
    except KeyboardInterrupt:
        return INTERRUPTED
    conversation: list[dict[str, str]] = []
    if chat and ns.system_prompt is not None:
        conversation.append({"role": "system", "content": ns.system_prompt})

    def turn(text: str) -> None:
        """One request and its printed answer; the conversation grows only once the answer is complete."""
        body: dict[str, Any] = {"model": model, "stream": True}
        if chat:
            user = {"role": "user", "content": text}
            body["messages"] = [*conversation, user]
        else:
            body["prompt"] = text
        if ns.max_tokens is not None:
            body["max_tokens"] = ns.max_tokens
        reply = print_answer(client, "/chat/completions" if chat else "/completions", body, chat, out, sys.stderr)
        if chat:
            conversation.extend([user, {"role": "assistant", "content": reply}])

    if ns.quick is not None:
        try:
            turn(ns.quick)
        except ClientError as exc:
            show(exc)
            return 1
        except KeyboardInterrupt:
            return INTERRUPTED
        return 0

    print(f"Using model: {model}")
    print("Please enter a message for the chat model:" if chat else "Please enter prompt to complete:",
          flush=True)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: the session ends
            print()
            return 0
        if not text.strip():
            continue
        try:
            turn(text)
        except ClientError as exc:
            show(exc)
        except KeyboardInterrupt:  # Ctrl-C during an answer: that answer stops, the turn is dropped
            print(f"{command}: answer stopped", file=sys.stderr, flush=True)


def _run_quietly(ns: argparse.Namespace, chat: bool) -> int:
    try:
        return _run(ns, chat)
    except BrokenPipeError:  # stdout closed early (`| head`): stop without a traceback, here or at exit
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def run_chat(ns: argparse.Namespace) -> int:
    return _run_quietly(ns, chat=True)


def run_complete(ns: argparse.Namespace) -> int:
    return _run_quietly(ns, chat=False)
