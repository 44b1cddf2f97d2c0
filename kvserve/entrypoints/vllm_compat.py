"""vLLM command lines that run unchanged: vLLM flags kvserve accepts and ignores (each reported at start as
"ignored: <why>"), and vLLM flags it refuses by name (instead of argparse's bare "unrecognized arguments").
vLLM's human-readable integers (`--max-model-len 32k`) are read by `kvserve.config.human_readable_int`.

Kept free of heavy imports: `kvserve --help` builds the parsers that use it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

# vLLM flags kvserve does not support -> what to do instead ("" where there is nothing to suggest).
_TEXT_ONLY = "kvserve serves text-only models"
_NO_LORA = "merge the adapter into the model's weights and serve the merged checkpoint"
UNSUPPORTED_VLLM_FLAGS: dict[str, str] = {
    "--enable-lora": _NO_LORA,
    "--lora-modules": _NO_LORA,
    "--max-loras": _NO_LORA,
    "--max-lora-rank": _NO_LORA,
    "--speculative-config": "",
    "--cpu-offload-gb": "to fit a GPU, lower --max-model-len or --max-num-seqs, use a quantized checkpoint (AWQ, "
                        "GPTQ, GGUF) or split the model with --tensor-parallel-size",
    "--enable-sleep-mode": "",
    "--kv-transfer-config": "",
    "--limit-mm-per-prompt": _TEXT_ONLY,
    "--mm-processor-kwargs": _TEXT_ONLY,
    "--compilation-config": "kvserve captures CUDA graphs itself; --enforce-eager turns them off",
    "-O": "kvserve captures CUDA graphs itself; --enforce-eager turns them off",
    "--hf-overrides": "edit a copy of the model's config.json",
    "--rope-scaling": "set rope_scaling in a copy of the model's config.json",
    "--config": "pass the flags on the command line",
    "--calculate-kv-scales": "with --kv-cache-dtype fp8 kvserve stores K and V with scales of 1.0, vLLM's default "
                             "when the checkpoint has none",
}


def unsupported_vllm_flag(args: Sequence[str]) -> str | None:
    """The first of `args` (argparse's unrecognized arguments) that is a vLLM flag kvserve does not support."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in UNSUPPORTED_VLLM_FLAGS:
            return name
        if arg.startswith("-O") and not arg.startswith("--"):  # -O3, -O 3, -O.level=3
            return "-O"
    return None


def refusal(prog: str, flag: str) -> str:
    """The error line for a vLLM flag kvserve does not support."""
    alternative = UNSUPPORTED_VLLM_FLAGS[flag]
    return f"{prog}: error: {flag} is a vLLM option kvserve does not support" + (
        f"; {alternative}" if alternative else "")


def parse_args_or_refuse(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                         prog_of: dict[str, str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, except that a known vLLM flag kvserve does not support is refused by name
    (exit 2, as argparse's errors). `prog_of` names the program by subcommand (ns.command); given, only its
    subcommands refuse vLLM's flags by name (others get argparse's message)."""
    ns, extras = parser.parse_known_args(argv)
    if extras:
        flag = unsupported_vllm_flag(extras)
        command = getattr(ns, "command", None) or ""
        if flag is not None and (prog_of is None or command in prog_of):
            prog = (prog_of or {}).get(command, parser.prog)
            parser.exit(2, refusal(prog, flag) + "\n")
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return ns


# ----------------------------------------------------------------------------- flags accepted and ignored


def _just_one(alternative: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value != 1:
            raise argparse.ArgumentTypeError(f"only 1 is accepted, got {value}: {alternative}")
        return value

    return parse


def positive_int(text: str) -> int:
    """argparse `type=` for a count of at least 1 (replicas, API processes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_ignored_engine_args(parser: argparse.ArgumentParser, data_parallel: bool = False) -> None:
    """vLLM engine flags that change nothing in kvserve, accepted so vLLM command lines run (not in --help:
    README lists them). Values that would change something in vLLM are refused. With `data_parallel` (the
    server) --data-parallel-size is a real flag instead: that many replicas behind one port."""
    p, hide = parser, argparse.SUPPRESS
    p.add_argument("--swap-space", type=float, default=None, help=hide)
    p.add_argument("--pipeline-parallel-size", "-pp", type=_just_one(
        "kvserve has no pipeline parallelism; split a model over GPUs with --tensor-parallel-size, or run "
        "several servers behind `kvserve route`"), default=None, help=hide)
    if data_parallel:
        p.add_argument("--data-parallel-size", "-dp", type=positive_int, default=None, metavar="N",
                       help="engine replicas behind this server's one port, each on its own "
                       "--tensor-parallel-size GPUs (replica i takes the i-th group of the visible GPUs; on CPU, "
                       "processes sharing the cores); requests go to them by prompt prefix (default 1)")
    else:
        p.add_argument("--data-parallel-size", "-dp", type=_just_one(
            "for data parallelism use `kvserve serve --data-parallel-size N`, or run several servers behind "
            "`kvserve route`"), default=None, help=hide)
    p.add_argument("--distributed-executor-backend", choices=["mp", "uni"], default=None, help=hide)
    p.add_argument("--tokenizer-mode", choices=["auto"], default=None, help=hide)
    p.add_argument("--max-seq-len-to-capture", type=int, default=None, help=hide)
    p.add_argument("--disable-custom-all-reduce", action="store_true", default=None, help=hide)
    p.add_argument("--task", choices=["auto", "generate"], default=None, help=hide)
    p.add_argument("--guided-decoding-backend", choices=["auto", "guidance", "xgrammar", "outlines"], default=None,
                   help=hide)


def add_ignored_server_args(parser: argparse.ArgumentParser) -> None:
    """vLLM server flags that change nothing in kvserve (see add_ignored_engine_args)."""
    hide = argparse.SUPPRESS
    parser.add_argument("--enable-reasoning", action="store_true", default=None, help=hide)
    parser.add_argument("--enable-prompt-tokens-details", action="store_true", default=None, help=hide)


# dest -> why it changes nothing here
_IGNORED_WHY: dict[str, tuple[str, str]] = {
    "swap_space": ("--swap-space", "kvserve preempts requests by recomputing them, so it swaps nothing to the CPU"),
    "pipeline_parallel_size": ("--pipeline-parallel-size 1", "1 is the only size"),
    "data_parallel_size": ("--data-parallel-size 1", "one replica is the default"),
    "distributed_executor_backend": ("--distributed-executor-backend",
                                     "tensor-parallel ranks always run as processes of this machine"),
    "tokenizer_mode": ("--tokenizer-mode auto", "the model's fast tokenizer is always used"),
    "max_seq_len_to_capture": ("--max-seq-len-to-capture",
                               "kvserve's CUDA graphs serve every length up to --max-model-len"),
    "disable_custom_all_reduce": ("--disable-custom-all-reduce", "tensor parallelism all-reduces with NCCL"),
    "task": ("--task", "kvserve serves text generation only"),
    "guided_decoding_backend": ("--guided-decoding-backend", "structured output always uses llguidance"),
    "enable_reasoning": ("--enable-reasoning", "--reasoning-parser turns reasoning on"),
    "enable_prompt_tokens_details": ("--enable-prompt-tokens-details",
                                     "usage always carries prompt_tokens_details.cached_tokens"),
}


def ignored_flag_notes(ns: argparse.Namespace) -> list[str]:
    """One "ignored: <why>" line for each accepted-and-ignored vLLM flag given."""
    notes = []
    for dest, (flag, why) in _IGNORED_WHY.items():
        if dest == "data_parallel_size" and getattr(ns, dest, None) not in (None, 1):
            continue  # more than one: the server's replicas (kvserve serve --data-parallel-size)
        if getattr(ns, dest, None) not in (None, False):
            notes.append(f"{flag} ignored: {why}")
    return notes
