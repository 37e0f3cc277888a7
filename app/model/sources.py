"""Where a model's files come from, made a local directory: a local or mounted path (a PVC), a hub
id at a pinned revision, or object storage (`s3://bucket/prefix`, `gs://bucket/prefix`).

Each node fetches a model once: into `download_dir` (shared by every replica of the node), under a
file lock, the listing it fetched recorded beside the files; a replica that finds the same listing
there loads at once, one that finds none waits on the lock while another fetches. Files are written
under a temporary name and renamed, so a fetch cut short leaves no half-written file that a later
one would take for whole. Weights can be left out (`weights=False`): the ingress and the app's
builder need only a model's config and tokenizer.

Object storage goes through the providers' own SDKs (boto3 for S3 and S3-compatible servers, which
honours AWS_ENDPOINT_URL and the usual credentials; google-cloud-storage for GCS), installed with
the `s3` and `gcs` extras; a hub id through huggingface_hub, whose cache has its own locks.
"""

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

log = logging.getLogger("specserve.sources")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
MARKER = ".specserve-source.json"  # the listing a directory was fetched from (with or without weights)
PROGRESS_EVERY_S = 5.0  # a fetch logs its progress at least this often


def default_download_dir() -> str:
    """$SPECSERVE_MODEL_CACHE, else ~/.cache/specserve/models."""
    return os.environ.get("SPECSERVE_MODEL_CACHE") or str(Path("~/.cache/specserve/models").expanduser())


def is_remote(source: str) -> bool:
    return source.startswith(("s3://", "gs://"))


def is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


@dataclass(frozen=True)
class Entry:
    """One object under a model's prefix: its name relative to the prefix, size and version tag."""

    name: str
    size: int
    tag: str


class S3Store:
    """A bucket prefix on S3 or an S3-compatible server (boto3's client; AWS_ENDPOINT_URL for the latter)."""

    def __init__(self, bucket: str, prefix: str, client=None):
        if client is None:
            try:
                import boto3
            except ImportError:
                raise RuntimeError("s3:// models need boto3: pip install 'specserve[s3]'") from None
            client = boto3.client("s3")
        self.bucket, self.prefix, self.client = bucket, prefix.strip("/"), client

    def list(self) -> list[Entry]:
        out, start = [], f"{self.prefix}/" if self.prefix else ""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            for obj in page.get("Contents", []):
                if not obj["Key"].endswith("/"):
                    out.append(Entry(obj["Key"][len(start):], obj["Size"], obj.get("ETag", "").strip('"')))
        return out

    def fetch(self, name: str, path: Path, progress: Callable[[int], None]) -> None:
        key = f"{self.prefix}/{name}" if self.prefix else name
        self.client.download_file(self.bucket, key, str(path), Callback=progress)


class GCSStore:
    """A bucket prefix on Google Cloud Storage (google-cloud-storage's client)."""

    def __init__(self, bucket: str, prefix: str, client=None):
        if client is None:
            try:
                from google.cloud import storage
            except ImportError:
                raise RuntimeError("gs:// models need google-cloud-storage: pip install 'specserve[gcs]'") from None
            client = storage.Client()
        self.bucket, self.prefix, self.client = bucket, prefix.strip("/"), client

    def list(self) -> list[Entry]:
        start = f"{self.prefix}/" if self.prefix else ""
        return [Entry(b.name[len(start):], b.size, str(b.generation)) for b in
                self.client.list_blobs(self.bucket, prefix=start) if not b.name.endswith("/")]

    def fetch(self, name: str, path: Path, progress: Callable[[int], None]) -> None:
        key = f"{self.prefix}/{name}" if self.prefix else name
        blob = self.client.bucket(self.bucket).blob(key)
        blob.download_to_filename(str(path))
        progress(path.stat().st_size)


def store_of(source: str):
    """The store of an s3:// or gs:// source."""
    scheme, _, rest = source.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{source!r} names no bucket")
    return S3Store(bucket, prefix) if scheme == "s3" else GCSStore(bucket, prefix)


def log_into(logger: logging.Logger) -> None:
    """Write this module's progress lines where `logger` writes (a Serve replica's log)."""
    for handler in logger.handlers:
        if handler not in log.handlers:
            log.addHandler(handler)
    log.setLevel(logging.INFO)


def local_model(source: str, revision: str | None = None, download_dir: str | None = None,
                weights: bool = True, store=None) -> str:
    """A local directory holding `source`'s files (with its weights, or only the rest when `weights`
    is False): the source itself when it is a directory, else where this node keeps its fetch.
    `store`: the object store to read (tests inject one; default: the source's scheme's)."""
    if not is_remote(source):
        path = Path(source).expanduser()
        if path.is_dir():
            return str(path)
        if source.startswith(("/", ".", "~")):
            raise FileNotFoundError(f"model directory {source!r} does not exist (on this node)")
        return _hub(source, revision, download_dir, weights)
    if revision is not None:
        raise ValueError(f"revision applies to hub ids, not to {source.split('://')[0]}:// sources")
    scheme, _, rest = source.partition("://")
    dest = Path(download_dir or default_download_dir()) / scheme / rest.strip("/")
    return str(fetch(store or store_of(source), dest, source, weights))


def fetch(store, dest: Path, label: str, weights: bool = True) -> Path:
    """`store`'s objects in `dest`, fetched unless `dest` already holds this listing; once per node:
    replicas that start together wait on the lock while the first fetches."""
    dest.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        listing = [e for e in store.list() if weights or not is_weights(e.name)]
        if not listing:
            raise FileNotFoundError(f"{label}: no objects under it")
        want = {e.name: [e.size, e.tag] for e in listing}
        have = _recorded(dest)
        if all(have.get(name) == v and (dest / name).is_file() for name, v in want.items()):
            return dest
        todo = [e for e in listing if have.get(e.name) != want[e.name] or not (dest / e.name).is_file()]
        _fetch_all(store, dest, label, todo)
        (dest / MARKER).write_text(json.dumps({**have, **want}, sort_keys=True))
    return dest


def _recorded(dest: Path) -> dict:
    try:
        return json.loads((dest / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _fetch_all(store, dest: Path, label: str, todo: list[Entry]) -> None:
    total, done = sum(e.size for e in todo), 0
    began = last = time.monotonic()
    log.info("fetching %s: %d files, %.1f MB, into %s", label, len(todo), total / 1e6, dest)

    def progress(n: int) -> None:
        nonlocal done, last
        done += n
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            log.info("fetching %s: %.1f of %.1f MB (%.0f%%)", label, done / 1e6, total / 1e6,
                     100 * done / total if total else 100)

    for entry in todo:
        path = dest / entry.name
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        store.fetch(entry.name, part, progress)
        part.replace(path)
    log.info("fetched %s: %d files, %.1f MB in %.1f s", label, len(todo), total / 1e6, time.monotonic() - began)


def _hub(repo: str, revision: str | None, download_dir: str | None, weights: bool) -> str:
    """A hub id's snapshot (its files at `revision`), through huggingface_hub's cache, which locks
    per file: a node's replicas share one download when they share the cache directory."""
    from huggingface_hub import snapshot_download

    ignore = [f"*{s}" for s in WEIGHT_SUFFIXES] if not weights else None
    return snapshot_download(repo, revision=revision, cache_dir=download_dir, ignore_patterns=ignore)
