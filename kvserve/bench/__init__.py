"""`kvserve bench`: a load-test client for any OpenAI-compatible server (kvserve, vLLM, SGLang, TGI).

Modules, in the order a run uses them: `cli_args` (flags) -> `config` (BenchConfig, LoadShape) ->
`datasets` (what each request asks; prose from `corpus`) -> `load` (closed/open loop) -> `client`
(one streamed request, timed) with `client_health` and `server_metrics` sampled alongside -> `summary`
(statistics) -> `report` (text), `results` (JSON), `plot` (PNG). `runner` ties them together.
"""

from kvserve.bench.config import BenchConfig, LoadShape
from kvserve.bench.datasets import DatasetConfig

__all__ = ["BenchConfig", "DatasetConfig", "LoadShape"]
