"""`kvserve bench` flags (vLLM's `bench serve` names where one exists) and their translation to BenchConfig."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from kvserve import envs
from kvserve.bench.config import APIS, GOODPUT_KEYS, LATENCY_KEYS, BenchConfig, BenchConfigError, LoadShape
from kvserve.bench.datasets import DATASETS, LANGUAGES, LENGTH_DISTS, DatasetConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_ENDPOINT = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}/v1/chat/completions"
# vLLM's `bench serve` default route, taken when the server is given as vLLM gives it (--base-url/--host/--port).
VLLM_DEFAULT_PATH = "/v1/completions"
DEFAULT_DURATION_S = 60.0
# vLLM's `bench serve --backend` values of the APIs kvserve bench sends.
VLLM_BACKENDS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}
# vLLM's `bench serve --dataset-name` values that name one of kvserve's datasets.
VLLM_DATASETS = {"custom": "file"}
# vLLM's length flags of its prefix_repetition and sonnet datasets: (flag, the DatasetConfig setting it gives,
# vLLM's default). Used with their dataset only; with another they are ignored, as vLLM ignores them.
VLLM_DATASET_LENGTHS: dict[str, tuple[tuple[str, str, int], ...]] = {
    "prefix_repetition": (("--prefix-repetition-prefix-len", "prefix_len", 256),
                          ("--prefix-repetition-suffix-len", "input_len", 256),
                          ("--prefix-repetition-num-prefixes", "num_prefixes", 10),
                          ("--prefix-repetition-output-len", "output_len", 128)),
    "sonnet": (("--sonnet-input-len", "input_len", 550), ("--sonnet-output-len", "output_len", 150),
               ("--sonnet-prefix-len", "prefix_len", 200)),
}


def _positive_list(kind: type, flag: str) -> Callable[[str], list[float]]:
    def parse(text: str) -> list[float]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a comma-separated list, got {text!r}") from None
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} takes positive values, got {text!r}")
        return values

    return parse


def _temperature(text: str) -> float | None:
    if text.strip().lower() == "server":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature takes a number or 'server', got {text!r}") from None


def _percentile_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--metric-percentiles takes numbers separated by commas, got {text!r}"
                                         ) from None


def _percentile_metrics(text: str | None) -> tuple[str, ...]:
    if text is None:
        return LATENCY_KEYS
    keys = (key.strip().lower() for key in text.split(",") if key.strip())
    return tuple(dict.fromkeys(_VLLM_LATENCY_NAMES.get(key, key) for key in keys))


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--endpoint", default=None,
                        help=f"full URL of .../v1/chat/completions, .../v1/completions or .../v1/responses "
                        f"(default {DEFAULT_ENDPOINT}); or, as in vLLM's bench serve, the route's path (e.g. "
                        f"/v1/completions, the default with --base-url, --host or --port) on that server")
    target.add_argument("--base-url", default=None,
                        help="with --endpoint a path: the server's URL, e.g. http://host:8000 (vLLM's flag)")
    target.add_argument("--host", default=None,
                        help=f"with --endpoint a path and no --base-url: the server's host (default {DEFAULT_HOST})")
    target.add_argument("--port", type=int, default=None,
                        help=f"with --endpoint a path and no --base-url: the server's port (default {DEFAULT_PORT})")
    target.add_argument("--api", choices=APIS, default=None,
                        help="request format (default: chat when the endpoint ends in chat/completions, responses "
                        "when it ends in responses)")
    target.add_argument("--backend", choices=tuple(VLLM_BACKENDS), default=None,
                        help="vLLM's flag: vllm or openai = --api completions, openai-chat = --api chat")
    target.add_argument("--model", default=None,
                        help="model name to send (default: the first of GET /v1/models); a model directory, "
                        ".gguf or repo id in the local HF cache is also the default --tokenizer, as in vLLM")
    target.add_argument("--served-model-name", default=None,
                        help="vLLM's flag: the name to send instead of --model (which then names the tokenizer)")
    target.add_argument("--api-key", default=None,
                        help="sent as 'Authorization: Bearer KEY' (default: the OPENAI_API_KEY environment variable, "
                        "as the OpenAI client and vLLM's benchmark read it, sent to the endpoint only, not to /metrics; none when unset "
                        "or empty; --api-key '' sends none)")
    target.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds one request may take before it counts as a timeout (default 600)")
    target.add_argument("--ready-check-timeout-sec", type=int, default=0, metavar="N",
                        help="vLLM's flag: wait up to N seconds for the server to come up (its /v1/models to "
                        "answer), saying so every few seconds, before anything is sent; then fail (status 2) "
                        "(default 0: check once, fail at once; vLLM's default is 600)")

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: N requests in flight, each sent when another ends (default 1)")
    load.add_argument("--request-rate", type=float, default=None,
                      help="open loop: requests/s arriving as a Poisson process ('inf': all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="open loop: gamma shape of the arrival gaps; 1 = Poisson (the default), <1 burstier, >1 smoother")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="open loop: most requests in flight; later arrivals wait (the wait is reported); "
                      "without --request-rate, as in vLLM (whose rate defaults to inf): --concurrency N")
    load.add_argument("--duration", type=float, default=None,
                      help=f"seconds to issue requests for (default {DEFAULT_DURATION_S:g} unless --num-prompts)")
    load.add_argument("--num-prompts", type=int, default=None,
                      help="requests to send (with --duration: whichever ends first)")
    load.add_argument("--drain-timeout", type=float, default=60.0,
                      help="with --duration: cancel requests still running this many seconds after it "
                           "(counted as 'cancelled'; default 60)")
    load.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted (default 0)")
    load.add_argument("--sweep-concurrency", type=_positive_list(int, "--sweep-concurrency"), default=None,
                      metavar="N,N,...", help="one closed-loop run per concurrency, one table row each")
    load.add_argument("--sweep-rate", type=_positive_list(float, "--sweep-rate"), default=None,
                      metavar="R,R,...", help="one open-loop run per request rate, one table row each")

    work = parser.add_argument_group("workload")
    work.add_argument("--dataset", "--dataset-name", dest="dataset", choices=(*DATASETS, *VLLM_DATASETS),
                      default="random",
                      help="random prose, shared-prefix (prefix caching), file (JSONL; vLLM's name: custom), "
                      "sharegpt (a ShareGPT JSON file, sampled as vLLM samples it), or vLLM's prefix_repetition, "
                      "sonnet (a text file of lines) and burstgpt (the BurstGPT CSV) (default random)")
    work.add_argument("--dataset-path", default=None,
                      help='--dataset file: JSONL with {"prompt": ...} or {"messages": [...]}, optional '
                      '"output_len"; sharegpt, sonnet, burstgpt: their file')
    for name, flags in VLLM_DATASET_LENGTHS.items():
        for flag, _setting, default in flags:
            work.add_argument(flag, type=int, default=None, metavar="N",
                              help=f"--dataset {name} (vLLM's flag): {_VLLM_LENGTH_HELP[flag]} (default {default})")
    work.add_argument("--burstgpt-model", default=None, metavar="MODEL",
                      help="--dataset burstgpt: the CSV's Model whose rows are sent (default GPT-4, as vLLM)")
    work.add_argument("--skip-chat-template", action="store_true",
                      help="accepted for vLLM's command lines: kvserve bench sends the sonnet prompts without a "
                      "chat template to the completions API in any case")
    work.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="--dataset sharegpt: every request's max_tokens (default: the token count of the "
                      "conversation's answer)")
    work.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=256,
                      help="prompt tokens (the median for --input-dist chat) (default 256)")
    work.add_argument("--input-dist", choices=LENGTH_DISTS, default="fixed",
                      help="prompt length distribution; chat = long-tailed like real chat traffic (default fixed)")
    work.add_argument("--max-tokens", "--output-len", "--random-output-len", "--custom-output-len", dest="max_tokens",
                      type=int, default=128,
                      help="max_tokens of each request (the median for --output-dist chat) (default 128)")
    work.add_argument("--output-dist", choices=LENGTH_DISTS, default="fixed",
                      help="max_tokens distribution (default fixed)")
    work.add_argument("--range-ratio", type=float, default=0.25,
                      help="uniform: +-ratio around the length; normal: std = ratio x length (default 0.25)")
    work.add_argument("--random-range-ratio", type=float, default=None,
                      help="vLLM's flag: prompt and output lengths uniform on length x [1 - R, 1 + R] "
                      "(--range-ratio R with uniform input and output distributions; 0: fixed)")
    work.add_argument("--language", choices=LANGUAGES, default="mixed",
                      help="prompt text: English, Chinese, or mixed (70%% English) (default mixed)")
    work.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens (default 512)")
    work.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts (default 1)")
    work.add_argument("--prefix-reuse", type=float, default=1.0,
                      help="shared-prefix: fraction of requests that reuse a shared prompt (default 1.0)")
    work.add_argument("--max-model-len", type=int, default=None,
                      help="clip drawn lengths so prompt + output fit the server's context (default: no clip)")
    work.add_argument("--ignore-eos", action="store_true",
                      help="ask the server to generate max_tokens even past end-of-sequence (vLLM extension)")
    sampling = parser.add_argument_group("sampling (vLLM's flags, sent in every request)")
    sampling.add_argument("--temperature", type=_temperature, default=0.0,
                          help="sampling temperature (default 0: greedy, as in vLLM's bench; 'server': send none, "
                          "the server's default)")
    sampling.add_argument("--top-p", type=float, default=None, help="top_p, in (0, 1] (default: not sent)")
    sampling.add_argument("--top-k", type=int, default=None,
                          help="top_k: a positive integer, or -1/0 for no limit (default: not sent)")
    sampling.add_argument("--min-p", type=float, default=None, help="min_p, in [0, 1] (default: not sent)")
    sampling.add_argument("--repetition-penalty", type=float, default=None,
                          help="repetition_penalty, > 0; 1 = none (default: not sent)")
    sampling.add_argument("--presence-penalty", type=float, default=None,
                          help="presence_penalty, in [-2, 2] (default: not sent)")
    sampling.add_argument("--frequency-penalty", type=float, default=None,
                          help="frequency_penalty, in [-2, 2] (default: not sent)")
    sampling.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                          help="vLLM's flag: a JSON object whose keys go into every request body, after (over) "
                          "the flags' values, e.g. '{\"chat_template_kwargs\": {\"enable_thinking\": false}}' "
                          "(not stream, messages, prompt or input)")
    work.add_argument("--seed", type=int, default=0, help="seed of lengths, texts and arrival times (default 0)")
    work.add_argument("--tokenizer", default=None,
                      help="local tokenizer (HF directory, .gguf, or a repo id in the local HF cache) for prompt "
                           "lengths and for counting tokens when the server sends no usage (default: --model's where it "
                           "names a local model, else the default model's)")
    work.add_argument("--trust-remote-code", action="store_true",
                      help="accepted for vLLM's command lines; the local tokenizers run no remote code")

    out = parser.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help=f"SLOs for goodput, keys {', '.join(GOODPUT_KEYS)} in ms (vLLM's e2el = e2e), "
                     "e.g. ttft:500 itl:50")
    out.add_argument("--percentile-metrics", default=None, metavar="ttft,tpot,itl,e2el",
                     help="latencies the report shows (vLLM's flag; e2el = e2e) (default all four)")
    out.add_argument("--metric-percentiles", type=_percentile_list, default=(), metavar="P,P,...",
                     help="percentiles to report besides the median, P90, P95 and P99, e.g. 99.9 (vLLM's flag; "
                     "also in the JSON, as p99.9 of each latency)")
    out.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                     help="write the configuration, summary and every request's record as JSON")
    out.add_argument("--save-result", action="store_true",
                     help="vLLM's flag: --json into --result-dir (default .) as --result-filename (default "
                     "kvserve-bench-YYYYMMDD-HHMMSS.json)")
    out.add_argument("--result-dir", default=None, help="with --save-result: the JSON's directory (default .)")
    out.add_argument("--result-filename", default=None, help="with --save-result: the JSON's file name")
    out.add_argument("--append-result", action="store_true",
                     help="vLLM's flag: save as --save-result does, but append the JSON to the file as one more "
                     "line (JSON Lines) instead of replacing it")
    out.add_argument("--save-detailed", action="store_true",
                     help="vLLM's flag: a single run's JSON also gets vLLM's per-request lists (input_lens, "
                     "output_lens, ttfts, itls, generated_texts, errors); the answers' texts are kept for it")
    out.add_argument("--label", default=None,
                     help="vLLM's flag: the JSON's 'label' key, and the default --result-filename's prefix")
    out.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE",
                     help="vLLM's flag: extra top-level keys of the JSON (values as strings)")
    out.add_argument("--request-id-prefix", default=None,
                     help="vLLM's flag: send each request an x-request-id header PREFIX + its index (later "
                     "sweep points and the warm-up add '<point>-' or 'warmup-' before the index); kept in each "
                     "record (default: bench-<8 random hex digits>-, new for each command, as vLLM's default)")
    out.add_argument("--plot", dest="plot_path", default=None, metavar="FILE.png",
                     help="write latency CDFs, throughput over time and server metrics as a PNG")
    out.add_argument("--compare", dest="compare_path", default=None, metavar="OLD.json",
                     help="print the change of each metric against an earlier --json result")
    out.add_argument("--server-metrics", action=argparse.BooleanOptionalAction, default=True,
                     help="sample the server's Prometheus /metrics during the run (default on)")
    out.add_argument("--metrics-url", default=None, help="where /metrics is (default: the endpoint's host)")
    out.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics samples (default 1)")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="live progress bar (default: when stderr is a terminal)")
    out.add_argument("--disable-tqdm", dest="progress", action="store_false",
                     help="vLLM's name of --no-progress")


_VLLM_LENGTH_HELP = {
    "--prefix-repetition-prefix-len": "tokens of each shared prefix",
    "--prefix-repetition-suffix-len": "tokens of each prompt's own suffix",
    "--prefix-repetition-num-prefixes": "distinct prefixes, the --num-prompts spread evenly over them",
    "--prefix-repetition-output-len": "max_tokens of each request",
    "--sonnet-input-len": "most tokens of each prompt",
    "--sonnet-output-len": "max_tokens of each request",
    "--sonnet-prefix-len": "most tokens of the instruction and the file's first lines that every prompt starts with",
}


def _vllm_dataset_settings(ns: argparse.Namespace, name: str) -> dict[str, Any]:
    """The DatasetConfig settings of vLLM's prefix_repetition and sonnet flags (their lengths are fixed, the
    others' length flags not used), and of burstgpt's --burstgpt-model."""
    settings: dict[str, Any] = {}
    if name == "burstgpt" and ns.burstgpt_model is not None:
        settings["burstgpt_model"] = ns.burstgpt_model
    if name not in VLLM_DATASET_LENGTHS:
        return settings
    settings.update(input_dist="fixed", output_dist="fixed")
    for flag, setting, default in VLLM_DATASET_LENGTHS[name]:
        value = getattr(ns, flag.lstrip("-").replace("-", "_"))
        if value is not None and value < 1:
            raise BenchConfigError(f"{flag} must be at least 1, got {value}")
        settings[setting] = default if value is None else value
    if name == "prefix_repetition":
        settings["num_prompts"] = ns.num_prompts
    return settings


# vLLM's `bench serve` names the end-to-end latency `e2el` (in --goodput and --percentile-metrics).
_VLLM_LATENCY_NAMES = {"e2el": "e2e"}


def _parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        try:
            slos[_VLLM_LATENCY_NAMES.get(key, key)] = float(value)
        except ValueError:
            raise BenchConfigError(f"--goodput takes KEY:MS pairs, got {item!r}") from None
        if not sep:
            raise BenchConfigError(f"--goodput takes KEY:MS pairs, got {item!r}")
    return slos


def _shapes(ns: argparse.Namespace) -> tuple[LoadShape, ...]:
    duration = ns.duration
    if duration is None and ns.num_prompts is None:
        duration = DEFAULT_DURATION_S
    common = {"duration_s": duration, "num_prompts": ns.num_prompts}
    open_loop = {"burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency}
    if ns.sweep_concurrency and ns.sweep_rate:
        raise BenchConfigError("give --sweep-concurrency or --sweep-rate, not both")
    if ns.sweep_concurrency:
        if ns.request_rate is not None or ns.concurrency is not None:
            raise BenchConfigError("--sweep-concurrency replaces --concurrency and --request-rate")
        return tuple(LoadShape(concurrency=int(c), **common) for c in ns.sweep_concurrency)
    if ns.sweep_rate:
        if ns.request_rate is not None or ns.concurrency is not None:
            raise BenchConfigError("--sweep-rate replaces --request-rate and --concurrency")
        return tuple(LoadShape(request_rate=r, **open_loop, **common) for r in ns.sweep_rate)
    if ns.request_rate is not None:
        if ns.concurrency is not None:
            raise BenchConfigError("--concurrency is closed loop, --request-rate open loop: give one "
                                   "(cap an open loop with --max-concurrency)")
        return (LoadShape(request_rate=ns.request_rate, **open_loop, **common),)
    if ns.burstiness != 1.0:
        raise BenchConfigError("--burstiness shapes an open loop: add --request-rate")
    if ns.max_concurrency is not None:
        if ns.concurrency is not None:
            raise BenchConfigError("give --concurrency or --max-concurrency, not both")
        # vLLM's `bench serve --max-concurrency N` (its request rate defaults to inf): every request
        # arrives at once and N are in flight, each sent when another ends, which is the closed loop of N.
        return (LoadShape(concurrency=ns.max_concurrency, **common),)
    return (LoadShape(concurrency=ns.concurrency if ns.concurrency is not None else 1, **common),)


def _endpoint(ns: argparse.Namespace) -> str:
    """--endpoint as a full URL, or (vLLM's way) a path on --base-url, else on http://--host:--port."""
    server_given = ns.base_url is not None or ns.host is not None or ns.port is not None
    if ns.endpoint is None and not server_given:
        return DEFAULT_ENDPOINT
    path = ns.endpoint if ns.endpoint is not None else VLLM_DEFAULT_PATH
    if not path.startswith("/"):
        if server_given:
            raise BenchConfigError(f"--endpoint {path!r} is a full URL: --base-url, --host and --port go with an "
                                   "--endpoint path such as /v1/completions")
        return path
    if ns.base_url is not None:
        if ns.host is not None or ns.port is not None:
            raise BenchConfigError("give --base-url or --host/--port, not both")
        return ns.base_url.rstrip("/") + path
    return f"http://{ns.host or DEFAULT_HOST}:{ns.port if ns.port is not None else DEFAULT_PORT}{path}"


def _lengths(ns: argparse.Namespace) -> tuple[str, str, float]:
    """(input_dist, output_dist, range_ratio), vLLM's --random-range-ratio read as uniform lengths."""
    ratio = ns.random_range_ratio
    if ratio is None:
        return ns.input_dist, ns.output_dist, ns.range_ratio
    if not 0.0 <= ratio < 1.0:  # (vLLM's range too; before 0.9 its ratio meant [ratio x L, L], default 1)
        raise BenchConfigError(f"--random-range-ratio must be in [0, 1), got {ratio:g}")
    if ns.input_dist != "fixed" or ns.output_dist != "fixed":
        raise BenchConfigError("--random-range-ratio makes both lengths uniform: give it or --input-dist/"
                               "--output-dist, not both")
    dist = "uniform" if ratio != 0 else "fixed"
    return dist, dist, ratio


def _json_path(ns: argparse.Namespace) -> str | None:
    """--json, or vLLM's --save-result/--append-result [--result-dir D] [--result-filename F] (either of these
    saves too)."""
    if not (ns.save_result or ns.append_result or ns.result_dir is not None or ns.result_filename is not None):
        return ns.json_path
    if ns.json_path is not None and not ns.append_result:
        raise BenchConfigError("give --json FILE or --save-result/--result-dir/--result-filename, not both")
    if ns.json_path is not None:  # --json FILE --append-result: append to FILE
        if ns.save_result or ns.result_dir is not None or ns.result_filename is not None:
            raise BenchConfigError("give --json FILE or --save-result/--result-dir/--result-filename, not both")
        return ns.json_path
    prefix = ns.label if ns.label else "kvserve-bench"
    name = ns.result_filename or f"{prefix}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    return os.path.join(ns.result_dir, name) if ns.result_dir is not None else name


def _api(ns: argparse.Namespace, endpoint: str) -> str | None:
    """--api, or the API of vLLM's --backend, which must be the endpoint's when its route names one."""
    if ns.backend is None:
        return ns.api
    api = VLLM_BACKENDS[ns.backend]
    if ns.api is not None and ns.api != api:
        raise BenchConfigError(f"--backend {ns.backend} sends the {api} API, --api {ns.api}: give one")
    path = urlsplit(endpoint).path.rstrip("/")
    routed = "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") else None
    if routed is not None and routed != api:
        raise BenchConfigError(f"--backend {ns.backend} sends the {api} API, but the endpoint {endpoint} is the "
                               f"{routed} route: give --endpoint /v1/{'chat/' if api == 'chat' else ''}completions")
    return api


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


def _request_id_prefix(given: str | None) -> str:
    """vLLM's default: a prefix new for each command, so two runs' ids never collide on one server."""
    return given if given is not None else f"bench-{uuid.uuid4().hex[:8]}-"


def _metadata(items: list[str] | None) -> dict[str, str]:
    """vLLM's --metadata KEY=VALUE ...: split at the first '=', both sides stripped."""
    metadata: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchConfigError(f"--metadata takes KEY=VALUE pairs, got {item!r}")
        metadata[key.strip()] = value.strip()
    return metadata


def _tokenizer(ns: argparse.Namespace) -> str | None:
    """--tokenizer, else --model where it names a local model (vLLM's benchmark takes the model's tokenizer)."""
    if ns.tokenizer is not None or ns.model is None:
        return ns.tokenizer
    from kvserve.model.paths import names_a_model

    return ns.model if names_a_model(ns.model) else None


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    input_dist, output_dist, range_ratio = _lengths(ns)
    endpoint = _endpoint(ns)
    name = VLLM_DATASETS.get(ns.dataset, ns.dataset)
    settings: dict[str, Any] = dict(
        name=name, input_len=ns.input_len, input_dist=input_dist,
        output_len=ns.max_tokens, output_dist=output_dist, range_ratio=range_ratio, language=ns.language,
        seed=ns.seed,
        max_model_len=ns.max_model_len, prefix_len=ns.prefix_len, num_prefixes=ns.num_prefixes,
        prefix_reuse=ns.prefix_reuse, path=ns.dataset_path, sharegpt_output_len=ns.sharegpt_output_len,
    )
    settings.update(_vllm_dataset_settings(ns, name))
    dataset = DatasetConfig(**settings)
    return BenchConfig(
        endpoint=endpoint, shapes=_shapes(ns), dataset=dataset, api=_api(ns, endpoint),
        model=ns.served_model_name if ns.served_model_name is not None else ns.model,
        api_key=ns.api_key if ns.api_key is not None else envs.OPENAI_API_KEY,
        api_key_from_env=ns.api_key is None and envs.OPENAI_API_KEY is not None, tokenizer=_tokenizer(ns),
        warmup=ns.warmup, request_timeout_s=ns.request_timeout, ready_check_timeout_s=ns.ready_check_timeout_sec,
        drain_timeout_s=ns.drain_timeout,
        ignore_eos=ns.ignore_eos, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty, presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty, extra_body=ns.extra_body or {}, goodput_ms=_parse_goodput(ns.goodput),
        server_metrics=ns.server_metrics, metrics_url=ns.metrics_url, metrics_interval_s=ns.metrics_interval,
        percentile_metrics=_percentile_metrics(ns.percentile_metrics), metric_percentiles=ns.metric_percentiles,
        json_path=_json_path(ns), backend=ns.backend, label=ns.label, metadata=_metadata(ns.metadata),
        save_detailed=ns.save_detailed, append_result=ns.append_result, request_id_prefix=_request_id_prefix(ns.request_id_prefix),
        plot_path=ns.plot_path, compare_path=ns.compare_path, progress=ns.progress,
    )
