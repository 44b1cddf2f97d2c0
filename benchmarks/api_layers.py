"""What each layer between a client and the engine adds to TTFT: the same prompts, one request at a time, sent
to the engine core in this process, through `AsyncLLM` (the engine core in its own process, as the server runs
it), and through `kvserve serve` over HTTP (a raw socket, one request per connection; prompts as token ids,
and as text, which the server tokenizes). Random weights at a model shape of `common.py`; the served directory
carries SmolLM2's tokenizer (`write_served_model_dir`).

Each layer starts its own engine (one at a time: each takes its share of GPU memory), sends `--warmup`
requests, then `--requests` timed ones; TTFT is from handing the request over to its first token (the first
SSE chunk for HTTP). Prints the medians and writes api_layers.json under --out.

  python benchmarks/api_layers.py --model qwen2.5-7b --prompt-len 1024 --out /tmp/out
  python benchmarks/api_layers.py --model tiny --device cpu       # on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_result, write_served_model_dir  # noqa: E402


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[tuple[list[int], str]]:
    """(ids, text) pairs of exactly --prompt-len tokens each, where the server's tokenization of the text gives
    the ids: every layer then runs the same token counts (random ids do not survive a decode and encode).
    Twice the prompts a layer sends: the HTTP text run takes the second half, so that it finds none of its
    prompts in the prefix cache after the ids run."""
    rng = random.Random(args.seed)
    n = args.prompt_len
    out: list[tuple[list[int], str]] = []
    while len(out) < 2 * (args.warmup + args.requests):
        ids = [rng.randrange(100, len(tokenizer)) for _ in range(n)]
        for _ in range(10):
            text = tokenizer.decode(ids)
            ids = list(tokenizer(text)["input_ids"])[:n]
            if len(ids) == n and list(tokenizer(tokenizer.decode(ids))["input_ids"]) == ids:
                out.append((ids, tokenizer.decode(ids)))
                break
    return out


def _engine_args(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {"load_format": "dummy"}
    if args.device == "cpu":
        extra.update(device="cpu", dtype="float32", max_model_len=args.prompt_len + 64, kv_cache_memory="256MiB")
    return extra


def layer_core(args: argparse.Namespace, model_dir: str, prompts: list[tuple[list[int], str]]) -> list[float]:
    from kvserve.config import EngineArgs
    from kvserve.engine.engine_core import EngineCore
    from kvserve.protocol.engine import EngineCoreRequest
    from kvserve.protocol.sampling_params import SamplingParams

    core = EngineCore(EngineArgs(model=model_dir, **_engine_args(args)).create_engine_config())
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    times = []
    for i, (ids, _) in enumerate(prompts[: len(prompts) // 2]):
        start = time.perf_counter()
        core.add_request(EngineCoreRequest(req_id=f"c{i}", prompt_token_ids=ids, sampling_params=params,
                                           max_tokens=args.max_tokens))
        first = None
        while core.has_unfinished_requests():
            result = core.step()
            if first is None and any(o.new_token_ids for o in result.outputs):
                first = time.perf_counter()
        assert first is not None
        times.append((first - start) * 1e3)
    return times[args.warmup:]


def layer_async(args: argparse.Namespace, model_dir: str, prompts: list[tuple[list[int], str]]) -> list[float]:
    from kvserve.config import EngineArgs
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.protocol.sampling_params import SamplingParams

    async def run() -> list[float]:
        engine = AsyncLLM(EngineArgs(model=model_dir, **_engine_args(args)).create_engine_config())
        await engine.start()
        times = []
        try:
            for i, (ids, _) in enumerate(prompts[: len(prompts) // 2]):
                params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
                start = time.perf_counter()
                first = None
                async for _ in engine.generate(f"a{i}", ids, params):
                    if first is None:
                        first = time.perf_counter()
                assert first is not None
                times.append((first - start) * 1e3)
        finally:
            await engine.shutdown()
        return times[args.warmup:]

    return asyncio.run(run())


def _http_ttft(port: int, body: bytes) -> float:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        conn.sendall(head + body)
        received = b""
        first = None
        while True:
            data = conn.recv(65536)
            if not data:
                break
            received += data
            if first is None and b"data: " in received:
                first = time.perf_counter()
        if first is None or b"[DONE]" not in received:
            raise RuntimeError(f"no complete stream: {received[:300]!r}")
        return (first - start) * 1e3


def layer_http(args: argparse.Namespace, model_dir: str, prompts: list[tuple[list[int], str]]) -> dict[str, list[float]]:
    port = args.port
    cmd = [sys.executable, "-m", "kvserve", "serve", model_dir, "--load-format", "dummy", "--served-model-name", "m",
           "--port", str(port), "--disable-log-requests", "--disable-uvicorn-access-log"]
    if args.device == "cpu":
        cmd += ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(args.prompt_len + 64),
                "--kv-cache-memory", "256MiB"]
    log = open(Path(args.out) / "api_layers_server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if conn.recv(100).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start; see api_layers_server.log")
            time.sleep(0.5)
        out: dict[str, list[float]] = {}
        for kind in ("ids", "text"):
            times = []
            half = len(prompts) // 2
            for ids, text in (prompts[:half] if kind == "ids" else prompts[half:]):
                prompt: Any = ids if kind == "ids" else text
                body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
                                   "ignore_eos": True, "temperature": 0}).encode()
                times.append(_http_ttft(port, body))
            out[kind] = times[args.warmup:]
        return out
    finally:
        server.terminate()
        server.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--layer", choices=["core", "async"], help=argparse.SUPPRESS)  # one layer, in a child
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.layer:  # a child process: one engine, its times as JSON on stdout
        from transformers import AutoTokenizer

        prompts = _prompts(args, AutoTokenizer.from_pretrained(args.model_dir))
        fn = layer_core if args.layer == "core" else layer_async
        print(json.dumps(fn(args, args.model_dir, prompts)))
        return 0

    from transformers import AutoTokenizer

    model_dir = write_served_model_dir(args.model)
    prompts = _prompts(args, AutoTokenizer.from_pretrained(model_dir))
    results: dict[str, list[float]] = {}
    for layer in ("core", "async"):
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--layer", layer, "--model-dir", model_dir],
                               capture_output=True, text=True, check=False)
        if child.returncode:
            print(child.stderr[-3000:], file=sys.stderr)
            return 1
        results[layer] = json.loads(child.stdout.strip().splitlines()[-1])
    for kind, times in layer_http(args, model_dir, prompts).items():
        results[f"http ({kind})"] = times
    labels = {"core": "engine core, this process", "async": "AsyncLLM (engine core process)",
              "http (ids)": "HTTP, prompt as token ids", "http (text)": "HTTP, prompt as text"}
    print(f"TTFT, {args.prompt_len}-token prompts one at a time, median of {args.requests} (ms):")
    for key, times in results.items():
        print(f"  {labels[key]:34s} {statistics.median(times):8.2f}   min {min(times):8.2f}")
    settings = {k: v for k, v in vars(args).items() if k not in ("layer", "model_dir")}
    write_result(Path(args.out), "api_layers", settings, results, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
