"""vLLM command lines and environments: flags accepted and ignored (each noted at start), flags refused by
name, human-readable --max-model-len, --load-format's vLLM names, VLLM_* environment variables, the start-up
line at the default host."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from kvserve.config import ConfigError, EngineArgs
from kvserve.entrypoints.cli import build_parser, engine_args_from, main


def _serve(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "/models/m", *flags])


def _exit_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("text, value", [
    ("8192", 8192), ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("32k", 32000), ("32K", 32768),
    ("2m", 2_000_000), ("1M", 1 << 20), ("1g", 10**9), ("1G", 1 << 30), (" 4k ", 4000),
])
def test_max_model_len_takes_vllms_human_readable_sizes(text: str, value: int) -> None:
    """k, m, g: powers of 1000 (decimals allowed); K, M, G: powers of 1024 (whole numbers), as vLLM."""
    assert _serve("--max-model-len", text).max_model_len == value
    assert build_parser().parse_args(["generate", "--prompt", "x", "--max-model-len", text]).max_model_len == value


@pytest.mark.parametrize("text, message", [
    ("1.5K", "did you mean 1.5k"), ("4x", "e.g. 8192, 32k or 32K"), ("k", "e.g. 8192"), ("1.5", "e.g. 8192"),
])
def test_bad_human_readable_sizes_are_refused(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_message(["serve", "--max-model-len", text], capsys)
    assert "argument --max-model-len" in err and message in err


@pytest.mark.parametrize("flags", [["--max-model-len", "auto"], ["--max-model-len", "-1"], ["--max-model-len=-1"],
                                   ["--max-model-len", "AUTO"], ["--max-model-len", " Auto "]])
@pytest.mark.parametrize("command", [["serve", "/models/m"], ["generate", "--prompt", "x"],
                                     ["triton-repo", "--name", "m"]])
def test_vllms_automatic_max_model_len_is_taken(command: list[str], flags: list[str]) -> None:
    """vLLM's -1 / auto (the longest length the KV cache holds, at most the model's) reads as "auto" on every
    command that takes engine flags, and reaches EngineArgs so."""
    ns = build_parser().parse_args([*command, *flags])
    assert ns.max_model_len == "auto"
    assert engine_args_from(ns)["max_model_len"] == "auto"


@pytest.mark.parametrize("text", ["-2", "0", "-1k", "autoo", "au to", "-1.0"])
def test_other_lengths_below_one_and_garbage_are_refused(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_message(["serve", "/models/m", f"--max-model-len={text}"], capsys)
    assert "argument --max-model-len: " in err, err
    assert "auto / -1" in err or "e.g. 8192, 32k or 32K" in err, err


def test_engine_args_take_vllms_automatic_max_model_len_too(tiny_model_dir: Callable[..., str]) -> None:
    """Until the engine sizes the KV cache, auto / -1 is the model's own length, as when none is given (with
    VLLM_ALLOW_LONG_MAX_MODEL_LEN set too: it allows a longer length given, auto never asks for one)."""
    path = tiny_model_dir("llama", max_position_embeddings=96)
    plain = EngineArgs(model=path, device="cpu").create_engine_config()
    assert plain.model_config.max_model_len == 96 and not plain.model_config.max_model_len_auto
    for value in (-1, "-1", "auto", " AUTO "):
        config = EngineArgs(model=path, device="cpu", max_model_len=value).create_engine_config()
        assert config.model_config.max_model_len == config.scheduler_config.max_model_len == 96
        assert config.model_config.max_model_len_auto
    for value in (0, -2, "-5", "auto-ish"):
        with pytest.raises(ConfigError, match="max_model_len"):
            EngineArgs(model=path, device="cpu", max_model_len=value).create_engine_config()
    # Lengths that are no whole number: True was read as 1 and 2.5 as 2, unsaid
    for value in (True, 64.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="max_model_len must be a whole number of tokens"):
            EngineArgs(model=path, device="cpu", max_model_len=value).create_engine_config()
    for value in (True, 100.5):
        with pytest.raises(ConfigError, match="max_num_batched_tokens must be a whole number of tokens"):
            EngineArgs(model=path, device="cpu", max_num_batched_tokens=value).create_engine_config()
    assert EngineArgs(model=path, device="cpu", max_model_len=64.0).create_engine_config(
        ).model_config.max_model_len == 64


def test_engine_args_auto_with_long_lengths_allowed(tiny_model_dir: Callable[..., str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_ALLOW_LONG_MAX_MODEL_LEN", True)
    path = tiny_model_dir("llama", max_position_embeddings=96)
    config = EngineArgs(model=path, device="cpu", max_model_len="auto").create_engine_config()
    assert config.model_config.max_model_len == 96 and config.model_config.max_model_len_auto


@pytest.mark.parametrize("command", [["serve", "/models/m"], ["generate", "--prompt", "x"],
                                     ["triton-repo", "--name", "m"]])
def test_harmless_vllm_flags_are_accepted_and_noted(command: list[str]) -> None:
    from kvserve.entrypoints.vllm_compat import ignored_flag_notes

    flags = ["--swap-space", "4", "-pp", "1", "--data-parallel-size", "1",
             "--distributed-executor-backend", "mp", "--tokenizer-mode", "auto", "--max-seq-len-to-capture",
             "8192", "--disable-custom-all-reduce", "--task", "generate", "--guided-decoding-backend", "xgrammar"]
    ns = build_parser().parse_args([*command, *flags])
    notes = ignored_flag_notes(ns)
    assert len(notes) == 9 and all(" ignored: " in note for note in notes), notes
    assert notes[0].startswith("--swap-space ignored: kvserve preempts requests by recomputing")
    assert engine_args_from(ns) == engine_args_from(build_parser().parse_args(command))  # nothing changes
    assert ignored_flag_notes(build_parser().parse_args(command)) == []


def test_harmless_vllm_server_flags_are_accepted_and_noted() -> None:
    from kvserve.entrypoints.openai.cli_args import server_engine_args
    from kvserve.entrypoints.vllm_compat import ignored_flag_notes

    ns = _serve("--enable-prompt-tokens-details", "--enable-reasoning", "--reasoning-parser", "qwen3")
    assert [note.split(" ignored:")[0] for note in ignored_flag_notes(ns)] == [
        "--enable-reasoning", "--enable-prompt-tokens-details"]
    server_engine_args(ns)
    with pytest.raises(ValueError, match="--enable-reasoning needs --reasoning-parser"):
        server_engine_args(_serve("--enable-reasoning"))


@pytest.mark.parametrize("command", [["serve", "/models/m"], ["generate", "--prompt", "x"],
                                     ["triton-repo", "--name", "m"]])
def test_vllm_engine_flags_matching_kvserve_are_accepted_and_noted(command: list[str]) -> None:
    """--model-impl auto|vllm (kvserve's own implementations), --hf-token (nothing is downloaded): accepted,
    noted, and the token never appears in a note."""
    from kvserve.entrypoints.vllm_compat import ignored_flag_notes

    ns = build_parser().parse_args([*command, "--model-impl", "vllm", "--hf-token", "hf_secret"])
    notes = ignored_flag_notes(ns)
    assert [note.split(" ignored: ")[0] for note in notes] == ["--model-impl vllm", "--hf-token"], notes
    assert "hf_secret" not in " ".join(notes)
    assert engine_args_from(ns) == engine_args_from(build_parser().parse_args(command))
    bare = build_parser().parse_args([*command, "--model-impl", "auto", "--hf-token"])  # the token of `hf auth login`
    assert [note.split(" ignored: ")[0] for note in ignored_flag_notes(bare)] == ["--model-impl auto", "--hf-token"]


def test_vllm_server_flags_matching_kvserve_are_accepted_and_noted() -> None:
    """--chat-template-content-format auto|string, --max-log-len and --disable-frontend-multiprocessing
    describe what kvserve's server does anyway: accepted and noted."""
    from kvserve.entrypoints.openai.cli_args import server_engine_args
    from kvserve.entrypoints.vllm_compat import ignored_flag_notes

    ns = _serve("--chat-template-content-format", "string", "--max-log-len", "100",
                "--disable-frontend-multiprocessing")
    assert [note.split(" ignored: ")[0] for note in ignored_flag_notes(ns)] == [
        "--chat-template-content-format string", "--max-log-len", "--disable-frontend-multiprocessing"]
    assert server_engine_args(ns) == server_engine_args(_serve())
    auto = ignored_flag_notes(_serve("--chat-template-content-format", "auto"))
    assert auto == ["--chat-template-content-format auto ignored: message content reaches the chat template as a "
                    "string (text parts joined by newlines)"]


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-mode", "slow"], "argument --tokenizer-mode: 'slow' is not supported: kvserve always loads the "
                                   "fast tokenizer"),
    (["--tokenizer-mode", "mistral"], "argument --tokenizer-mode: 'mistral' is not supported: kvserve tokenizes "
                                      "with the checkpoint's Hugging Face tokenizer"),
    (["--tokenizer-mode", "custom"], "argument --tokenizer-mode: 'custom' is not supported"),
    (["--tokenizer-mode", "fancy"], "argument --tokenizer-mode: invalid choice: 'fancy' (choose from auto, hf)"),
    (["--model-impl", "transformers"], "argument --model-impl: 'transformers' is not supported: kvserve runs its "
                                       "own implementation"),
    (["--chat-template-content-format", "openai"], "argument --chat-template-content-format: 'openai' is not "
                                                   "supported"),
    (["--max-log-len", "lots"], "argument --max-log-len: invalid int value"),
])
def test_vllm_flag_values_kvserve_does_not_serve_are_refused_by_name(flags: list[str], message: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_message(["serve", "m", *flags], capsys)
    assert f"kvserve serve: error: {message}" in err, err


def test_harmless_flags_are_not_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--swap-space" not in out and "--max-model-len" in out


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype 'fp4' is not supported; choose auto"),
    (["--kv-cache-dtype", "fp8_ds_mla"], "--kv-cache-dtype fp8_ds_mla is not supported: it is DeepSeek's"),
    (["--pipeline-parallel-size", "2"], "--tensor-parallel-size"),
    (["-pp", "2"], "--tensor-parallel-size"),
    (["-dp", "0"], "must be at least 1"),
    (["--distributed-executor-backend", "ray"], "invalid choice: 'ray'"),
    (["--guided-decoding-backend", "lm-format-enforcer"], "invalid choice"),
    (["--task", "embed"], "invalid choice"),
])
def test_vllm_flag_values_that_would_matter_are_refused(flags: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_message(["serve", *flags], capsys)
    assert message in err, err


@pytest.mark.parametrize("argv, flag", [
    (["serve", "m", "--enable-lora"], "--enable-lora"),
    (["serve", "m", "--lora-modules", "a=/x"], "--lora-modules"),
    (["serve", "--speculative-config", '{"num_speculative_tokens": 3}', "m"], "--speculative-config"),
    (["serve", "m", "--cpu-offload-gb=4"], "--cpu-offload-gb"),
    (["serve", "m", "--enable-sleep-mode"], "--enable-sleep-mode"),
    (["serve", "m", "--kv-transfer-config", "{}"], "--kv-transfer-config"),
    (["serve", "m", "--limit-mm-per-prompt", "{}"], "--limit-mm-per-prompt"),
    (["serve", "m", "--mm-processor-kwargs", "{}"], "--mm-processor-kwargs"),
    (["serve", "m", "--compilation-config", "{}"], "--compilation-config"),
    (["serve", "m", "-O3"], "-O"),
    (["serve", "m", "-O", "3"], "-O"),
    (["serve", "m", "--hf-overrides", "{}"], "--hf-overrides"),
    (["serve", "m", "--rope-scaling", "{}"], "--rope-scaling"),
    (["generate", "--prompt", "x", "--enable-lora"], "--enable-lora"),
])
def test_unsupported_vllm_flags_are_refused_by_name(argv: list[str], flag: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_message(argv, capsys)
    assert f"kvserve {argv[0]}: error: {flag} is a vLLM option kvserve does not support" in err, err
    assert "unrecognized arguments" not in err


def test_alternatives_are_named_and_other_flags_keep_argparses_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--enforce-eager" in _exit_message(["serve", "m", "-O3"], capsys)
    assert "quantized checkpoint" in _exit_message(["serve", "m", "--cpu-offload-gb", "4"], capsys)
    err = _exit_message(["serve", "m", "--not-a-flag", "1"], capsys)
    assert "unrecognized arguments: --not-a-flag 1" in err and "vLLM" not in err


def test_flags_spelled_with_underscores_are_read_as_vllm_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--max_model_len 8k` and `--gpu_memory_utilization=0.8` (Docker and Kubernetes command lines written for
    vLLM, whose parser turns a flag's underscores into dashes) are the dashed flags; values and the words after
    `--` are kept as written."""
    from kvserve.entrypoints import cli
    from kvserve.entrypoints.vllm_compat import parse_args_or_refuse

    argv = ["serve", "--served_model_name", "my_model", "--max_model_len", "8k", "--gpu_memory_utilization=0.8",
            "--enable_prefix_caching", "--no_enable_chunked_prefill", "--tensor_parallel_size", "1", "--swap_space",
            "4", "--", "/models/a_b"]
    ns = parse_args_or_refuse(build_parser(), argv)
    assert ns.served_model_name == ["my_model"] and ns.model_tag == "/models/a_b"
    assert (ns.max_model_len, ns.gpu_memory_utilization, ns.enable_chunked_prefill, ns.swap_space) == (
        8000, 0.8, False, 4.0)
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "_cmd_serve", lambda ns: seen.append(ns) or 0)
    assert main(["serve", "/models/m", "--max_num_seqs", "8"]) == 0 and seen[0].max_num_seqs == 8


def test_more_vllm_flags_that_change_nothing_are_noted_and_middleware_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--preemption-mode recompute (what kvserve does), --max-parallel-loading-workers, --cuda-graph-sizes,
    --max-cudagraph-capture-size and --enable-log-outputs were "unrecognized arguments"; --middleware is
    refused by name, and --preemption-mode swap saying why."""
    from kvserve.engine.llm import _engine_args
    from kvserve.entrypoints.vllm_compat import ignored_flag_notes

    ns = _serve("--preemption-mode", "recompute", "--max-parallel-loading-workers", "2", "--cuda-graph-sizes", "1",
                "2", "--max-cudagraph-capture-size", "64", "--enable-log-outputs")
    assert [note.split(" ignored:")[0] for note in ignored_flag_notes(ns)] == [
        "--preemption-mode recompute", "--max-parallel-loading-workers", "--cuda-graph-sizes",
        "--max-cudagraph-capture-size", "--enable-log-outputs"]
    assert engine_args_from(ns) == engine_args_from(_serve())
    assert _engine_args({"preemption_mode": "recompute", "max_parallel_loading_workers": 2,
                         "max_cudagraph_capture_size": 64}) == {}
    assert "kvserve preempts requests by recomputing" in _exit_message(
        ["serve", "m", "--preemption-mode", "swap"], capsys)
    assert "--middleware is a vLLM option kvserve does not support; kvserve loads no ASGI middleware" in \
        _exit_message(["serve", "m", "--middleware", "app.mw"], capsys)


@pytest.mark.parametrize("command", [["serve", "/models/m"], ["generate", "--prompt", "x"],
                                     ["triton-repo", "--name", "m"]])
def test_enable_expert_parallel_is_accepted_and_noted(command: list[str]) -> None:
    """vLLM's --enable-expert-parallel (in its recipes for Qwen3-MoE and Mixtral): kvserve splits each expert's
    width over the tensor-parallel ranks instead, with the same outputs, so the flag changes nothing; it was
    argparse's bare "unrecognized arguments" (LLM(enable_expert_parallel=True) a TypeError)."""
    from kvserve.engine.llm import _engine_args
    from kvserve.entrypoints.vllm_compat import ignored_flag_notes

    ns = build_parser().parse_args([*command, "--enable-expert-parallel"])
    assert ignored_flag_notes(ns) == ["--enable-expert-parallel ignored: a mixture-of-experts model's experts are "
                                      "split over the --tensor-parallel-size ranks by each expert's width (the "
                                      "same outputs)"]
    assert engine_args_from(ns) == engine_args_from(build_parser().parse_args(command))
    assert _engine_args({"enable_expert_parallel": True}) == {}
    ns = build_parser().parse_args([*command, "--enable-expert-parallel", "--enable-eplb"])
    assert ignored_flag_notes(ns)[1].startswith("--enable-eplb ignored: ")
    assert engine_args_from(ns) == engine_args_from(build_parser().parse_args(command))
    assert _engine_args({"enable_expert_parallel": True, "enable_eplb": True}) == {}


@pytest.mark.parametrize("flags, chunked, prefix", [
    (["--enable-chunked-prefill", "False", "--enable-prefix-caching=false"], False, False),
    (["--enable-chunked-prefill", "true", "--enable-prefix-caching=TRUE"], True, True),
    (["--no-enable-prefix-caching", "--enable-chunked-prefill=False"], False, False),
])
def test_on_off_flags_take_vllms_earlier_true_false_values(flags: list[str], chunked: bool, prefix: bool) -> None:
    """vLLM's earlier `--enable-chunked-prefill false` / `=True` (a StoreBoolean flag; still in older compose
    files) was "unrecognized arguments: False"; the flag followed by a model keeps the model positional."""
    from kvserve.entrypoints.vllm_compat import parse_args_or_refuse

    ns = parse_args_or_refuse(build_parser(), ["serve", "/models/m", *flags])
    assert (ns.model_tag, ns.enable_chunked_prefill, ns.enable_prefix_caching) == ("/models/m", chunked, prefix)
    ns = parse_args_or_refuse(build_parser(), ["serve", "--no-enable-chunked-prefill", "--enable-chunked-prefill",
                                               "/models/true-model"])
    assert (ns.model_tag, ns.enable_chunked_prefill) == ("/models/true-model", True)


def test_a_config_file_holds_flags_as_vllms_does(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's `--config FILE` (YAML, flag names without dashes; refused before): true is the flag, false its
    --no- form where it has one, a list a flag's several words or one JSON word, a mapping JSON; the command
    line's own flags and positional model win over the file's."""
    from kvserve.entrypoints.openai.api_server import main as api_server_main
    from kvserve.entrypoints.vllm_compat import parse_args_or_refuse

    path = tmp_path / "serve.yaml"
    path.write_text("model: /models/from-file\nserved_model_name: [qwen, qwen-alias]\nport: 21002\n"
                    "max-model-len: 32K\nenable-prefix-caching: false\nenforce-eager: true\n"
                    "trust-remote-code: false\nallowed-origins: ['http://a']\n"
                    "override-generation-config: {temperature: 0.5}\nswap-space: null\n")
    ns = parse_args_or_refuse(build_parser(), ["serve", "--config", str(path)])
    assert (ns.model, ns.served_model_name, ns.port, ns.max_model_len) == (
        "/models/from-file", ["qwen", "qwen-alias"], 21002, 32768)
    assert (ns.enable_prefix_caching, ns.enforce_eager, ns.trust_remote_code, ns.swap_space) == (False, True, False, None)
    assert ns.allowed_origins == ["http://a"] and json.loads(ns.override_generation_config) == {"temperature": 0.5}
    ns = parse_args_or_refuse(build_parser(), ["serve", "/models/m", f"--config={path}", "--port", "21003",
                                               "--enable-prefix-caching"])
    assert (ns.model_tag, ns.model, ns.port, ns.enable_prefix_caching) == ("/models/m", None, 21003, True)
    for argv in (["--config", str(path), "serve", "/models/m", "--port", "1"],
                 ["serve", "--config", str(path), "/models/m", "--port", "1"]):
        ns = parse_args_or_refuse(build_parser(), argv)
        assert (ns.model_tag, ns.model, ns.port, ns.max_model_len) == ("/models/m", None, 1, 32768), argv
    with pytest.raises(SystemExit):
        api_server_main(["--config", str(path), "--port", "bad"])  # the module entry point reads it too
    assert "argument --port" in capsys.readouterr().err
    (tmp_path / "list.yaml").write_text("- port\n")
    for config, message in ((tmp_path / "none.yaml", "cannot read it"), (tmp_path / "list.yaml", "a mapping")):
        err = _exit_message(["serve", "--config", str(config)], capsys)
        assert err.startswith(f"kvserve serve: error: --config {config}: ") and message in err, err


def test_the_module_entry_point_refuses_them_too(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.entrypoints.openai.api_server import main as api_server_main

    with pytest.raises(SystemExit) as exited:
        api_server_main(["--enable-lora"])
    assert exited.value.code == 2
    assert "--enable-lora is a vLLM option kvserve does not support" in capsys.readouterr().err


def test_load_format_takes_vllms_names_and_refuses_a_mismatch(tiny_model_dir: Callable[..., str],
                                                               tiny_gguf_path: Callable[..., str]) -> None:
    from kvserve.config import ConfigError, EngineArgs

    hf_dir, gguf = tiny_model_dir("llama"), tiny_gguf_path("llama")

    def config(model: str, load_format: str) -> Any:
        ns = build_parser().parse_args(["serve", model, "--load-format", load_format, "--device", "cpu",
                                        "--kv-cache-memory", "16MiB"])
        return EngineArgs(**{**engine_args_from(ns), "model": model}).create_engine_config()  # type: ignore[arg-type]

    assert config(hf_dir, "safetensors").model_config.model == config(hf_dir, "auto").model_config.model
    assert config(gguf, "gguf").model_config.model == gguf
    with pytest.raises(ConfigError, match="--load-format safetensors needs an HF model directory.*--load-format gguf"):
        config(gguf, "safetensors")
    with pytest.raises(ConfigError, match="--load-format gguf needs a .gguf file.*--load-format safetensors"):
        config(hf_dir, "gguf")


def test_unread_vllm_variables_are_listed_with_equivalents(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve import envs

    for name in [n for n in os.environ if n.startswith("VLLM_")]:
        monkeypatch.delenv(name)
    assert envs.unread_vllm_env_vars() == []
    monkeypatch.setenv("VLLM_API_KEY", "k")  # read by kvserve: not listed
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")  # read by kvserve too
    monkeypatch.setenv("VLLM_USE_V1", "1")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert envs.unread_vllm_env_vars() == [
        "VLLM_CPU_KVCACHE_SPACE (use KVSERVE_CPU_KVCACHE_SPACE)", "VLLM_LOGGING_LEVEL (use KVSERVE_LOGGING_LEVEL)",
        "VLLM_USE_V1"]


def test_the_serving_line_says_when_only_this_machine_reaches_it() -> None:
    from kvserve.entrypoints.openai.api_server import serving_line

    local = serving_line("m", _serve(), "127.0.0.1", 8000)
    assert local == ("serving m on http://127.0.0.1:8000 (this machine only; --host 0.0.0.0 to accept others) "
                     "(OpenAI API under /v1)")
    assert "this machine only" not in serving_line("m", _serve("--host", "0.0.0.0"), "0.0.0.0", 8000)
    secure = serving_line("m", _serve("--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"), "127.0.0.1", 8443)
    assert secure.startswith("serving m on https://127.0.0.1:8443 ")


@pytest.mark.parametrize("flags, message", [
    (["--ssl-keyfile", "k.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-certfile", "c.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"],
     "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs"),
])
def test_ssl_flags_come_in_pairs(flags: list[str], message: str) -> None:
    from kvserve.entrypoints.openai.cli_args import server_engine_args

    with pytest.raises(ValueError, match=message):
        server_engine_args(_serve(*flags))



def test_https_files_that_cannot_be_loaded_are_refused_before_the_engine_starts(tmp_path: Any) -> None:
    """uvicorn loads them after the model is loaded: a missing file or one that is not PEM ended the server with
    a traceback once it had logged "serving ... on https://"."""
    import shutil
    import subprocess

    from kvserve.entrypoints.openai.cli_args import server_engine_args

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    for files, message in (((tmp_path / "none.pem", tmp_path / "none.key"), "No such file or directory"),
                           ((garbage, garbage), "PEM")):
        with pytest.raises(ValueError, match=r"^cannot load the HTTPS certificate and key \(--ssl-certfile .*"
                           + message):
            server_engine_args(_serve("--ssl-certfile", str(files[0]), "--ssl-keyfile", str(files[1])))
    if shutil.which("openssl") is None:
        return
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    server_engine_args(_serve("--ssl-certfile", str(cert), "--ssl-keyfile", str(key)))
    with pytest.raises(ValueError, match=r"^cannot load the CA certificates \(--ssl-ca-certs "):
        server_engine_args(_serve("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs",
                                  str(garbage)))


@pytest.mark.filterwarnings("error::UserWarning")  # the OpenAPI document builds without warnings (one id each)
@pytest.mark.parametrize("docs, status", [(True, 200), (False, 404)])
def test_disable_fastapi_docs(docs: bool, status: int) -> None:
    """--disable-fastapi-docs: no /docs, /redoc or /openapi.json (the API still answers)."""
    import asyncio
    from types import SimpleNamespace

    import httpx

    from kvserve.entrypoints.openai.api_server import build_app
    from kvserve.entrypoints.openai.middleware import ServerState
    from kvserve.entrypoints.openai.serving_common import ServingContext

    engine = SimpleNamespace(is_alive=True, dead_error=None, max_model_len=64)
    ctx = ServingContext(engine=engine, served_model_names=["m"], model_path="m",  # type: ignore[arg-type]
                         log_requests=False)
    app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20, docs=docs)  # type: ignore[arg-type]

    async def get(path: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return (await client.get(path)).status_code

    try:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert asyncio.run(get(path)) == status, path
        assert asyncio.run(get("/v1/models")) == 200
    finally:
        ctx.prepare_pool.shutdown(wait=False)


def test_engine_args_take_vllm_sizes(tiny_model_dir: Callable[..., str]) -> None:
    """LLM(max_model_len="1k") and EngineArgs take vLLM's human-readable token counts, as the CLI does."""
    config = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len="0.2k",
                        max_num_batched_tokens="2K").create_engine_config()
    assert (config.model_config.max_model_len, config.scheduler_config.max_num_batched_tokens) == (200, 2048)
    with pytest.raises(ConfigError, match="max_model_len: expected a whole number"):
        EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len="lots").create_engine_config()
    ns = build_parser().parse_args(["serve", "--max-num-batched-tokens", "16k"])
    assert ns.max_num_batched_tokens == 16000


def test_other_tools_do_not_refuse_vllm_flags_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    """kvserve bench and route are not vLLM's server: a vLLM engine flag there is just an unknown argument."""
    for command in (["bench"], ["route", "--backend", "http://a:1"]):
        with pytest.raises(SystemExit) as info:
            main([*command, "--enable-lora"])
        assert info.value.code == 2
        error = capsys.readouterr().err
        assert "unrecognized arguments: --enable-lora" in error and "vLLM option" not in error
    with pytest.raises(SystemExit):
        main(["serve", "--enable-lora"])
    assert "is a vLLM option kvserve does not support" in capsys.readouterr().err


def test_human_readable_int_is_configs_and_raises_config_error() -> None:
    """config.py owns vLLM's integer rule: programmatic callers get a ConfigError (a ValueError); the CLI turns
    it into argparse's error with the message kept (test_bad_human_readable_sizes_are_refused)."""
    from kvserve.config import human_readable_int

    assert [human_readable_int(t) for t in ("8192", "32k", "32K", "25.6k", "1t", "1T")] == [
        8192, 32000, 32768, 25600, 10**12, 1 << 40]
    with pytest.raises(ConfigError, match="did you mean 1.5k"):
        human_readable_int("1.5K")
    with pytest.raises(ConfigError, match="e.g. 8192, 32k or 32K"):
        human_readable_int("lots")


def test_config_reads_token_counts_without_importing_the_entrypoints() -> None:
    """LLM(max_model_len="32k") is read in config.py itself: the engine's configuration does not reach up into
    the CLI's package for it."""
    import subprocess
    import sys

    code = ("import sys; from kvserve.config import _token_count; assert _token_count('max_model_len', '32k') == "
            "32000; print(sorted(m for m in sys.modules if m.startswith('kvserve.entrypoints')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("text, value", [
    ("8g", 8 * 10**9), ("8G", 8 << 30), ("1.5g", 1_500_000_000), ("512M", 512 << 20), ("512m", 512 * 10**6),
    ("8000000000", 8 * 10**9), ("2GiB", 2 << 30), ("500MB", 500 * 10**6), ("512 MiB", 512 << 20), ("100B", 100),
    ("1t", 10**12), ("1T", 1 << 40), ("1TB", 10**12), ("1TiB", 1 << 40),  # a unit name for each suffix vLLM has
])
def test_kv_cache_memory_bytes_reads_sizes_as_vllm(text: str, value: int) -> None:
    """vLLM's --kv-cache-memory-bytes: lower-case suffixes are powers of 1000, upper-case ones of 1024, as in
    vLLM; sizes with a unit name (ending in B) are read as --kv-cache-memory reads them."""
    ns = _serve("--kv-cache-memory-bytes", text)
    assert ns.kv_cache_memory_bytes == value and ns.kv_cache_memory is None
    assert engine_args_from(ns)["kv_cache_memory_bytes"] == value


@pytest.mark.parametrize("text, value", [("8g", 8 << 30), ("8G", 8 << 30), ("4GiB", 4 << 30), ("512MiB", 512 << 20),
                                         ("500MB", 500 * 10**6), ("1048576", 1 << 20)])
def test_kv_cache_memory_keeps_its_own_reading(text: str, value: int) -> None:
    """kvserve's --kv-cache-memory reads suffixes without case (8g = 8 GiB), as documented."""
    from kvserve.config import parse_memory_size

    ns = _serve("--kv-cache-memory", text)
    assert ns.kv_cache_memory_bytes is None
    assert parse_memory_size(engine_args_from(ns)["kv_cache_memory"]) == value  # type: ignore[arg-type]


@pytest.mark.parametrize("text, message", [("1.5G", "did you mean 1.5g"), ("lots", "e.g. 8GiB or 512MiB"),
                                           ("8 gigs", "e.g. 8GiB"), ("infB", "not a finite number of bytes")])
def test_bad_kv_cache_memory_bytes_are_refused(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # the parser alone: a value it took would not start a server
        build_parser().parse_args(["serve", "--kv-cache-memory-bytes", text])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-cache-memory-bytes" in err and message in err


@pytest.mark.parametrize("value", ["inf", "-inf", "nanGiB", "1e400", "-1GiB", float("inf"), -1])
def test_a_kv_cache_memory_that_is_no_size_is_a_config_error(value: str | float) -> None:
    """Not int()'s OverflowError, which the command would show as a traceback: a ConfigError, which it reports."""
    from kvserve.config import ConfigError, parse_memory_size

    with pytest.raises(ConfigError, match="not a finite number of bytes"):
        parse_memory_size(value)


def test_kv_cache_memory_takes_tebibytes() -> None:
    from kvserve.config import parse_memory_size

    assert parse_memory_size("1t") == parse_memory_size("1TiB") == 1 << 40 and parse_memory_size("2TB") == 2 * 10**12


def test_engine_args_read_kv_cache_memory_bytes_as_vllm(tiny_model_dir: Callable[..., str]) -> None:
    """LLM(kv_cache_memory_bytes=...) and the flag agree; kv_cache_memory keeps its reading; not both."""
    model = tiny_model_dir("llama")

    def kv_bytes(**size: object) -> int:
        args = EngineArgs(model=model, device="cpu", max_model_len=64, **size)  # type: ignore[arg-type]
        return args.create_engine_config().cache_config.kv_cache_memory_bytes

    assert kv_bytes(kv_cache_memory_bytes="64m") == 64 * 10**6
    assert kv_bytes(kv_cache_memory_bytes="64M") == kv_bytes(kv_cache_memory_bytes="64MiB") == 64 << 20
    assert kv_bytes(kv_cache_memory_bytes=64_000_000) == 64 * 10**6
    assert kv_bytes(kv_cache_memory="64m") == 64 << 20
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes: a binary suffix"):
        kv_bytes(kv_cache_memory_bytes="1.5G")
    with pytest.raises(ConfigError, match="the KV cache size is given twice"):
        kv_bytes(kv_cache_memory="64MiB", kv_cache_memory_bytes="64m")
    ns = _serve("--kv-cache-memory", "64MiB", "--kv-cache-memory-bytes", "64m")
    with pytest.raises(ConfigError, match="--kv-cache-memory.*--kv-cache-memory-bytes.*pass one"):
        EngineArgs(**{**engine_args_from(ns), "model": model, "device": "cpu"}).create_engine_config()  # type: ignore[arg-type]


@pytest.mark.parametrize("flag, kvserve_env, vllm_env, key, source", [
    ("flag-secret", "kvserve-secret", "vllm-secret", "flag-secret", "API key from --api-key"),
    (None, "kvserve-secret", "vllm-secret", "kvserve-secret", "API key from KVSERVE_API_KEY"),
    (None, "", "vllm-secret", None, "no API key: KVSERVE_API_KEY is set empty (VLLM_API_KEY, also set, is not read)"),
    (None, "", None, None, "no API key: KVSERVE_API_KEY is set empty; /v1/* is open"),
    (None, None, "vllm-secret", "vllm-secret", "API key from VLLM_API_KEY (no --api-key, KVSERVE_API_KEY unset)"),
    ("", None, "vllm-secret", "vllm-secret", "API key from VLLM_API_KEY"),  # --api-key "": not given, as in vLLM
    (None, None, None, None, "no API key (no --api-key, KVSERVE_API_KEY or VLLM_API_KEY)"),
])
def test_api_key_sources_in_order(flag: str | None, kvserve_env: str | None, vllm_env: str | None,
                                  key: str | None, source: str) -> None:
    """--api-key, then KVSERVE_API_KEY when set at all (empty: no key, and VLLM_API_KEY is not read), then
    VLLM_API_KEY; the log line names the source and never the key."""
    from kvserve.entrypoints.openai.cli_args import api_key_from

    got_key, line = api_key_from(flag, kvserve_env, vllm_env)
    assert got_key == key and line.startswith(source), line
    assert "secret" not in line


@pytest.mark.parametrize("key, why", [
    ("sekret\n", "control character"), ("sek\x00ret", "control character"), ("sekret\x7f", "control character"),
    (" sekret", "white space"), ("sekret\t", "white space"), ("sekrét", "outside ASCII"),
])
def test_an_api_key_no_client_can_send_is_refused_at_start(monkeypatch: pytest.MonkeyPatch, key: str, why: str) -> None:
    """A key no Authorization header can carry as it is (a secret's last newline, space at an end, a character
    outside ASCII): the server started and answered 401 to every request, or failed comparing a key outside
    ASCII. Refused from each source, naming it, before the engine starts (`server_engine_args`)."""
    from kvserve import envs
    from kvserve.entrypoints.openai.cli_args import api_key_from, server_engine_args

    for flag, kvserve_env, vllm_env, source in [(key, None, None, "--api-key"), (None, key, None, "KVSERVE_API_KEY"),
                                                (None, None, key, "VLLM_API_KEY")]:
        with pytest.raises(ValueError, match=f"^{source}: the API key .*{why}"):
            api_key_from(flag, kvserve_env, vllm_env)
    monkeypatch.setattr(envs, "KVSERVE_API_KEY", None)
    monkeypatch.setattr(envs, "VLLM_API_KEY", None)
    with pytest.raises(ValueError, match=f"--api-key: the API key .*{why}"):
        server_engine_args(_serve("--api-key", key))
    assert api_key_from("sek ret\t!", None, None)[0] == "sek ret\t!"  # inside a key, space and tabs are sent
    assert server_engine_args(_serve("--api-key", "sekret"))["model"] == "/models/m"  # a sendable key: taken


def test_tokenizer_mode_hf_is_what_kvserve_does() -> None:
    """vLLM's `hf` tokenizer mode (the Hugging Face tokenizer) is what kvserve always loads: taken, as `auto`."""
    assert build_parser().parse_args(["serve", "--tokenizer-mode", "hf"]).tokenizer_mode == "hf"
