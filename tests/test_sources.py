"""Models from where operators keep them (app/model/sources.py), against an S3-compatible server on
loopback: fetched whole, weights apart, once however many replicas of a node ask at once, again
only where the bucket changed; and the refusals of sources that cannot be."""

import threading
import time
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from app.model.sources import MARKER, Entry, GCSStore, S3Store, local_model
from serving import S3Server, save_tiny_pair


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server()
    target, _ = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    server.source = server.upload(target, "tiny/target")
    server.local = target
    yield server
    server.stop()


class Counting:
    """A store that counts its fetches, each slowed a little so that replicas starting together overlap."""

    def __init__(self, store):
        self.store, self.fetched, self.lock = store, [], threading.Lock()

    def list(self):
        return self.store.list()

    def fetch(self, name, path, progress):
        with self.lock:
            self.fetched.append(name)
        time.sleep(0.02)
        self.store.fetch(name, path, progress)


def store(s3):
    return Counting(S3Store(s3.bucket, "tiny/target", client=s3.client()))


def same_files(a: str, b: str) -> bool:
    files = lambda d: {p.relative_to(d): p.read_bytes() for p in Path(d).rglob("*")  # noqa: E731
                       if p.is_file() and p.name != MARKER}
    return files(a) == files(b)


def test_a_bucket_prefix_becomes_a_directory_transformers_loads(s3, tmp_path):
    counting = store(s3)
    path = local_model(s3.source, download_dir=str(tmp_path), store=counting)
    assert path == str(tmp_path / "s3" / "models" / "tiny" / "target") and same_files(path, s3.local)
    assert AutoConfig.from_pretrained(path).hidden_size == AutoConfig.from_pretrained(s3.local).hidden_size
    assert AutoTokenizer.from_pretrained(path)("def f").input_ids == AutoTokenizer.from_pretrained(s3.local)("def f").input_ids
    assert local_model(s3.source, download_dir=str(tmp_path), store=counting) == path
    assert len(counting.fetched) == len(set(counting.fetched))  # the second call fetched nothing


def test_the_config_and_tokenizer_come_without_the_weights(s3, tmp_path):
    counting = store(s3)
    path = local_model(s3.source, download_dir=str(tmp_path), weights=False, store=counting)
    assert counting.fetched and not any(n.endswith(".safetensors") for n in counting.fetched)
    assert not list(Path(path).glob("*.safetensors")) and AutoTokenizer.from_pretrained(path)
    first = list(counting.fetched)
    local_model(s3.source, download_dir=str(tmp_path), store=counting)
    assert sorted(counting.fetched[len(first):]) == sorted(n for n in [e.name for e in counting.list()]
                                                           if n.endswith(".safetensors"))
    assert same_files(path, s3.local)


def test_replicas_of_one_node_starting_together_fetch_once(s3, tmp_path):
    counting = store(s3)
    paths, errors = [], []

    def replica():
        try:
            paths.append(local_model(s3.source, download_dir=str(tmp_path), store=counting))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=replica) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(set(paths)) == 1 and len(paths) == 4
    assert sorted(counting.fetched) == sorted(e.name for e in counting.list())  # each file once
    assert same_files(paths[0], s3.local)


def test_a_changed_object_is_fetched_again_and_only_it(s3, tmp_path):
    counting = store(s3)
    local_model(s3.source, download_dir=str(tmp_path), store=counting)
    before = len(counting.fetched)
    s3.client().put_object(Bucket=s3.bucket, Key="tiny/target/notes.txt", Body=b"v2")
    path = local_model(s3.source, download_dir=str(tmp_path), store=counting)
    assert counting.fetched[before:] == ["notes.txt"] and (Path(path) / "notes.txt").read_bytes() == b"v2"
    s3.client().delete_object(Bucket=s3.bucket, Key="tiny/target/notes.txt")


def test_sources_that_cannot_be_are_refused_clearly(s3, tmp_path):
    with pytest.raises(FileNotFoundError, match="no objects"):
        local_model(f"s3://{s3.bucket}/nothing/here", download_dir=str(tmp_path),
                    store=S3Store(s3.bucket, "nothing/here", client=s3.client()))
    with pytest.raises(ValueError, match="revision applies to hub ids"):
        local_model(s3.source, revision="main", download_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        local_model(str(tmp_path / "missing"))
    assert local_model(s3.local) == s3.local  # a directory (a mounted PVC) is used where it is


def test_gcs_reads_through_its_sdks_calls():
    """google-cloud-storage's client as the store uses it (no GCS emulator installs here)."""
    class Blob:
        def __init__(self, name, data, generation):
            self.name, self.data, self.size, self.generation = name, data, len(data), generation

        def download_to_filename(self, path):
            Path(path).write_bytes(self.data)

    blobs = {"m/config.json": Blob("m/config.json", b"{}", 7), "m/sub/w.safetensors": Blob("m/sub/w.safetensors", b"w", 8)}

    class Client:
        def list_blobs(self, bucket, prefix):
            assert bucket == "b"
            return [b for k, b in blobs.items() if k.startswith(prefix)]

        def bucket(self, name):
            return type("Bucket", (), {"blob": lambda _, key: blobs[key]})()

    gcs = GCSStore("b", "m", client=Client())
    assert gcs.list() == [Entry("config.json", 2, "7"), Entry("sub/w.safetensors", 1, "8")]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = local_model("gs://b/m", download_dir=d, store=gcs)
        assert (Path(path) / "sub" / "w.safetensors").read_bytes() == b"w"


def test_a_fetch_says_what_it_does_in_the_replicas_log(s3, tmp_path):
    """The fetch's progress lines go where the replica's logger writes (app/model/sources.py log_into)."""
    import logging

    from app.model.sources import log_into

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    replica = logging.getLogger("test.replica")
    replica.addHandler(Keep())
    log_into(replica)
    local_model(s3.source, download_dir=str(tmp_path), store=store(s3))
    assert any(line.startswith(f"fetching {s3.source}: ") and "files" in line for line in lines), lines
    assert any(line.startswith(f"fetched {s3.source}: ") for line in lines), lines
