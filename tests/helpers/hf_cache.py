"""A Hugging Face cache laid out as huggingface_hub writes it, for tests of repo ids resolved offline:
<cache>/models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<branch>}."""

from __future__ import annotations

import hashlib
import os


def add_snapshot(cache_dir: str, repo_id: str, commit: str, source_dir: str, refs: tuple[str, ...] = ()) -> str:
    """Put the files of `source_dir` into the cache as `repo_id`'s snapshot `commit` (relative symlinks into
    blobs/, as the Hub client does), point each branch of `refs` at it; returns the snapshot directory."""
    repo_dir = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo_dir, "snapshots", commit)
    os.makedirs(os.path.join(repo_dir, "blobs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    for name in sorted(os.listdir(source_dir)):
        with open(os.path.join(source_dir, name), "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        blob_path = os.path.join(repo_dir, "blobs", blob)
        if not os.path.exists(blob_path):
            with open(blob_path, "wb") as f:
                f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    for ref in refs:
        ref_path = os.path.join(repo_dir, "refs", ref)
        os.makedirs(os.path.dirname(ref_path), exist_ok=True)
        with open(ref_path, "w") as f:
            f.write(commit)
    return snapshot
