"""What a benchmark produced, and its JSON file (`--json FILE`): the configuration, then per run the summary,
every request's record and the server-metrics samples. `read_json(write_json(x))` gives back `x`."""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from kvserve.bench.client import RequestRecord
from kvserve.bench.server_metrics import MetricSample
from kvserve.bench.summary import Summary

FORMAT = "kvserve-bench"
FORMAT_VERSION = 1


@dataclass
class RunResult:
    """One load shape's run. `shape` is the LoadShape as a dict (infinite rates as the string "inf")."""

    label: str
    shape: dict[str, Any]
    summary: Summary
    records: list[RequestRecord]
    server_samples: list[MetricSample] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "shape": self.shape,
            "summary": self.summary.to_dict(),
            "records": [r.to_dict() for r in self.records],
            "server_samples": [s.to_dict() for s in self.server_samples],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return cls(
            label=data["label"],
            shape=data["shape"],
            summary=Summary.from_dict(data["summary"]),
            records=[RequestRecord.from_dict(r) for r in data["records"]],
            server_samples=[MetricSample.from_dict(s) for s in data.get("server_samples", [])],
        )


@dataclass
class BenchResult:
    config: dict[str, Any]
    runs: list[RunResult]
    created_utc: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat())

    def to_dict(self) -> dict[str, Any]:
        data = {"format": FORMAT, "version": FORMAT_VERSION, "created_utc": self.created_utc,
                "config": self.config, "runs": [run.to_dict() for run in self.runs]}
        metadata = self.config.get("metadata") or {}
        data.update({k: v for k, v in metadata.items() if k not in data})
        if len(self.runs) == 1:  # (a sweep's runs are in "runs" only, as vLLM writes one file per run)
            run = self.runs[0]
            data.update(vllm_config(self.config, run, self.created_utc))
            data.update(vllm_metrics(run.summary, self.config.get("model")))
            if self.config.get("save_detailed"):
                data.update(vllm_detailed(run.records))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a kvserve bench result (format {data.get('format')!r})")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"kvserve bench result version {data.get('version')!r}; this kvserve reads "
                             f"version {FORMAT_VERSION}")
        return cls(config=data["config"], runs=[RunResult.from_dict(r) for r in data["runs"]],
                   created_utc=data["created_utc"])


# vLLM's --backend of each API, for a result whose command named none.
_VLLM_BACKEND_OF_API = {"completions": "openai", "chat": "openai-chat", "responses": "openai-responses"}


def vllm_config(config: dict[str, Any], run: RunResult, created_utc: str) -> dict[str, Any]:
    """The configuration keys of vLLM's --save-result file: `date` (local time, as vLLM's YYYYMMDD-HHMMSS),
    `backend` (--backend, else the API's), `label`, `model_id`, `tokenizer_id` (--tokenizer, else the model),
    `num_prompts` (--num-prompts, else the requests issued), `request_rate` ("inf" for a closed loop: vLLM's
    --max-concurrency N alone), `burstiness`, `max_concurrency` (a closed loop's concurrency)."""
    shape = run.shape
    closed = shape.get("concurrency") is not None
    try:
        date = datetime.datetime.fromisoformat(created_utc).astimezone().strftime("%Y%m%d-%H%M%S")
    except ValueError:
        date = created_utc
    return {
        "date": date,
        "backend": config.get("backend") or _VLLM_BACKEND_OF_API.get(config.get("api") or "", config.get("api")),
        "label": config.get("label"),
        "model_id": config.get("model"),
        "tokenizer_id": config.get("tokenizer") or config.get("model"),
        "num_prompts": shape.get("num_prompts") if shape.get("num_prompts") is not None else len(run.records),
        "request_rate": "inf" if closed else shape.get("request_rate"),
        "burstiness": shape.get("burstiness", 1.0),
        "max_concurrency": shape.get("concurrency") if closed else shape.get("max_concurrency"),
    }


def vllm_detailed(records: list[RequestRecord]) -> dict[str, list[Any]]:
    """vLLM's per-request lists (--save-detailed), in request order, failed requests included as vLLM has
    them: token counts 0 when unknown, `ttfts` and `itls` in seconds (a request without a first token: 0),
    `errors` "" for a request that succeeded."""
    return {
        "input_lens": [r.prompt_tokens or 0 for r in records],
        "output_lens": [r.output_tokens or 0 for r in records],
        "ttfts": [r.ttft_s or 0.0 for r in records],
        "itls": [list(r.itl_s) for r in records],
        "generated_texts": [r.generated_text or "" for r in records],
        "errors": [r.error or "" for r in records],
    }


# The latencies under vLLM's names (its keys say e2el).
_VLLM_LATENCY_NAMES = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}


def vllm_metrics(summary: Summary, model: str | None) -> dict[str, Any]:
    """A run's numbers under the keys of `vllm bench serve --save-result`'s JSON (`completed`, `request_throughput`,
    `mean_ttft_ms`, `p99_itl_ms`, ...), so that scripts reading those files read these too: each latency's mean,
    median, std and every percentile the summary has (P90, P95, P99 and --metric-percentiles'). Durations are
    seconds and latencies ms, as in vLLM; a latency without values gives None."""
    s = summary
    data: dict[str, Any] = {
        "model_id": model, "duration": s.duration_s, "completed": s.completed, "failed": s.failed,
        "total_input_tokens": s.total_input_tokens, "total_output_tokens": s.total_output_tokens,
        "request_throughput": s.request_throughput, "request_goodput": s.goodput,
        "output_throughput": s.output_throughput, "total_token_throughput": s.total_token_throughput,
    }
    for key, name in _VLLM_LATENCY_NAMES.items():
        stats = getattr(s, key)
        data[f"mean_{name}_ms"] = stats.mean_ms
        data[f"median_{name}_ms"] = stats.median_ms
        data[f"std_{name}_ms"] = stats.std_ms
        for pname, value in (("p90", stats.p90_ms), ("p95", stats.p95_ms), ("p99", stats.p99_ms),
                             *stats.percentiles_ms.items()):
            data[f"{pname}_{name}_ms"] = value
    return data


def jsonable(value: Any) -> Any:
    """`value` with infinities as the strings "inf"/"-inf" (JSON has no infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(result: BenchResult, path: str, append: bool = False) -> None:
    """Write `result` to `path` whole or not at all: the text is made first and replaces the file in one rename,
    so a failure leaves an earlier file there as it was (it was truncated and left half written). `append`
    (vLLM's --append-result): the file keeps what it holds and gets the result as one more line."""
    if append:
        text = json.dumps(jsonable(result.to_dict()), allow_nan=False) + "\n"
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                earlier = f.read()
            if earlier.strip():
                text = earlier.rstrip("\n") + "\n" + text
    else:
        text = json.dumps(jsonable(result.to_dict()), indent=1, allow_nan=False) + "\n"
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def read_json(path: str) -> BenchResult:
    """The result in `path`; of a file that --append-result grew (one JSON document after another), the last."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    position, data = 0, None
    try:
        while True:
            while position < len(text) and text[position].isspace():
                position += 1
            if position == len(text) and data is not None:
                break
            data, position = decoder.raw_decode(text, position)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a kvserve bench result")
    return BenchResult.from_dict(data)
