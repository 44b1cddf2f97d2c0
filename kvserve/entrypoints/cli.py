"""`kvserve <command>`: generate (one prompt, offline), serve (the OpenAI-compatible server), chat / complete
(a terminal client of a running server), and the others below."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvserve import __version__
from kvserve.config import (
    KV_CACHE_DTYPES,
    ConfigError,
    human_readable_int,
    kv_cache_dtype_name,
    max_model_len_value,
    parse_kv_cache_memory_bytes,
)
from kvserve.entrypoints.vllm_compat import (
    add_ignored_engine_args,
    ignored_flag_notes,
    parse_args_or_refuse,
    positive_int,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _flag_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse `type=`: its ConfigError becomes argparse's error with the message kept (argparse
    would replace a ValueError's message with a bare "invalid value")."""
    def flag_value(text: str) -> T:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return flag_value


def port_number(text: str) -> int:
    """argparse `type=` for a TCP port to listen on: 0-65535 (0: one the system picks), refused as a usage error
    before anything starts (binding it would raise OverflowError)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


_token_count = _flag_type(human_readable_int)
_max_model_len = _flag_type(max_model_len_value)
_vllm_byte_count = _flag_type(parse_kv_cache_memory_bytes)
_kv_cache_dtype = _flag_type(kv_cache_dtype_name)


def add_engine_args(parser: argparse.ArgumentParser, data_parallel: bool = False) -> None:
    """Engine flags shared by every command that builds an engine (vLLM's names); `data_parallel`: the
    command runs replicas (`kvserve serve --data-parallel-size`)."""
    # Read before parsing (vllm_compat.with_config_file), which takes it out of the words parsed: here for --help.
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a YAML file of flags, as vLLM's: `port: 8000`, `enforce-eager: true`, "
                        "`served-model-name: [a, b]`; flags on the command line win over the file's")
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory, .gguf file, or the id of an HF repo already in the local Hugging Face "
                   "cache, e.g. Qwen/Qwen2.5-7B-Instruct (never downloaded; default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, or a repo id in the local HF cache (default: the model's)")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a repo id's snapshot in the local HF cache (default main); not "
                   "used with a local path")
    g.add_argument("--tokenizer-revision", default=None,
                   help="the same for --tokenizer given as a repo id (default: --revision)")
    g.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache directory to find repo ids in (default: $HF_HUB_CACHE, else "
                   "$HF_HOME/hub, else ~/.cache/huggingface/hub); kvserve never downloads into it")
    g.add_argument("--dtype", default="auto", help="auto (on a GPU the checkpoint's config dtype, float32 ones as bf16 where the GPU has it; "
                   "float32 on CPU), float32, float16, bfloat16")
    g.add_argument("--max-model-len", type=_max_model_len, default=None,
                   help="longest prompt + output in tokens, e.g. 8192, 32k (32,000) or 32K (32,768) (default: the "
                   "model's limit); auto or -1 (as vLLM): the model's limit if the KV cache holds one request that "
                   "long, else the longest length it holds (a warning says so)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once (default 256)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: requests run in arrival order; priority: by each request's `priority` (lower "
                        "first, then arrival), and when the KV cache runs short the lowest-priority running "
                        "request is preempted first")
    g.add_argument("--max-num-batched-tokens", type=_token_count, default=None,
                   help="token budget of one step, e.g. 8192 or 16k (default 8192)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    g.add_argument("--kv-cache-dtype", default="auto", type=_kv_cache_dtype, metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                   help="KV cache storage (vLLM's values, any case): auto, the model's dtype (bfloat16 / float16: "
                   "only that of the model); fp8 (= fp8_e4m3) or fp8_e5m2, one byte per value, twice the tokens in "
                   "the same memory (the checkpoint's KV scales where it has them, else 1.0; GPUs of compute capability 8.9 or later, or CPU)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size (per GPU), e.g. 2GiB, 512MiB or a number of bytes (k, m, g, KiB, MiB, GiB: "
                        "x1024; KB, MB, GB: x1000; any case); on a GPU it replaces the --gpu-memory-utilization "
                        "budget; on CPU the default is 1GiB")
    g.add_argument("--kv-cache-memory-bytes", type=_vllm_byte_count, default=None, metavar="BYTES",
                   help="vLLM's flag for the same size, read as vLLM reads it: the suffix's case matters, 8g = "
                        "8,000,000,000 bytes (k, m, g, t: x1000), 8G = 8 GiB (K, M, G, T: x1024); a size with a unit "
                        "name (8GiB, 500MB) is read as --kv-cache-memory reads it. Not with --kv-cache-memory")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory this instance may use (weights, activations, CUDA graphs, "
                   "KV cache): a per-instance budget, as vLLM's; refused at start when less is free (default 0.9)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over several steps' token budgets (on by default); with "
                   "--no-enable-chunked-prefill a prompt is prefilled in one step, so --max-num-batched-tokens "
                   "defaults to at least --max-model-len")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="KV cache blocks to allocate, instead of what the memory budget gives (tests of preemption "
                   "and capacity)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM command lines; kvserve never runs code from a checkpoint (it runs the "
                   "architectures it implements), so this changes nothing")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the GPU runs this one (default: on with a GPU)")
    g.add_argument("--cascade-attn", action=argparse.BooleanOptionalAction, default=True,
                   help="decode batches sharing a long prompt prefix attend to it once for all requests "
                   "(GPU; default on)")
    g.add_argument("--disable-cascade-attn", dest="cascade_attn", action="store_false",
                   help="vLLM's spelling of --no-cascade-attn")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="GPUs per replica: the model's heads and MLP split over this many ranks, one process and "
                   "one GPU each (ranks take the first N visible GPUs); on CPU, processes sharing the cores (default 1)")
    g.add_argument("--quantization", "-q", default=None,
                   help="awq, gptq, gguf or an fp8 checkpoint's format (fp8, compressed-tensors, fbgemm_fp8): read "
                   "from the checkpoint, so optional; a value the checkpoint does not hold is refused. fp8 on an "
                   "unquantized checkpoint: quantize its linear weights to fp8 (e4m3, per "
                   "output channel) at load (GPU: compute capability 8.9 or later); batches past 32 rows on a GPU, and "
                   "every batch with --dtype float32 or on CPU, quantize their activations per token too")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler's shared random generator (default 0)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="auto: the checkpoint's weights; safetensors / gguf: the same, checked to be an HF directory "
                   "/ a .gguf file; dummy: random weights of the model's shape (needs only config.json; for "
                   "benchmarks)")
    add_ignored_engine_args(parser, data_parallel)


def add_generation_config_args(parser: argparse.ArgumentParser) -> None:
    """Where the defaults of what a request leaves out come from (serve and triton-repo: `generate` has its
    own sampling flags)."""
    g = parser.add_argument_group("sampling defaults")
    g.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                   help="defaults for the sampling settings a request leaves out (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, max_tokens): auto, the model's generation_config.json; vllm, none; or a "
                   "directory holding a generation_config.json, whose max_new_tokens also caps every request")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="a JSON object applied over those defaults, e.g. '{\"temperature\": 0.5}' (null removes "
                   "a setting); its max_new_tokens caps every request's max_tokens, as in vLLM")


def engine_args_from(ns: argparse.Namespace) -> dict[str, object]:
    return {
        "model": ns.model,
        "tokenizer": ns.tokenizer,
        "revision": ns.revision,
        "tokenizer_revision": ns.tokenizer_revision,
        "download_dir": ns.download_dir,
        "dtype": ns.dtype,
        "max_model_len": ns.max_model_len,
        "max_num_seqs": ns.max_num_seqs,
        "scheduling_policy": ns.scheduling_policy,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "block_size": ns.block_size,
        "kv_cache_dtype": ns.kv_cache_dtype,
        "kv_cache_memory": ns.kv_cache_memory,
        "kv_cache_memory_bytes": ns.kv_cache_memory_bytes,
        "gpu_memory_utilization": ns.gpu_memory_utilization,
        "enable_prefix_caching": ns.enable_prefix_caching,
        "enforce_eager": ns.enforce_eager,
        "enable_chunked_prefill": ns.enable_chunked_prefill,
        "num_kv_blocks": ns.num_gpu_blocks_override,
        "async_scheduling": ns.async_scheduling,
        "cascade_attn": ns.cascade_attn,
        "tensor_parallel_size": ns.tensor_parallel_size,
        "quantization": ns.quantization,
        "seed": ns.seed,
        "device": ns.device,
        "load_format": ns.load_format,
        "generation_config": getattr(ns, "generation_config", "auto"),
        "override_generation_config": getattr(ns, "override_generation_config", None),
    }


def log_ignored_flags(ns: argparse.Namespace) -> None:
    """One warning per vLLM flag given that kvserve accepts and ignores."""
    for note in ignored_flag_notes(ns):
        logger.warning("%s", note)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    log_ignored_flags(ns)
    llm = LLM(**engine_args_from(ns))
    params = SamplingParams(
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        max_tokens=ns.max_tokens,
        seed=ns.sampling_seed,
        stop=ns.stop or None,
    )
    if ns.chat:
        outputs = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate([ns.prompt], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    # Imported here: the server pulls in FastAPI and uvicorn, which `kvserve generate` does not need.
    from kvserve.entrypoints.openai.api_server import run_server

    return run_server(ns)


def _cmd_bench(ns: argparse.Namespace) -> int:
    from kvserve.bench.cli_args import config_from_args
    from kvserve.bench.runner import run_cli

    return run_cli(config_from_args(ns))


def _cmd_triton_repo(ns: argparse.Namespace) -> int:
    import os

    from kvserve.config import EngineArgs
    from kvserve.integrations.triton.repo import with_resolved_paths, write_repository

    log_ignored_flags(ns)
    args = engine_args_from(ns)
    for key in ("model", "tokenizer", "generation_config", "download_dir"):  # Triton runs from its own directory
        if key == "generation_config" and args[key] in ("auto", "vllm"):  # its modes, not directories
            continue
        if args[key] is not None and (key == "download_dir" or os.path.exists(str(args[key]))):
            args[key] = os.path.abspath(str(args[key]))
    config = EngineArgs(**args).create_engine_config()  # refuse now what the engine would refuse in Triton
    if not ns.write_repo_ids:
        args = with_resolved_paths(args, config.model_config)
    try:
        gpus = [int(g) for g in ns.gpus.split(",")] if ns.gpus is not None else None
    except ValueError:
        raise ValueError(f"--gpus must list GPU ids separated by commas (e.g. 0,1), got {ns.gpus!r}") from None
    model_dir = write_repository(ns.out, ns.name, args, max_batch_size=ns.max_batch_size, decoupled=ns.decoupled,
                                 instances=ns.instances, gpus=gpus, device=ns.device or "cuda")
    print(f"wrote {model_dir} (config.pbtxt, 1/model.py, 1/kvserve.json); serve it with: "
          f"tritonserver --model-repository {os.path.abspath(ns.out)}")
    return 0


def _cmd_route(ns: argparse.Namespace) -> int:
    from kvserve import envs
    from kvserve.entrypoints.openai.cli_args import api_key_from
    from kvserve.router.app import RouterConfig, parse_backends, run_router

    backends = parse_backends(ns.backend)
    if ns.health_check_interval <= 0:
        raise ValueError(f"--health-check-interval must be positive, got {ns.health_check_interval}")
    if ns.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be positive, got {ns.request_timeout}")
    if ns.max_request_body_bytes <= 0:
        raise ValueError(f"--max-request-body-bytes must be positive, got {ns.max_request_body_bytes}")
    api_key, _ = api_key_from(ns.api_key, envs.KVSERVE_API_KEY, envs.VLLM_API_KEY)
    config = RouterConfig(health_check_interval_s=ns.health_check_interval, request_timeout_s=ns.request_timeout,
                          max_body_bytes=ns.max_request_body_bytes, api_key=api_key,
                          engine_metrics=ns.engine_metrics)
    return run_router(backends, ns.policy, ns.host, ns.port, config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM inference serving")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt offline and print the text")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass (default 1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: off)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    from kvserve.entrypoints.openai.cli_args import add_server_args

    serve = sub.add_parser(
        "serve",
        help="serve a model with an OpenAI-compatible HTTP API",
        description="Serve a model with an OpenAI-compatible API: /v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /version, /tokenize, /detokenize, /metrics.",
    )
    add_server_args(serve)
    serve.set_defaults(func=_cmd_serve)

    from kvserve.entrypoints.run_batch import add_run_batch_args

    batch = sub.add_parser(
        "run-batch",
        help="answer a file of requests in the OpenAI Batch format offline (vLLM's run-batch)",
        description="Answer every line of an OpenAI Batch file (/v1/chat/completions, /v1/completions, "
        "/v1/responses) as `kvserve serve` with the same flags would, the lines batched through one engine; "
        "one output line per request, in input order.",
    )
    add_run_batch_args(batch)

    from kvserve.bench.cli_args import add_bench_args

    bench = sub.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server and report latency and throughput",
        description="Load-test any OpenAI-compatible server (kvserve, vLLM, SGLang, TGI): TTFT, ITL, TPOT, "
        "end-to-end latency, throughput, goodput, errors by kind, server metrics.",
    )
    add_bench_args(bench)
    bench.set_defaults(func=_cmd_bench)

    repo = sub.add_parser(
        "triton-repo",
        help="write a Triton Inference Server model repository that serves a model with kvserve",
        description="Write <out>/<name>/{config.pbtxt, 1/model.py, 1/kvserve.json}: a Python-backend model whose "
        "engine is kvserve, with the engine flags given here. Inputs text_input, stream, sampling_parameters "
        "(JSON), exclude_input_in_output and vLLM's backend's optional return_* flags; output text_output (and "
        "the outputs those flags ask for).",
    )
    repo.add_argument("--name", required=True, help="the model's name in Triton")
    repo.add_argument("--out", default="models", help="the model repository directory (default: models)")
    repo.add_argument("--max-batch-size", type=int, default=0,
                      help="Triton's max_batch_size (default 0: no Triton batching; kvserve batches continuously anyway)")
    repo.add_argument("--decoupled", action=argparse.BooleanOptionalAction, default=True,
                      help="decoupled transaction policy: streamed responses (default on)")
    repo.add_argument("--instances", type=int, default=1,
                      help="model instances, each starting its own engine (default 1): on a GPU, engines on each GPU of "
                      "--gpus (Triton's count; together their --gpu-memory-utilization must fit in 1); on CPU, in "
                      "all. With --tensor-parallel-size > 1, one engine only")
    repo.add_argument("--gpus", default=None,
                      help="GPU ids (as tritonserver numbers them), e.g. 0 or 0,1: the GPUs that get --instances "
                      "engines each (default 0); with --tensor-parallel-size N, the N GPUs of the one engine "
                      "(default 0..N-1)")
    repo.add_argument("--write-repo-ids", action="store_true",
                      help="write a Hugging Face repo id given as --model or --tokenizer as given, with --revision, "
                      "--tokenizer-revision and --download-dir, to be looked up again in the Hugging Face cache "
                      "where Triton runs (default: the local snapshot paths they resolve to here)")
    add_engine_args(repo)
    add_generation_config_args(repo)
    # vLLM's engine flags for request logging, in command lines written for its backend: this backend logs no
    # requests, so either is taken and changes nothing
    repo.add_argument("--disable-log-requests", "--enable-log-requests", action="store_true",
                      dest="triton_log_requests_flag", help=argparse.SUPPRESS)
    repo.set_defaults(func=_cmd_triton_repo)

    from kvserve.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES
    from kvserve.router.policies import POLICIES

    route = sub.add_parser(
        "route",
        help="load-balance OpenAI-compatible servers (kvserve replicas) behind one address",
        description="Forward /v1/* to healthy backends, streaming their answers back; skip backends that are "
        "down or draining. /health, /metrics and /router/backends report the router's state.",
    )
    route.add_argument("--backend", action="append", required=True, metavar="URL",
                       help="a backend's address, e.g. http://10.0.0.5:8000, without /v1 (the router adds each request's "
                       "path); repeat it, or give a comma-separated list")
    route.add_argument("--policy", choices=POLICIES, default="prefix",
                       help="prefix: requests whose prompts start alike share a backend (its prefix cache), with no "
                       "backend above 1.25x the average load; least-requests: the least busy backend; round-robin "
                       "(default: prefix)")
    route.add_argument("--host", default="127.0.0.1", help="listening address (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    route.add_argument("--port", type=port_number, default=8080, help="listening port (default 8080)")
    route.add_argument("--health-check-interval", type=float, default=5.0, metavar="SECONDS",
                       help="how often each backend's /health is polled (default 5)")
    route.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="the most a backend may stay silent, before its answer or between two chunks of it "
                       "(default 600: a long non-streamed completion sends nothing until done)")
    route.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       metavar="BYTES",
                       help="larger request bodies get 413, as from kvserve serve's flag of that name (default "
                       "32 MiB, its default); give the backends' own limit where they were started with a larger one")
    route.add_argument("--api-key", default=None,
                       help="the backends' API key, sent as `Authorization: Bearer <key>` with the router's own "
                       "polls of /health and /v1/models, which it needs to learn the models of backends started "
                       "with --api-key; clients' requests are forwarded with their own Authorization (default: "
                       "$KVSERVE_API_KEY when set, where set empty means no key; else $VLLM_API_KEY; none)")
    route.add_argument("--engine-metrics", action="store_true",
                       help="/metrics also carries each backend's own series, labelled engine=\"<i>\" by the "
                       "backend's position in --backend (as kvserve serve --data-parallel-size serves them), so "
                       "one scrape of the router (kvserve bench's, say) sees the engines; a backend that does "
                       "not answer within 2 s is left out of that scrape")
    route.set_defaults(func=_cmd_route)

    from kvserve.entrypoints.chat_cli import add_client_args, run_chat, run_complete

    chat = sub.add_parser(
        "chat", help="chat with a running OpenAI-compatible server from the terminal (vLLM's `vllm chat`)",
        description="Send messages to <url>/chat/completions and print the streamed answers: one with -q, else "
        "a line at a time from stdin until end of input (Ctrl-D), keeping the whole conversation.",
    )
    add_client_args(chat, chat=True)
    chat.set_defaults(func=run_chat)

    complete = sub.add_parser(
        "complete", help="complete prompts on a running OpenAI-compatible server (vLLM's `vllm complete`)",
        description="Send prompts to <url>/completions and print the streamed completions: one with -q, else "
        "each line read from stdin as a prompt of its own, until end of input (Ctrl-D).",
    )
    add_client_args(complete, chat=False)
    complete.set_defaults(func=run_complete)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    # vLLM's flags are refused by name only where vLLM's engine flags belong (bench and route are other tools).
    ns = parse_args_or_refuse(parser, argv, {command: f"kvserve {command}" for command in
                                             ("generate", "serve", "run-batch", "triton-repo")})
    if ns.command == "serve":  # the flags after `serve`: the replicas' (--data-parallel-size)
        args = list(sys.argv[1:] if argv is None else argv)
        ns.serve_args = args[args.index("serve") + 1:]
    try:
        return int(ns.func(ns))
    except ValueError as e:  # ConfigError, ModelLoadError, bad sampling params, rejected requests
        print(f"kvserve {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
