"""The tensor-parallel engine's collectives on one GPU: what can be checked without a second one.

The engine runs with one rank, but its row-parallel layers' all-reduces go through a one-rank NCCL process
group (`torch.distributed.all_reduce`, as with two ranks) and its CUDA graphs are captured in the mode a
tensor-parallel engine uses (thread-local, with NCCL's watchdog thread running). So the NCCL calls are
captured in the decode graphs, the piecewise graphs and the prefill graphs, and replayed. Greedy tokens and
logprobs must equal the plain engine's (a one-rank all-reduce leaves its input as it is). Also checks the
gather the split LM head uses (`distributed.all_gather`) on NCCL.

What it shows is that NCCL calls capture and replay in the engine's graphs on this torch: with one rank
the all-reduce changes no value, so the numerics of two ranks (and any disagreement between them) are
tests/gpu/test_gpu_tensor_parallel.py's, which needs two GPUs.

    python benchmarks/tp_collectives_probe.py
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import types
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvserve.config import EngineArgs  # noqa: E402
from kvserve.engine.engine_core import EngineCore  # noqa: E402
from kvserve.layers.linear import Linear  # noqa: E402
from kvserve.protocol.engine import EngineCoreRequest  # noqa: E402
from kvserve.protocol.sampling_params import SamplingParams  # noqa: E402
from kvserve.worker import cuda_graph  # noqa: E402


def _run(path: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]], dict[str, Any]]:
    args = EngineArgs(model=path, dtype="float32", device="cuda", max_model_len=1024, num_kv_blocks=1024,
                      max_num_seqs=16, max_num_batched_tokens=512)
    core = EngineCore(args.create_engine_config())
    info = {"graphs": core.runner.graphs is not None, "piecewise": core.runner.piecewise is not None}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step <= 3 * (len(prompts) - 1) or core.has_unfinished_requests():
        if step % 3 == 0 and step // 3 < len(prompts):
            i = step // 3
            core.add_request(EngineCoreRequest(req_id=str(i), prompt_token_ids=prompts[i], sampling_params=params,
                                               max_tokens=24))
        for out in core.step().outputs:
            tokens[out.req_id].extend(out.new_token_ids)
            for lp in out.new_logprobs or []:
                lps[out.req_id].extend(lp.logprobs)
        step += 1
    return [tokens[str(i)] for i in range(len(prompts))], [lps[str(i)] for i in range(len(prompts))], info


def main() -> int:
    from helpers.tiny_models import make_bare_checkpoint

    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1024, (int(n),), generator=generator).tolist()
               for n in torch.randint(5, 300, (6,), generator=generator)]
    models = {"llama-hd64": ("llama", {}),
              "qwen2-hd128": ("qwen2", {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1})}
    paths = {name: make_bare_checkpoint(tempfile.mkdtemp(), kind, i, vocab_size=1024, **over)
             for i, (name, (kind, over)) in enumerate(models.items())}
    plain = {name: _run(path, prompts) for name, path in paths.items()}

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    calls = {"all_reduce": 0}

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        calls["all_reduce"] += 1
        dist.all_reduce(x)
        return x

    gathered = torch.arange(12, dtype=torch.float32, device="cuda").view(3, 4)
    out = torch.empty_like(gathered)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, gathered)
    gather_ok = torch.equal(out, gathered)

    # The row-parallel projections (o_proj, down) reduce their output as with two ranks: a one-rank engine
    # builds them without the reduce, so the probe adds it.
    init, forward = Linear.__init__, Linear.forward

    def probe_init(self: Linear, *args: Any, row_parallel: bool = False, **kwargs: Any) -> None:
        init(self, *args, row_parallel=row_parallel, **kwargs)
        self.probe_reduce = row_parallel  # type: ignore[attr-defined]

    def probe_forward(self: Linear, x: torch.Tensor) -> torch.Tensor:
        y = forward(self, x)
        return all_reduce(y) if getattr(self, "probe_reduce", False) else y

    Linear.__init__ = probe_init  # type: ignore[method-assign]
    Linear.forward = probe_forward  # type: ignore[method-assign]
    # The capture mode a tensor-parallel engine uses.
    cuda_graph.distributed = types.SimpleNamespace(tp_size=lambda: 2)  # type: ignore[assignment]
    failures = 0
    for name, path in paths.items():
        calls["all_reduce"] = 0
        tokens, lps, info = _run(path, prompts)
        same_tokens = tokens == plain[name][0]
        lp_diff = max((abs(a - b) for x, y in zip(lps, plain[name][1], strict=True)
                       for a, b in zip(x, y, strict=True)), default=0.0)
        ok = same_tokens and lp_diff < 1e-5 and info["graphs"] and info["piecewise"] and calls["all_reduce"] > 0
        failures += not ok
        print(f"{name}: tokens {'equal' if same_tokens else 'DIFFER'}, max logprob diff {lp_diff:.2e}, graphs "
              f"{info['graphs']}, piecewise {info['piecewise']}, eager all-reduce calls {calls['all_reduce']} "
              f"-> {'ok' if ok else 'FAIL'}")
    print(f"NCCL all_gather ({gather.__name__}): {'ok' if gather_ok else 'FAIL'}")
    dist.destroy_process_group()
    return 1 if failures or not gather_ok else 0


if __name__ == "__main__":
    sys.exit(main())
