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
        return {"format": FORMAT, "version": FORMAT_VERSION, "created_utc": self.created_utc,
                "config": self.config, "runs": [run.to_dict() for run in self.runs]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a kvserve bench result (format {data.get('format')!r})")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"kvserve bench result version {data.get('version')!r}; this kvserve reads "
                             f"version {FORMAT_VERSION}")
        return cls(config=data["config"], runs=[RunResult.from_dict(r) for r in data["runs"]],
                   created_utc=data["created_utc"])


def jsonable(value: Any) -> Any:
    """`value` with infinities as the strings "inf"/"-inf" (JSON has no infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(result: BenchResult, path: str) -> None:
    """Write `result` to `path` whole or not at all: the text is made first and replaces the file in one rename,
    so a failure leaves an earlier file there as it was (it was truncated and left half written)."""
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
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a kvserve bench result")
    return BenchResult.from_dict(data)
