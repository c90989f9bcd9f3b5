"""Which model a run trains, by content: a hash of a checkpoint's config.json and weight files.

A run records this hash instead of the folder's path, so a resume from another folder
holding the same files is the same run, and a resume with other weights behind the same
path is refused. (`hf.source_fingerprint` is to replace `content_hash` once it lands.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
CHUNK_BYTES = 1 << 20


def content_hash(directory) -> str:
    """sha256 over config.json and the weight files of a Hugging Face checkpoint folder: each
    file's name and bytes, in name order (so renaming a shard changes it, moving the folder not)."""
    directory = Path(directory)
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in directory.glob(pattern)} | {directory / "config.json"})
    digest = hashlib.sha256()
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{directory} has no {path.name}: not a Hugging Face checkpoint folder")
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def download(repo_id: str, revision: str | None = None) -> Path:
    """A Hub repository's config, tokenizer and safetensors files at `revision` (online; the
    standard Hub token, e.g. from `huggingface-cli login` or HF_TOKEN, for gated models)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"]))
    except Exception as err:  # offline, unknown repository or revision, gated model without a token
        raise FileNotFoundError(
            f"could not download {repo_id!r}{f' at revision {revision!r}' if revision else ''} from the Hugging "
            f"Face Hub ({type(err).__name__}: {err}). Offline, pass a local folder; for a gated model, log in "
            "with `huggingface-cli login` or set HF_TOKEN") from err
