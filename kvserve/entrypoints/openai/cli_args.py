"""Flags of `kvserve serve` / `python -m kvserve.entrypoints.openai.api_server` (vLLM's names).

Kept free of heavy imports: `kvserve --help` builds this parser.
"""

from __future__ import annotations

import argparse
import json
import shlex
import ssl
from collections.abc import Callable

from kvserve import envs
from kvserve.entrypoints.cli import add_engine_args, add_generation_config_args, engine_args_from, port_number
from kvserve.entrypoints.openai.api_key import api_key_problem  # (a light module)
from kvserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS  # (a light module)
from kvserve.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS  # (a light module)
from kvserve.entrypoints.vllm_compat import add_ignored_server_args, positive_int
from kvserve.model.paths import names_a_model  # (a light module)
from kvserve.protocol.sampling_params import MAX_LOGPROBS  # (a light module)

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
DEFAULT_HOST = "127.0.0.1"  # this machine only (vLLM's default is every interface)
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of the server: the model (positional or --model), engine flags, HTTP flags."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF model directory, .gguf file, or the id of an HF repo already in the local Hugging "
                             "Face cache (same as --model; default: SmolLM2-135M-Instruct GGUF)")
    add_engine_args(parser, data_parallel=True)
    add_generation_config_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--served-model-name", nargs="+", type=_served_name, default=None, metavar="NAME",
                   help="model name(s) clients use in the `model` field; the first is reported in responses and "
                        "metrics (default: the model argument as given, as vLLM; without one, the default model's file "
                        "name). It takes every word after it: give the model first")
    g.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on /v1/* (default: $KVSERVE_API_KEY when set, where "
                        "set empty means no key; else $VLLM_API_KEY; none = open)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="serve HTTPS: the private key file (PEM), with --ssl-certfile")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS: the certificate chain file (PEM), with --ssl-keyfile")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="with HTTPS: CA certificates (PEM) that client certificates are checked against (see "
                        "--ssl-cert-reqs)")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2], metavar="{0,1,2}",
                   help="with HTTPS, client certificates: 0 not asked for (default), 1 checked when sent, 2 required "
                        "(Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED, as vLLM)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed response ends with a usage chunk, also when the request's stream_options "
                        "do not ask for one (non-streamed responses always carry usage)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json")
    g.add_argument("--chat-template", default=None,
                   help="chat template replacing the tokenizer's: a file path or the Jinja template text")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": the model decides when to call the request\'s tools, and its tool '
                        "calls come back as the message's tool_calls (needs --tool-call-parser)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how tool calls are written in the model's text: hermes = <tool_call>{JSON}</tool_call> "
                        "(Qwen2, Qwen2.5, Qwen3, Hermes 2 Pro); llama3_json = the reply is "
                        '{"name": ..., "parameters": {...}}, optionally after <|python_tag|>, calls joined by ; '
                        "(Llama 3.1/3.2/3.3 JSON tool calling; llama4_json is another name for it); pythonic = "
                        "the reply is a Python list of calls, [f(a=1), g()], for Llama 4 maybe within "
                        "<|python_start|> and <|python_end|> (Llama 3.2, Llama 4; llama4_pythonic is another name "
                        "for it)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="return a thinking model's reasoning (the text before </think>) as the chat message's "
                        "`reasoning` and only the answer as its `content`: deepseek_r1 (DeepSeek-R1, QwQ) or qwen3 "
                        "(Qwen3; chat_template_kwargs enable_thinking false: all content). Requests with "
                        "structured output are not read for reasoning (the grammar shapes the whole reply)")
    g.add_argument("--response-role", default="assistant", type=_response_role, metavar="ROLE",
                   help="the role of chat replies, when the request's add_generation_prompt is true (the default); "
                        "with add_generation_prompt false, a reply takes the role of the request's last message "
                        "(default assistant)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries an X-Request-Id header: the request's own X-Request-Id, else a new "
                        "random id")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs show tokens as "token_id:<id>" unless a request sets return_tokens_as_token_ids')
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not log each request's id and parameters (prompts are logged only at DEBUG level)")
    g.add_argument("--enable-log-requests", dest="disable_log_requests", action="store_false",
                   help="log each request's id and parameters (the default here; vLLM's spelling of it)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput and cache log lines (/metrics is unaffected)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log each HTTP request line")
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                   help="log level of uvicorn, the HTTP server (default info)")
    g.add_argument("--metrics-compat", default="vllm", choices=["vllm", "none"],
                   help="vllm (default): every metric is also exported under vLLM's `vllm:` names (incl. "
                        "vllm:gpu_cache_usage_perc), so vLLM dashboards, alerts and queries work unchanged; none: "
                        "the `kvserve:` names only (half the series)")
    g.add_argument("--max-request-body-bytes", type=_non_negative(int), default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413 (default 32 MiB)")
    g.add_argument("--timeout-keep-alive", type=_non_negative(int), default=5, help="seconds an idle HTTP connection is kept open (default 5)")
    g.add_argument("--shutdown-timeout", type=_non_negative(float), default=60.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before exiting anyway (default 60)")
    g.add_argument("--max-logprobs", type=_max_logprobs, default=MAX_LOGPROBS, metavar="N",
                   help=f"the most logprobs (top_logprobs, or completions' logprobs) a request may ask for, 0 to "
                        f"{MAX_LOGPROBS} (default {MAX_LOGPROBS}, also the engine's limit)")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS: origins browsers may call the API from, a JSON list (default ["*"])')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS: allowed methods, a JSON list (default ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS: allowed request headers, a JSON list (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    g.add_argument("--root-path", type=_root_path, default="",
                   help="the path prefix a proxy serves this server under and strips (ASGI root_path), e.g. /llm")
    g.add_argument("--api-server-count", "-asc", type=positive_int, default=1, metavar="N",
                   help="HTTP API processes sharing the port and the engine (default 1). One process handles "
                        "HTTP, tokenization and detokenization on one core; a small model's engine at hundreds "
                        "of streams can outrun it")
    add_ignored_server_args(parser)


def _served_name(text: str) -> str:
    """argparse `type=` for a served model name: not blank, which no client could ask for by name."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"a served model name cannot be empty, got {text!r}")
    return text


def _non_negative(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """argparse `type=` for a size or a number of seconds: `kind`, at least 0 (a negative one started the server,
    which then refused every request body, or closed connections and drained at once)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'whole ' if kind is int else ''}number, got {text!r}") from None
        if not value >= 0:  # NaN too
            raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
        return value

    return parse


def _max_logprobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_LOGPROBS}] (the engine's limit), got {value}")
    return value


def _response_role(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _root_path(text: str) -> str:
    """'/llm/' -> '/llm'; '/' -> '' (no prefix). A prefix must start with '/'."""
    value = text.rstrip("/")
    if value and not value.startswith("/"):
        raise argparse.ArgumentTypeError(f"must start with '/', got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected a JSON list such as \'["*"]\', got {text!r}') from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def swallowed_model(ns: argparse.Namespace) -> str | None:
    """The error for `kvserve serve --served-model-name qwen /models/x`, else None: argparse gives every word
    after --served-model-name (nargs="+") to it, so no model is given and the default model would be served
    under names one of which is the model meant. Only when no model is given (a served name may well look
    like a repo id: vLLM's default is the model argument) and a name reads as a model (`names_a_model`).
    --served-model-name is the server's only flag taking several words, so the only one that can do this."""
    if ns.model_tag is not None or ns.model is not None or not ns.served_model_name:
        return None
    names: list[str] = list(ns.served_model_name)
    model = next((name for name in names if names_a_model(name, ns.revision, ns.download_dir)), None)
    if model is None:
        return None
    rest = [name for name in names if name != model]
    fixed = shlex.join(["kvserve", "serve", model, *(["--served-model-name", *rest] if rest else [])])
    return (f"no model given, and --served-model-name took {model!r}, which is a model: every word after "
            f"--served-model-name is a served name, so the default model would be served as "
            f"{', '.join(repr(name) for name in names)}. Put the model first: {fixed}")


def server_engine_args(ns: argparse.Namespace) -> dict[str, object]:
    """EngineArgs keyword arguments from parsed server flags (the positional model wins over --model)."""
    swallowed = swallowed_model(ns)
    if swallowed is not None:
        raise ValueError(swallowed)
    token = getattr(ns, "hf_token", None)  # vLLM's --hf-token [TOKEN] takes the word after it, if any
    if ns.model_tag is None and ns.model is None and isinstance(token, str) and names_a_model(
            token, ns.revision, ns.download_dir):
        raise ValueError(f"no model given, and --hf-token took {token!r}, which is a model, as its token: the "
                         f"default model would be served. Put the model first: kvserve serve {shlex.quote(token)} "
                         "--hf-token ...")
    if ns.model_tag is not None and ns.model is not None and ns.model_tag != ns.model:
        raise ValueError(f"the model is given twice: {ns.model_tag!r} (positional) and --model {ns.model!r}")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                         f"{', '.join(TOOL_CALL_PARSERS)})")
    if ns.enable_reasoning and ns.reasoning_parser is None:
        raise ValueError("--enable-reasoning needs --reasoning-parser (one of: "
                         f"{', '.join(REASONING_PARSERS)}), which alone turns reasoning on")
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if (ns.ssl_ca_certs is not None or ns.ssl_cert_reqs != ssl.CERT_NONE) and ns.ssl_certfile is None:
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile (HTTPS)")
    if ns.ssl_cert_reqs != ssl.CERT_NONE and ns.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs, the CA certificates that client "
                         "certificates are checked against")
    check_ssl_files(ns.ssl_certfile, ns.ssl_keyfile, ns.ssl_ca_certs)
    api_key_from(ns.api_key, envs.KVSERVE_API_KEY, envs.VLLM_API_KEY)  # a key no client can send, refused now
    if envs.KVSERVE_ENABLE_RESPONSES_API_STORE and getattr(ns, "api_server_count", 1) > 1:
        raise ValueError("the Responses API's store (KVSERVE_ENABLE_RESPONSES_API_STORE) keeps responses in one API "
                         "process's memory: with --api-server-count > 1 a follow-up (previous_response_id) would "
                         "reach another process; serve with one API process, or turn the store off")
    args = engine_args_from(ns)
    args["model"] = ns.model_tag if ns.model_tag is not None else ns.model
    args["served_model_name"] = ns.served_model_name[0] if ns.served_model_name else None
    args["chat_template"] = ns.chat_template
    return args


def check_ssl_files(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    """ValueError naming the flags when the HTTPS files cannot be loaded (missing, unreadable, not PEM, a key
    that does not match the certificate): uvicorn loads them only once the model is loaded, and failed there
    with a traceback after the server had said it was serving."""
    if certfile is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except OSError as exc:  # ssl.SSLError included
        raise ValueError(f"cannot load the HTTPS certificate and key (--ssl-certfile {certfile}, --ssl-keyfile "
                         f"{keyfile}): {exc.strerror or exc}") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except OSError as exc:
            raise ValueError(f"cannot load the CA certificates (--ssl-ca-certs {ca_certs}): "
                             f"{exc.strerror or exc}") from None


def api_key_from(flag: str | None, kvserve_env: str | None, vllm_env: str | None) -> tuple[str | None, str]:
    """(the API key, None for an open API; a log line saying where that came from, never the key). The first
    source that is set decides: --api-key (empty counts as not given, as in vLLM), then KVSERVE_API_KEY (None:
    unset; set empty: no key, so a VLLM_API_KEY left in a vLLM deployment's environment cannot add one), then
    VLLM_API_KEY (empty: no key, as in vLLM). ValueError for a key no client can send (`api_key_problem`), naming
    its source."""
    if flag:
        return _usable_key(flag, "--api-key"), "API key from --api-key: /v1/* requires it"
    if kvserve_env is not None:
        if kvserve_env:
            return _usable_key(kvserve_env, "KVSERVE_API_KEY"), "API key from KVSERVE_API_KEY: /v1/* requires it"
        ignored = " (VLLM_API_KEY, also set, is not read)" if vllm_env else ""
        return None, f"no API key: KVSERVE_API_KEY is set empty{ignored}; /v1/* is open"
    if vllm_env:
        return (_usable_key(vllm_env, "VLLM_API_KEY"),
                "API key from VLLM_API_KEY (no --api-key, KVSERVE_API_KEY unset): /v1/* requires it")
    return None, "no API key (no --api-key, KVSERVE_API_KEY or VLLM_API_KEY): /v1/* is open"


def _usable_key(key: str, source: str) -> str:
    problem = api_key_problem(key)
    if problem is not None:
        raise ValueError(f"{source}: {problem}")
    return key


def make_arg_parser(prog: str = "kvserve serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model with an OpenAI-compatible API (chat, completions, models, tokenize, metrics).",
    )
    add_server_args(parser)
    return parser
