"""`kvserve serve --data-parallel-size N`, its pure parts: which GPUs each replica gets, the replicas' command
lines, the flags the command refuses, and the one /metrics made of the replicas' and the router's."""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import logging
import os
import re
import signal
import socket
import sys

import prometheus_client
import pytest
from helpers.ports import free_port
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine import core_client
from kvserve.entrypoints import data_parallel
from kvserve.entrypoints.cli import build_parser, main
from kvserve.entrypoints.data_parallel import (
    MAX_LINE_BYTES,
    ReplicaPlan,
    assign_gpus,
    check_data_parallel_flags,
    exit_status,
    plan_replicas,
    relay_output,
    replica_args,
    replica_env,
    router_config,
    run_data_parallel,
    unexpected_exits,
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


def test_replica_ports_leave_out_the_public_one(monkeypatch: pytest.MonkeyPatch) -> None:
    offered = iter([5000, 5001, 5000, 5002])
    monkeypatch.setattr(data_parallel, "_free_port", lambda: next(offered))
    assert [p.port for p in plan_replicas(_serve("-dp", "2", "--device", "cpu"), taken_ports={5001})] == [5000, 5002]


def test_the_public_port_listens_before_the_replicas_are_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bound and listening first: no other process can take it while the replicas start (connections wait
    in the backlog), and no replica is given it."""
    port = free_port()
    seen: dict[str, object] = {}

    def plan(ns: argparse.Namespace, taken_ports: set[int]) -> list[object]:
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # accepted into the backlog
            seen["taken"] = taken_ports
        raise ValueError("no replicas in this test")

    monkeypatch.setattr(data_parallel, "plan_replicas", plan)
    ns = _serve("-dp", "2", "--device", "cpu", "--port", str(port))
    ns.serve_args = []
    assert run_data_parallel(ns) == 2
    assert seen == {"taken": {port}}


def test_a_busy_port_fails_before_any_replica_is_planned(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(data_parallel, "plan_replicas", lambda *_: pytest.fail("planned replicas"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ns = _serve("-dp", "2", "--device", "cpu", "--port", str(port))
        ns.serve_args = []
        with caplog.at_level(logging.ERROR):
            assert run_data_parallel(ns) == 1
    assert f"cannot listen on 127.0.0.1:{port}: " in caplog.text and "in use" in caplog.text


def test_a_replicas_environment_marks_it_and_shares_the_cpu_or_names_its_gpus() -> None:
    cpu, gpu = ReplicaPlan(1, 5000, None, tag="abc"), ReplicaPlan(1, 5000, ["2", "3"], tag="def")
    assert replica_env({"PATH": "/bin"}, cpu, 3, 16) == {
        "PATH": "/bin", "KVSERVE_DP_REPLICA": "1", "KVSERVE_DP_REPLICA_TAG": "abc", "OMP_NUM_THREADS": "5"}
    assert replica_env({}, cpu, 4, 2)["OMP_NUM_THREADS"] == "1"  # at least one thread each
    assert replica_env({"OMP_NUM_THREADS": "7"}, cpu, 3, 16)["OMP_NUM_THREADS"] == "7"  # the user's choice
    assert replica_env({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, gpu, 2, 16) == {
        "CUDA_VISIBLE_DEVICES": "2,3", "KVSERVE_DP_REPLICA": "1", "KVSERVE_DP_REPLICA_TAG": "def"}
    # A tag in this process's environment is not passed on: each replica has its own.
    assert replica_env({"KVSERVE_DP_REPLICA_TAG": "xyz"}, cpu, 3, 16)["KVSERVE_DP_REPLICA_TAG"] == "abc"


def test_each_replica_gets_a_random_tag_of_its_own() -> None:
    """The names of the directories a replica makes carry its tag (core_client.tagged_prefix): a valid one, and
    none alike, of this command's replicas or of another's."""
    plans = plan_replicas(_serve("-dp", "3", "--device", "cpu")) + plan_replicas(_serve("-dp", "3", "--device", "cpu"))
    tags = [plan.tag for plan in plans]
    assert len(set(tags)) == 6 and all(re.fullmatch(r"[0-9a-f]{8}", tag) for tag in tags), tags
    assert all(core_client.valid_replica_tag(tag) for tag in tags)


def test_cpu_replicas_need_no_gpu() -> None:
    plans = plan_replicas(_serve("-dp", "3", "--device", "cpu"))
    assert [p.gpus for p in plans] == [None, None, None]
    assert "replica 1 on CPU at http://127.0.0.1:" in plans[1].describe()


# ------------------------------------------------------------------------------------------ flags


def _serve(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "/models/m", *flags])


def _serve_argv(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


OVERRIDES = ["--data-parallel-size", "1", "--host", "127.0.0.1", "--port", "4321"]


@pytest.mark.parametrize("args", [
    ["m", "-dp", "2", "--port", "9000", "--host", "0.0.0.0", "--max-num-seqs", "8"],
    ["m", "--data-parallel-size=2", "--port=9000", "--host=0.0.0.0", "--max-num-seqs", "8"],
    ["-dp=2", "m", "--po", "9000", "--hos", "0.0.0.0", "--max-num-seqs", "8"],  # abbreviations argparse takes
    ["--data-parallel", "2", "m", "--max-num-seqs", "8"],
    ["--data-p", "2", "m", "--max-num-seqs", "8"],
    ["--data-p=2", "m", "--max-num-seqs", "8"],
    ["-d", "2", "m", "--max-num-seqs", "8"],  # argparse's abbreviation of the single-dash -dp
])
def test_a_replica_parses_one_replica_on_its_own_port_however_the_command_spelled_them(args: list[str]) -> None:
    assert _serve_argv(*args).data_parallel_size == 2  # the command runs replicas...
    replica = _serve_argv(*replica_args(args, 4321))  # ...and each of them parses as one server
    assert (replica.data_parallel_size, replica.host, replica.port) == (1, "127.0.0.1", 4321)
    assert (replica.model_tag, replica.max_num_seqs) == ("m", 8)
    assert replica_args(args, 4321) == [*args, *OVERRIDES]  # nothing dropped, nothing reordered


def test_a_replica_parses_every_other_flag_as_the_command_did() -> None:
    # Dropping `-dp 2` here would leave `--served-model-name tiny /models/m`: two served names and no model.
    args = ["--served-model-name", "tiny", "-dp", "2", "/models/m"]
    command, replica = _serve_argv(*args), _serve_argv(*replica_args(args, 4321))
    assert (replica.served_model_name, replica.model_tag) == (command.served_model_name, command.model_tag) == (
        ["tiny"], "/models/m")
    args = ["/models/m", "-tp", "2", "--api-key", "k", "--served-model-name", "a", "b", "-dp", "2"]
    command, replica = _serve_argv(*args), _serve_argv(*replica_args(args, 4321))
    assert {k: v for k, v in vars(replica).items() if k not in ("data_parallel_size", "host", "port")} == {
        k: v for k, v in vars(command).items() if k not in ("data_parallel_size", "host", "port")}


def test_the_overrides_go_before_a_double_dash() -> None:
    # After "--" every word is positional, even one spelled as a flag: the overrides must come before it.
    args = ["-dp", "2", "--", "/models/--port"]
    assert replica_args(args, 4321) == ["-dp", "2", *OVERRIDES, "--", "/models/--port"]
    replica = _serve_argv(*replica_args(args, 4321))
    assert (replica.model_tag, replica.data_parallel_size, replica.port) == ("/models/--port", 1, 4321)


def test_a_replica_refuses_to_start_replicas_of_its_own(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve import envs
    from kvserve.entrypoints.openai.api_server import run_server

    monkeypatch.setattr(envs, "KVSERVE_DP_REPLICA", True)
    assert run_server(_serve_argv("/models/m", "-dp", "2")) == 2
    assert "is a replica of `kvserve serve --data-parallel-size`" in capsys.readouterr().err


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


def test_an_api_key_the_router_cannot_send_is_refused_before_the_replicas_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key with a control character (a secret's last newline): no header can carry it. The replicas started, then
    the router's first health check failed with aiohttp's "Forbidden control character detected in headers"."""
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_API_KEY", None)
    monkeypatch.setattr(envs, "VLLM_API_KEY", None)
    with pytest.raises(ValueError, match="the API key holds a control character"):
        check_data_parallel_flags(_serve("-dp", "2", "--api-key", "sekret\n"))
    monkeypatch.setattr(envs, "KVSERVE_API_KEY", "sekret\r\n")
    with pytest.raises(ValueError, match="the API key holds a control character"):
        check_data_parallel_flags(_serve("-dp", "2"))
    monkeypatch.setattr(envs, "KVSERVE_API_KEY", "sekret")
    check_data_parallel_flags(_serve("-dp", "2"))


# ------------------------------------------------------------------------------------------ the router


def test_the_router_has_no_answer_time_limit_and_the_servers_body_limit_and_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_API_KEY", None)
    monkeypatch.setattr(envs, "VLLM_API_KEY", None)
    config = router_config(_serve("-dp", "2", "--max-request-body-bytes", "1000", "--api-key", "k"))
    assert config.request_timeout_s is None  # one server cuts no long answer: nor do its replicas' router
    assert (config.max_body_bytes, config.api_key, config.engine_metrics) == (1000, "k", True)
    assert router_config(_serve("-dp", "2")).api_key is None
    # The key's sources are the server's, in its order: KVSERVE_API_KEY set empty means no key at all.
    monkeypatch.setattr(envs, "VLLM_API_KEY", "v")
    assert router_config(_serve("-dp", "2")).api_key == "v"
    monkeypatch.setattr(envs, "KVSERVE_API_KEY", "")
    assert router_config(_serve("-dp", "2")).api_key is None


# ------------------------------------------------------------------------------------------ processes


def test_a_replicas_exit_status_is_the_commands() -> None:
    assert exit_status(3) == 3
    assert exit_status(0) == 1  # exiting during start-up is a failure whatever the code
    assert exit_status(-signal.SIGKILL) == 128 + 9  # as a shell reports a death by signal
    assert exit_status(-signal.SIGTERM) == 128 + 15


def test_after_a_second_signal_a_replica_ended_by_sigterm_stopped_as_asked() -> None:
    codes: dict[int, int | None] = {0: 0, 1: -signal.SIGTERM, 2: -signal.SIGKILL, 3: 1}
    assert unexpected_exits(codes, stopped_at_once=False) == {1: -signal.SIGTERM, 2: -signal.SIGKILL, 3: 1}
    assert unexpected_exits(codes, stopped_at_once=True) == {2: -signal.SIGKILL, 3: 1}
    assert unexpected_exits({0: 0, 1: -signal.SIGTERM}, stopped_at_once=True) == {}


def test_replica_output_keeps_lines_longer_than_the_stream_limit_whole() -> None:
    long = "x" * 200_000  # past asyncio's 64 KiB readline() limit
    huge = "y" * (MAX_LINE_BYTES + 10)

    async def relay() -> tuple[str, list[str]]:
        stream = asyncio.StreamReader()
        for piece in (f"first\n{long}\nsh".encode(), b"ort\n", f"{huge}\nno newline at the end".encode()):
            stream.feed_data(piece)
        stream.feed_eof()
        out, tail = io.StringIO(), collections.deque[str](maxlen=3)
        await relay_output(stream, "(replica 0) ", tail, out)
        return out.getvalue(), list(tail)

    text, tail = asyncio.run(relay())
    assert text == "".join(f"(replica 0) {line}\n" for line in (
        "first", long, "short", huge[:MAX_LINE_BYTES], huge[MAX_LINE_BYTES:], "no newline at the end"))
    assert tail == [huge[:MAX_LINE_BYTES] + "\n", huge[MAX_LINE_BYTES:] + "\n", "no newline at the end\n"]


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


@pytest.mark.parametrize("first, later", [
    ("# HELP x A gauge.\n# TYPE x gauge\nx 1.0\n", "# HELP x_total A counter.\n# TYPE x_total counter\nx_total 2.0\n"),
    # The parser names a counter's family without its `_total` (x), a gauge's as written (x_total): they
    # still clash, as the TYPE lines written for them would.
    ("# HELP x_total A counter.\n# TYPE x_total counter\nx_total 1.0\n", "# HELP x_total A gauge.\n# TYPE x_total gauge\nx_total 2.0\n"),
    ("# HELP x_total A gauge.\n# TYPE x_total gauge\nx_total 1.0\n", "# HELP x_total A counter.\n# TYPE x_total counter\nx_total 2.0\n"),
])
def test_a_family_of_another_type_in_a_later_part_is_left_out(first: str, later: str) -> None:
    text = merge_expositions([({"engine": "0"}, first), ({"engine": "1"}, later)]).decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == 1 and 'engine="0"} 1.0' in text and 'engine="1"' not in text, text


def test_a_part_that_is_no_exposition_is_left_out() -> None:
    good = "# HELP x A gauge.\n# TYPE x gauge\nx 1.0\n"
    text = merge_expositions([({"engine": "0"}, '{"path": "/metrics"}'), ({"engine": "1"}, good)]).decode()
    assert text == '# HELP x A gauge.\n# TYPE x gauge\nx{engine="1"} 1.0\n'


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_replica_whose_parent_died_before_its_death_signal_was_set_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The death signal only comes for a parent that dies after prctl: the child checks it still has its parent.
    (Run here with a fake libc and getppid: the test process's own death signal is left alone.)"""
    import ctypes

    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def prctl(self, option: int, value: int) -> int:
            calls.append((option, value))
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda *_, **__: FakeLibc())
    in_child = data_parallel._die_with_parent()
    assert in_child is not None

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr(os, "getppid", os.getpid)  # the parent that made in_child: it is alive
    in_child()
    monkeypatch.setattr(os, "getppid", lambda: 1)  # adopted by init: the parent is gone
    with pytest.raises(SystemExit) as exited:
        in_child()
    assert exited.value.code == 1 and calls == [(1, signal.SIGTERM)] * 2


@pytest.mark.parametrize("output_held, killed", [(True, True), (False, False)])
def test_a_failed_replicas_group_is_killed_only_while_something_holds_its_output(
        monkeypatch: pytest.MonkeyPatch, output_held: bool, killed: bool) -> None:
    """What a failed replica left is removed either way; its process group is SIGKILLed only while a member still
    holds its output (and so keeps the group's id, the replica's pid, from being reused). Once its output closed
    the group may be empty and its id another process's, so killing it then could hit that one."""
    kills: list[tuple[int, int]] = []
    removals: list[str] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: kills.append((pgid, sig)))
    monkeypatch.setattr(data_parallel, "remove_replica_dirs", lambda tag: removals.append(tag) or [])

    async def scenario() -> None:
        process = argparse.Namespace(pid=4_000_000, returncode=1)  # (a pid no process has: pid_max is lower)
        output = asyncio.get_running_loop().create_future()
        if not output_held:
            output.set_result(None)
        replica = data_parallel.Replica(ReplicaPlan(0, 1, None), process, output_done=output)  # type: ignore[arg-type]
        replica.remove_what_it_left()
        replica.remove_what_it_left()  # (once)
        output.cancel()

    asyncio.run(scenario())
    assert kills == ([(4_000_000, signal.SIGKILL)] if killed else [])
    assert len(removals) == 1 and re.fullmatch(r"[0-9a-f]{8}", removals[0])


def test_replicas_that_settle_on_different_auto_lengths_are_named() -> None:
    """--max-model-len auto: each replica lowers the length to what its own KV cache holds; unequal lengths are
    warned about with the length that all hold."""
    from kvserve.entrypoints.data_parallel import unequal_lengths_warning

    assert unequal_lengths_warning({0: 4096, 1: 4096}) is None
    assert unequal_lengths_warning({0: 4096, 1: None}) is None  # one not read: nothing to compare
    said = unequal_lengths_warning({1: 3072, 0: 4096, 2: None})
    assert said is not None
    assert "replica 0: 4096, replica 1: 3072" in said and "pass --max-model-len 3072" in said
