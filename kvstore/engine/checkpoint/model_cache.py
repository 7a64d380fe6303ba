"""The model cache: GGUF files' converted copies (``gguf_reader``), one directory per source
file, named by its sha256, that ``load_checkpoint`` reads as a Hugging Face checkpoint.

The cache is ``cache_dir``, else ``$KVSTORE_MODEL_CACHE``, else ``./.kvstore/models``. The GGUF is
hashed on every call, in chunks (no stat shortcut: ~0.1 s for SmolLM2's 98 MB). An entry is
built in a temporary directory beside it, its manifest (``kvstore-gguf.json``: the converter's
version, the source's sha256, each file's size and xxh3-128) written and synced last, and then
renamed into place whole, so no reader sees half of one. An entry that does not match its
manifest is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvstore import env
from kvstore.engine.checkpoint.gguf_reader import GGUF_MAGIC, write_hf_copy
from kvstore.engine.checkpoint.types import CheckpointError

log = logging.getLogger("kvstore.engine")

CONVERTER_VERSION = 1  # bump when a converted copy's layout changes: older entries are rebuilt
MANIFEST = "kvstore-gguf.json"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ConvertedGGUF:
    """Where a GGUF's converted copy is, and whether this call built it."""

    path: Path  # the Hugging Face-layout directory
    sha256: str  # of the GGUF file
    built: bool  # False: an existing entry, verified against its manifest, was reused
    seconds: float  # hashing + verifying (+ converting, when built)


def default_cache_dir() -> Path:
    """``$KVSTORE_MODEL_CACHE``, else ``./.kvstore/models`` (the data directory's models)."""
    return Path(env.model_cache() or Path(".kvstore") / "models")


def convert_gguf(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> ConvertedGGUF:
    """The converted copy of the GGUF at ``path``: reused if its cache entry checks out, else built.

    Raises:
        CheckpointError: the file is missing, not a GGUF, truncated, of an architecture or
            quantization the engine or the gguf package lacks; or the cache cannot be written.
    """
    start = time.perf_counter()
    src = Path(path)
    if not src.is_file():
        raise CheckpointError(f"model {src} does not exist" if not src.exists() else f"model {src} is not a file")
    with open(src, "rb") as fh:
        head = fh.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise CheckpointError(f"{src} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}); "
                              "a model is a Hugging Face checkpoint directory or a .gguf file")
    digest = _sha256(src)
    entry = Path(cache_dir if cache_dir is not None else default_cache_dir()) / digest
    problem = verify_entry(entry, digest)
    if problem is None:
        return ConvertedGGUF(entry, digest, False, time.perf_counter() - start)
    if entry.exists():
        log.warning("the converted copy of %s at %s is not usable (%s); rebuilding it", src.name, entry, problem)
    log.info("converting %s (%.0f MB) into %s; later starts reuse it", src.name, src.stat().st_size / 1e6, entry)
    _publish(src, entry, digest)
    return ConvertedGGUF(entry, digest, True, time.perf_counter() - start)


def verify_entry(entry: Path, digest: str) -> str | None:
    """None if ``entry`` is a complete copy of the GGUF with sha256 ``digest``, else what is wrong."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest" if entry.exists() else "absent"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"unreadable manifest: {exc}"
    if not isinstance(manifest, dict) or manifest.get("converter") != CONVERTER_VERSION:
        version = manifest.get("converter") if isinstance(manifest, dict) else None
        return f"converter version {version}, not {CONVERTER_VERSION}"
    if manifest.get("source_sha256") != digest:
        return "the manifest names another source file"
    files = manifest.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return "the manifest lists no weights"
    for name, want in files.items():
        if not isinstance(want, dict):
            return f"the manifest's entry for {name} is malformed"
        try:
            size = (entry / name).stat().st_size
            if size != want.get("size"):
                return f"{name} is {size} bytes, the manifest says {want.get('size')}"
            checksum = _xxh3(entry / name)
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
        if checksum != want.get("xxh3_128"):
            return f"{name} does not match its checksum"
    return None


def _publish(src: Path, entry: Path, digest: str) -> None:
    """Build the copy beside ``entry``, then rename it into place (replacing a bad entry)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.parent / f".tmp-{digest[:16]}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as exc:
        raise CheckpointError(f"cannot write the converted copy of {src.name} under {entry.parent}: {exc} "
                              "(set KVSTORE_MODEL_CACHE to a writable directory)") from None
    try:
        write_hf_copy(src, tmp)
        _write_manifest(src, tmp, digest)
        if entry.exists():
            trash = entry.parent / f".old-{digest[:16]}-{uuid.uuid4().hex[:8]}"
            os.replace(entry, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process published first: keep theirs if it checks out
            if verify_entry(entry, digest) is not None:
                raise
        _fsync_dir(entry.parent)
    except OSError as exc:
        raise CheckpointError(f"cannot write the converted copy of {src.name} to {entry}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_manifest(src: Path, out: Path, digest: str) -> None:
    files = {}
    for f in sorted(out.iterdir()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        files[f.name] = {"size": f.stat().st_size, "xxh3_128": _xxh3(f)}
    manifest = {"converter": CONVERTER_VERSION, "source": src.name, "source_sha256": digest,
                "source_size": src.stat().st_size, "files": files}
    with open(out / MANIFEST, "w") as fh:  # last: an entry with a manifest is complete
        fh.write(json.dumps(manifest, indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(out)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _xxh3(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
