"""`kvserve serve --data-parallel-size N`, its pure parts: which GPUs each replica gets, the replicas' command
lines, the flags the command refuses, and the one /metrics made of the replicas' and the router's."""

from __future__ import annotations

import argparse

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvserve.entrypoints.cli import build_parser, main
from kvserve.entrypoints.data_parallel import (
    assign_gpus,
    check_data_parallel_flags,
    plan_replicas,
    replica_args,
    visible_gpus,
)
from kvserve.entrypoints.vllm_compat import ignored_flag_notes
from kvserve.router.exposition import merge_expositions

# ------------------------------------------------------------------------------------------ GPUs


def test_visible_gpus_are_the_variables_list_else_every_device() -> None:
    assert visible_gpus(None, 3) == ["0", "1", "2"]
    assert visible_gpus("4,6, 7", 8) == ["4", "6", "7"]
    assert visible_gpus("GPU-aa,GPU-bb", 2) == ["GPU-aa", "GPU-bb"]
    assert visible_gpus("", 8) == []  # set but empty: CUDA sees none


def test_each_replica_gets_its_own_group_of_tensor_parallel_gpus() -> None:
    assert assign_gpus(["0", "1", "2", "3"], 4, 1) == [["0"], ["1"], ["2"], ["3"]]
    assert assign_gpus(["0", "1", "2", "3"], 2, 2) == [["0", "1"], ["2", "3"]]
    # Of those visible to the parent, in their order; extra GPUs stay unused.
    assert assign_gpus(["4", "6", "7", "5", "1"], 2, 2) == [["4", "6"], ["7", "5"]]


def test_too_few_gpus_are_refused_with_the_count() -> None:
    with pytest.raises(ValueError, match=r"--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs, "
                                         r"3 visible \(0, 1, 2\)"):
        assign_gpus(["0", "1", "2"], 2, 2)
    with pytest.raises(ValueError, match="needs 2 GPUs, none visible"):
        assign_gpus([], 2, 1)


def test_plan_reads_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7,9")
    plans = plan_replicas(_serve("-dp", "2", "-tp", "2", "--device", "cuda"))
    assert [p.gpus for p in plans] == [["3", "5"], ["7", "9"]]
    assert len({p.port for p in plans}) == 2 and [p.index for p in plans] == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match="needs 2 GPUs, 1 visible"):
        plan_replicas(_serve("-dp", "2", "--device", "cuda"))


def test_cpu_replicas_need_no_gpu() -> None:
    plans = plan_replicas(_serve("-dp", "3", "--device", "cpu"))
    assert [p.gpus for p in plans] == [None, None, None]
    assert "replica 1 on CPU at http://127.0.0.1:" in plans[1].describe()


# ------------------------------------------------------------------------------------------ flags


def _serve(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "/models/m", *flags])


@pytest.mark.parametrize("args", [
    ["m", "-dp", "2", "--port", "9000", "--host", "0.0.0.0", "--max-num-seqs", "8"],
    ["m", "--data-parallel-size=2", "--port=9000", "--host=0.0.0.0", "--max-num-seqs", "8"],
    ["-dp=2", "m", "--po", "9000", "--hos", "0.0.0.0", "--max-num-seqs", "8"],  # abbreviations argparse takes
    ["--data-parallel", "2", "m", "--max-num-seqs", "8"],
])
def test_replicas_get_the_flags_less_data_parallel_host_and_port(args: list[str]) -> None:
    assert replica_args(args, 4321) == ["m", "--max-num-seqs", "8", "--host", "127.0.0.1", "--port", "4321"]


def test_replica_flags_keep_everything_else_in_order() -> None:
    args = ["--model", "m", "-tp", "2", "--api-key", "k", "--served-model-name", "a", "b", "--hf-x"]
    assert replica_args(args, 1) == [*args, "--host", "127.0.0.1", "--port", "1"]
    # After "--" every word is positional, even one spelled as a flag.
    assert replica_args(["--", "--port"], 1) == ["--", "--port", "--host", "127.0.0.1", "--port", "1"]


def test_serve_takes_a_replica_count_and_other_commands_refuse_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert _serve("-dp", "4").data_parallel_size == 4
    assert _serve("--data-parallel-size", "1").data_parallel_size == 1
    assert ignored_flag_notes(_serve("-dp", "4")) == []  # not ignored: it runs replicas
    assert ignored_flag_notes(_serve("-dp", "1")) == ["--data-parallel-size 1 ignored: one replica is the default"]
    for argv in (["serve", "m", "-dp", "0"], ["generate", "--prompt", "x", "-dp", "2"],
                 ["triton-repo", "--name", "m", "-dp", "2"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "-dp" in err and ("at least 1" in err or "kvserve serve --data-parallel-size N" in err), err


def test_serve_help_documents_data_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--data-parallel-size" in capsys.readouterr().out


def test_https_and_a_fixed_gpu_are_refused_with_replicas() -> None:
    with pytest.raises(ValueError, match="terminate TLS in front"):
        check_data_parallel_flags(_serve("-dp", "2", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"))
    with pytest.raises(ValueError, match="--device is cpu or cuda"):
        check_data_parallel_flags(_serve("-dp", "2", "--device", "cuda:1"))
    check_data_parallel_flags(_serve("-dp", "2", "--device", "cuda"))


# ------------------------------------------------------------------------------------------ metrics


def _replica_exposition(generated: int, ttft_s: float) -> str:
    prometheus_client.disable_created_metrics()
    registry = CollectorRegistry()
    Counter("kvserve:generation_tokens", "Tokens generated.", ["model_name"],
            registry=registry).labels("tiny").inc(generated)
    Histogram("kvserve:time_to_first_token_seconds", "TTFT.", ["model_name"], buckets=[0.1, 1.0],
              registry=registry).labels("tiny").observe(ttft_s)
    Gauge("kvserve:cache_config_info", "KV cache configuration.", ["block_size"],
          registry=registry).labels("16").set(1)
    return prometheus_client.generate_latest(registry).decode()


def test_metrics_of_replicas_are_labelled_by_engine_under_one_help_and_type() -> None:
    registry = CollectorRegistry()
    Counter("kvserve_router:requests", "Requests.", ["backend", "code"], registry=registry).labels("a", "200").inc(5)
    text = merge_expositions([({"engine": "0"}, _replica_exposition(3, 0.05)),
                              ({"engine": "1"}, _replica_exposition(7, 0.5)),
                              ({}, prometheus_client.generate_latest(registry).decode())]).decode()
    for family in ("kvserve:generation_tokens_total", "kvserve:time_to_first_token_seconds",
                   "kvserve:cache_config_info", "kvserve_router:requests_total"):
        assert text.count(f"# HELP {family} ") == 1 and text.count(f"# TYPE {family} ") == 1, family
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("kvserve:generation_tokens_total", (("engine", "0"), ("model_name", "tiny")))] == 3
    assert samples[("kvserve:generation_tokens_total", (("engine", "1"), ("model_name", "tiny")))] == 7
    bucket = "kvserve:time_to_first_token_seconds_bucket"
    assert samples[(bucket, (("engine", "0"), ("le", "0.1"), ("model_name", "tiny")))] == 1
    assert samples[(bucket, (("engine", "1"), ("le", "0.1"), ("model_name", "tiny")))] == 0
    assert samples[("kvserve:cache_config_info", (("block_size", "16"), ("engine", "1")))] == 1
    # The router's own series keep their labels, with no engine.
    assert samples[("kvserve_router:requests_total", (("backend", "a"), ("code", "200")))] == 5


def test_a_family_of_another_type_in_a_later_part_is_left_out() -> None:
    gauge = "# HELP x A gauge.\n# TYPE x gauge\nx 1.0\n"
    counter = "# HELP x_total A counter.\n# TYPE x_total counter\nx_total 2.0\n"
    text = merge_expositions([({"engine": "0"}, gauge), ({"engine": "1"}, counter)]).decode()
    assert text.count("# TYPE x") == 1 and 'x{engine="0"} 1.0' in text and 'engine="1"' not in text
