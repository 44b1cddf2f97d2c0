"""vLLM command lines that run unchanged: vLLM flags kvserve accepts and ignores (each reported at start as
"ignored: <why>"), and vLLM flags it refuses by name (instead of argparse's bare "unrecognized arguments").
vLLM's human-readable integers (`--max-model-len 32k`) are read by `kvserve.config.human_readable_int`.

Kept free of heavy imports: `kvserve --help` builds the parsers that use it.
"""

from __future__ import annotations

import argparse
import sys
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
    "--middleware": "kvserve loads no ASGI middleware by import path; put it in a proxy in front of the server",
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


def _reporting_parser(parser: argparse.ArgumentParser, args: list[str], command: str,
                      extras: list[str]) -> argparse.ArgumentParser:
    """The parser whose arguments `extras` were among: that of the subcommand `command` of `parser`, unless one
    of them came before the subcommand's name in `args` (then `parser`'s own, as argparse would say)."""
    if command not in args or any(extra in args[:args.index(command)] for extra in extras):
        return parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def dashed_flags(args: Sequence[str]) -> list[str]:
    """`args` with each long flag's name spelled with dashes, as vLLM's parser reads them: `--max_model_len 8192`
    and `--gpu_memory_utilization=0.9` (common in Docker and Kubernetes command lines) are `--max-model-len` and
    `--gpu-memory-utilization`. Values, and every word after a bare `--`, are kept as written."""
    result: list[str] = []
    for index, arg in enumerate(args):
        if arg == "--":
            return result + list(args[index:])
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        result.append(arg)
    return result


class ConfigFileError(ValueError):
    """A `--config FILE` that cannot be read as vLLM's YAML config of flags; `prog`: the (sub)command's."""

    def __init__(self, message: str, prog: str = "") -> None:
        super().__init__(message)
        self.prog = prog


def _config_file_words(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags that vLLM's `--config FILE` stands for: a YAML mapping of flag names (without the dashes)
    to values, read as vLLM reads it: `port: 8000` is `--port 8000`, `enforce-eager: true` is `--enforce-eager`;
    false is `--no-<flag>` where the flag has that form (`enable-prefix-caching: false`), else the flag's
    default; a list gives its items as words of a flag that takes several (`served-model-name: [a, b]`), and a
    list or mapping is one JSON word for any other flag (`override-generation-config: {temperature: 0.5}`)."""
    import json

    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError(f"cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"not valid YAML: {' '.join(str(exc).split())}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ConfigFileError(f"expected a mapping of flag names to values (e.g. port: 8000), got a "
                              f"{type(config).__name__}")
    actions = parser._option_string_actions
    words: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).removeprefix("--").replace("_", "-")
        if flag == "--config":
            raise ConfigFileError("a config file cannot name another (--config)")
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                words.append(flag)
            elif "--no-" + flag[2:] in actions:
                words.append("--no-" + flag[2:])
            continue
        action = actions.get(flag)
        if isinstance(value, list) and action is not None and action.nargs in ("+", "*"):
            words += [flag, *(json.dumps(item) if isinstance(item, (dict, list)) else str(item) for item in value)]
        elif isinstance(value, (dict, list)):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return words


def _command_parser(parser: argparse.ArgumentParser, args: Sequence[str]) -> tuple[argparse.ArgumentParser, int]:
    """(the parser of the subcommand named in `args`, the index after its name); (`parser`, 0) for a parser
    without subcommands; (`parser`, -1) when `args` names none of them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            first = next((j for j, arg in enumerate(args) if arg in action.choices), None)
            if first is None:
                return parser, -1
            return action.choices[args[first]], first + 1
    return parser, 0


_BOOLEAN_WORDS = {"true": True, "false": False}


def explicit_booleans(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`args` with an on/off flag given a value as vLLM's earlier releases took one (`--enable-chunked-prefill
    false`, `--enable-prefix-caching=True`: their StoreBoolean flags took true or false, any case, as the next
    word or after =) as the flag or its --no- form. Only the words true and false are read so, so a flag
    followed by a model path keeps it."""
    command_parser, _ = _command_parser(parser, args)
    flags = {option for action in command_parser._actions if isinstance(action, argparse.BooleanOptionalAction)
             for option in action.option_strings if option.startswith("--") and not option.startswith("--no-")}
    result: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return result + args[i:]
        name, eq, value = arg.partition("=")
        if name in flags and eq and value.lower() in _BOOLEAN_WORDS:
            result.append(name if _BOOLEAN_WORDS[value.lower()] else "--no-" + name[2:])
            i += 1
        elif name in flags and not eq and i + 1 < len(args) and args[i + 1].lower() in _BOOLEAN_WORDS:
            result.append(name if _BOOLEAN_WORDS[args[i + 1].lower()] else "--no-" + name[2:])
            i += 2
        else:
            result.append(arg)
            i += 1
    return result


def with_config_file(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`args` with `--config FILE` replaced by the flags the file holds (`_config_file_words`), put where vLLM
    puts them: after the subcommand and its positional model, before the other flags given, so that those
    win; the file's `model` gives way to a positional model. ConfigFileError for a file that cannot be read."""
    end = args.index("--") if "--" in args else len(args)
    at = [i for i, arg in enumerate(args[:end]) if arg == "--config" or arg.startswith("--config=")]
    if not at:
        return args
    command_parser, start = _command_parser(parser, args)
    if start < 0:
        return args  # no subcommand: argparse says so
    if len(at) > 1:
        raise ConfigFileError("given more than once; pass one file", command_parser.prog)
    i = at[0]
    if args[i] == "--config":
        if i + 1 >= end:
            raise ConfigFileError("expected a file name after it", command_parser.prog)
        path, rest = args[i + 1], args[:i] + args[i + 2:]
    else:
        path, rest = args[i].partition("=")[2], args[:i] + args[i + 1:]
    try:
        words = _config_file_words(path, command_parser)
    except ConfigFileError as exc:
        raise ConfigFileError(f"{path}: {exc}", command_parser.prog) from None
    _, start = _command_parser(parser, rest)  # where the subcommand's words start once --config FILE is out
    takes_model = any(not action.option_strings and action.dest == "model_tag" for action in command_parser._actions)
    if takes_model and start < len(rest) and not rest[start].startswith("-"):
        start += 1  # the positional model stays first, and wins over the file's
        if "--model" in words:
            model_at = words.index("--model")
            words = words[:model_at] + words[model_at + 2:]
    return rest[:start] + words + rest[start:]


def parse_args_or_refuse(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                         prog_of: dict[str, str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, except that a known vLLM flag kvserve does not support is refused by name
    (exit 2, as argparse's errors). `prog_of` names the program by subcommand (ns.command); given, only its
    subcommands refuse vLLM's flags by name (others get argparse's message). Unrecognized arguments are
    reported by the subcommand's parser (`kvserve serve: error: ...` under its usage), as argparse reports a
    subcommand's other errors: parse_known_args hands them up to the top parser, whose usage is not theirs.
    Flags spelled with underscores are read as with dashes (`dashed_flags`), `--config FILE` as the flags the
    YAML file holds (`with_config_file`), and an on/off flag's true or false as the flag or its --no- form
    (`explicit_booleans`), as vLLM reads them."""
    args = dashed_flags(sys.argv[1:] if argv is None else argv)
    try:
        args = explicit_booleans(parser, with_config_file(parser, args))
    except ConfigFileError as exc:
        parser.exit(2, f"{exc.prog or parser.prog}: error: --config {exc}\n")
    ns, extras = parser.parse_known_args(args)
    if extras:
        flag = unsupported_vllm_flag(extras)
        command = getattr(ns, "command", None) or ""
        if flag is not None and (prog_of is None or command in prog_of):
            prog = (prog_of or {}).get(command, parser.prog)
            parser.exit(2, refusal(prog, flag) + "\n")
        _reporting_parser(parser, args, command, extras).error(f"unrecognized arguments: {' '.join(extras)}")
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


def _vllm_choice(accepted: Sequence[str], refused: dict[str, str], any_other: str = "") -> Callable[[str], str]:
    """argparse `type=` for a vLLM flag's value: one of `accepted` (what kvserve does anyway), or refused with
    why: vLLM's other values by `refused` (value -> the reason), any other value by `any_other` where given (a
    free-form value), else as argparse's invalid choice."""
    def parse(text: str) -> str:
        if text in accepted:
            return text
        reason = refused.get(text, any_other)
        if reason:
            raise argparse.ArgumentTypeError(f"{text!r} is not supported: {reason}")
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(accepted)})")

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
    p.add_argument("--tokenizer-mode", type=_vllm_choice(["auto", "hf"], {
        "slow": "kvserve always loads the fast tokenizer (tokenizer.json, or one built from the .gguf file)",
        "mistral": "kvserve tokenizes with the checkpoint's Hugging Face tokenizer, not mistral_common; serve a "
                   "checkpoint in Hugging Face format (with tokenizer.json)",
        "custom": "kvserve has no tokenizer plug-ins; it loads the checkpoint's Hugging Face tokenizer",
    }), default=None, help=hide)
    p.add_argument("--model-impl", type=_vllm_choice(["auto", "vllm"], {
        "transformers": "kvserve runs its own implementation of each architecture it serves, never the "
                        "Transformers modeling code",
    }), default=None, help=hide)
    p.add_argument("--hf-token", nargs="?", const=True, default=None, help=hide)
    p.add_argument("--max-seq-len-to-capture", type=int, default=None, help=hide)
    p.add_argument("--disable-custom-all-reduce", action="store_true", default=None, help=hide)
    p.add_argument("--task", choices=["auto", "generate"], default=None, help=hide)
    p.add_argument("--guided-decoding-backend", choices=["auto", "guidance", "xgrammar", "outlines"], default=None,
                   help=hide)
    p.add_argument("--preemption-mode", type=_vllm_choice(["recompute"], {
        "swap": "kvserve preempts requests by recomputing them; it swaps nothing to the CPU",
    }), default=None, help=hide)
    p.add_argument("--max-parallel-loading-workers", type=int, default=None, help=hide)
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, help=hide)
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None, help=hide)
    p.add_argument("--enable-expert-parallel", action="store_true", default=None, help=hide)
    p.add_argument("--enable-eplb", action="store_true", default=None, help=hide)


def add_ignored_server_args(parser: argparse.ArgumentParser) -> None:
    """vLLM server flags that change nothing in kvserve (see add_ignored_engine_args)."""
    hide = argparse.SUPPRESS
    parser.add_argument("--enable-reasoning", action="store_true", default=None, help=hide)
    parser.add_argument("--enable-prompt-tokens-details", action="store_true", default=None, help=hide)
    parser.add_argument("--chat-template-content-format", type=_vllm_choice(["auto", "string"], {
        "openai": "message content reaches the chat template as a string (text parts joined by newlines), never "
                  "as OpenAI's list of parts",
    }), default=None, help=hide)
    parser.add_argument("--max-log-len", type=int, default=None, help=hide)
    parser.add_argument("--disable-frontend-multiprocessing", action="store_true", default=None, help=hide)
    parser.add_argument("--enable-log-outputs", action="store_true", default=None, help=hide)


# dest -> (the flag as noted, "{value}" standing for its value; why it changes nothing here)
_IGNORED_WHY: dict[str, tuple[str, str]] = {
    "swap_space": ("--swap-space", "kvserve preempts requests by recomputing them, so it swaps nothing to the CPU"),
    "pipeline_parallel_size": ("--pipeline-parallel-size 1", "1 is the only size"),
    "data_parallel_size": ("--data-parallel-size 1", "one replica is the default"),
    "distributed_executor_backend": ("--distributed-executor-backend",
                                     "tensor-parallel ranks always run as processes of this machine"),
    "tokenizer_mode": ("--tokenizer-mode {value}", "the model's fast tokenizer is always used"),
    "max_seq_len_to_capture": ("--max-seq-len-to-capture",
                               "kvserve's CUDA graphs serve every length up to --max-model-len"),
    "disable_custom_all_reduce": ("--disable-custom-all-reduce", "tensor parallelism all-reduces with NCCL"),
    "task": ("--task", "kvserve serves text generation only"),
    "guided_decoding_backend": ("--guided-decoding-backend", "structured output always uses llguidance"),
    "model_impl": ("--model-impl {value}", "kvserve runs its own implementation of each architecture it serves"),
    "hf_token": ("--hf-token", "kvserve never downloads: models come from local paths or the local Hugging Face "
                               "cache"),
    "preemption_mode": ("--preemption-mode recompute", "kvserve always preempts by recomputing"),
    "max_parallel_loading_workers": ("--max-parallel-loading-workers", "kvserve loads the weights itself, file by "
                                                                       "file"),
    "cuda_graph_sizes": ("--cuda-graph-sizes", "kvserve captures its own decode batch sizes, up to --max-num-seqs "
                                               "(--enforce-eager: none)"),
    "max_cudagraph_capture_size": ("--max-cudagraph-capture-size", "kvserve captures its own decode batch sizes, up "
                                                                   "to --max-num-seqs (--enforce-eager: none)"),
    "enable_expert_parallel": ("--enable-expert-parallel", "a mixture-of-experts model's experts are split over the "
                               "--tensor-parallel-size ranks by each expert's width (the same outputs)"),
    "enable_eplb": ("--enable-eplb", "with every rank holding a share of every expert there is no expert placement "
                    "to balance"),
    "enable_reasoning": ("--enable-reasoning", "--reasoning-parser turns reasoning on"),
    "enable_prompt_tokens_details": ("--enable-prompt-tokens-details",
                                     "usage always carries prompt_tokens_details.cached_tokens"),
    "chat_template_content_format": ("--chat-template-content-format {value}",
                                     "message content reaches the chat template as a string (text parts joined by "
                                     "newlines)"),
    "max_log_len": ("--max-log-len", "request log lines carry no prompt (prompts are logged, whole, only at DEBUG "
                                     "level)"),
    "disable_frontend_multiprocessing": ("--disable-frontend-multiprocessing",
                                         "the engine core always runs in a process of its own"),
    "enable_log_outputs": ("--enable-log-outputs", "request log lines carry no generated text"),
}


def ignored_flag_notes(ns: argparse.Namespace) -> list[str]:
    """One "ignored: <why>" line for each accepted-and-ignored vLLM flag given."""
    notes = []
    for dest, (flag, why) in _IGNORED_WHY.items():
        if dest == "data_parallel_size" and getattr(ns, dest, None) not in (None, 1):
            continue  # more than one: the server's replicas (kvserve serve --data-parallel-size)
        value = getattr(ns, dest, None)
        if value is not None and value is not False:  # given (0 too: --max-log-len 0, --swap-space 0)
            notes.append(f"{flag.format(value=value)} ignored: {why}")
    return notes
