"""What `kvserve bench`'s streaming client costs in CPU per streamed chunk, against a paced stand-in server.

A server process streams kvserve-shaped completion chunks (chunked transfer encoding, one SSE event per
token) to every open stream once per `--period-ms`, `--tokens` per answer, then the usage chunk and
`[DONE]`. The client side is `kvserve.bench.client.StreamClient` with `--concurrency` requests in flight
(closed loop, `--requests` in all), in this process. Printed: chunks a second, the client's CPU (share of
one core and µs per chunk), TTFT and ITL as the client saw them (the server's pace is the truth: an ITL P99
well above the period is the client reading late), and the TCP connections the server saw (the pool should
reuse `--concurrency` of them).

The kvserve package is the one on the import path, so an older client can be measured with
PYTHONPATH pointing at a copy of it (the device script does that for its A/B).

    python benchmarks/bench_client_cpu.py --concurrency 50 --requests 200 --out /tmp/client_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

# Not benchmarks/common.py: it puts this checkout's kvserve first on the import path, and this script
# measures whichever kvserve the path gives.


def _commit() -> str:
    if os.environ.get("KVSERVE_BENCH_COMMIT"):
        return os.environ["KVSERVE_BENCH_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _serve(port: int, period_s: float, tokens: int, ready: Any, counts: Any) -> None:
    """The paced server (a process of its own, so that its CPU is not the client's)."""
    base = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m"}
    chunks = [_chunked(_event({**base, "choices": [{"index": 0, "text": f" w{i}", "logprobs": None,
                                                     "finish_reason": None}]})) for i in range(tokens)]
    end = _event({**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8}})
    last = _chunked(end + b"data: [DONE]\n\n") + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    streams: dict[int, list[Any]] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts[0] += 1
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in request.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                writer.write(head)
                done = asyncio.get_running_loop().create_future()
                streams[id(done)] = [0, writer, done]
                await done
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def pace() -> None:
        while True:
            await asyncio.sleep(period_s)
            for key, stream in list(streams.items()):
                sent, writer, done = stream
                if sent < tokens:
                    writer.write(chunks[sent])
                    stream[0] = sent + 1
                else:
                    writer.write(last)
                    del streams[key]
                    done.set_result(None)

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        asyncio.get_running_loop().create_task(pace())
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def _client(port: int, concurrency: int, requests: int, tokens: int) -> dict[str, Any]:
    from kvserve.bench.client import ClientSettings, StreamClient
    from kvserve.bench.datasets import BenchRequest

    client = StreamClient(ClientSettings(f"http://127.0.0.1:{port}/v1/completions", "completions", "m",
                                         max_connections=concurrency))
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Any:
        async with slots:
            return await client.send(BenchRequest(i, ({"role": "user", "content": "hi"},), tokens), 0.0)

    try:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        records = await asyncio.gather(*(one(i) for i in range(requests)))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        await client.aclose()
    ok = [r for r in records if r.success]
    chunks = sum(len(r.itl_s) + 1 for r in ok)
    itl = sorted(gap for r in ok for gap in r.itl_s)
    return {
        "requests": requests, "completed": len(ok), "chunks": chunks, "wall_s": wall, "cpu_s": cpu,
        "chunks_per_s": chunks / wall, "cpu_percent": 100.0 * cpu / wall, "cpu_us_per_chunk": 1e6 * cpu / chunks,
        "ttft_p50_ms": 1e3 * statistics.median(r.ttft_s for r in ok),
        "itl_p50_ms": 1e3 * itl[len(itl) // 2], "itl_p99_ms": 1e3 * itl[int(0.99 * (len(itl) - 1))],
        "itl_max_ms": 1e3 * itl[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=256, help="chunks per answer")
    parser.add_argument("--period-ms", type=float, default=5.0, help="the server's pace per stream")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--label", default="", help="a name for this client in the table and the JSON")
    parser.add_argument("--out", type=Path, default=None, help="JSON file")
    args = parser.parse_args()

    import kvserve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    ready, counts = ctx.Event(), ctx.Array("l", 1)
    server = ctx.Process(target=_serve, args=(port, args.period_ms / 1e3, args.tokens, ready, counts), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the stand-in server did not start")
        runs = []
        for _ in range(args.repeats):
            before = counts[0]
            run = asyncio.run(_client(port, args.concurrency, args.requests, args.tokens))
            run["connections"] = counts[0] - before
            runs.append(run)
    finally:
        server.terminate()
    label = args.label or kvserve.__file__
    print(f"client: {label}; {args.concurrency} streams, {args.tokens} chunks each, one every "
          f"{args.period_ms:g} ms per stream")
    print(f"{'run':>3} {'chunks/s':>9} {'CPU %':>6} {'µs/chunk':>9} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'ITL max':>8} {'conns':>6}")
    for i, r in enumerate(runs):
        print(f"{i + 1:>3} {r['chunks_per_s']:>9.0f} {r['cpu_percent']:>6.1f} {r['cpu_us_per_chunk']:>9.1f} "
              f"{r['ttft_p50_ms']:>9.2f} {r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f} {r['itl_max_ms']:>8.2f} "
              f"{r['connections']:>6}")
    if args.out:
        meta = {"benchmark": "bench_client_cpu", "commit": _commit(), "host": platform.node(),
                "cpu": platform.processor(), "python": platform.python_version(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "settings": {k: v for k, v in vars(args).items() if k != "out"}, "client": label,
                "kvserve_path": kvserve.__file__, "runs": runs}
        args.out.write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
