"""Shared set-up of the Serve tests: tiny models on disk, a local cluster, the app deployed on it."""

import contextlib
import random
import socket

from conftest import blend, make_byte_tokenizer, make_model, make_tokenizer


def free_port() -> int:
    """A loopback port free now, chosen outside both the kernel's ephemeral range and Ray's worker
    ports (10002-19999): a port the kernel hands out (bind to port 0) can be handed out again to one of
    Ray's processes while a cluster starts, before Serve's proxy binds it; CI once saw the proxy fail to
    bind such a port (test_observability). Falls back to the kernel's choice where no such gap exists."""
    low = 20000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0]) - 1
    except (OSError, ValueError, IndexError):
        high = low - 1
    rng = random.Random()  # not the tests' seeded global generator: two modules must not pick alike
    for _ in range(64 if high > low else 0):
        port = rng.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_pair(root, byte_level: bool = False, chat_template: str | None = None,
                   special_tokens: list[str] | None = None) -> tuple[str, str]:
    """A tiny target and a draft that partly agrees with it, saved with their tokenizer: the character
    tokenizer, or (byte_level) a byte-level BPE that llguidance reads, for structured output; with
    `chat_template`, the tokenizer's; with `special_tokens`, those added to it as special."""
    tok = make_byte_tokenizer() if byte_level else make_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    if special_tokens:
        tok.add_special_tokens({"additional_special_tokens": special_tokens})
    target = make_model(seed=1, max_positions=2048 if byte_level else 512, vocab_rows=len(tok))
    paths = []
    for name, model in (("target", target), ("draft", blend(target, 7, 0.85))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


def quick_shutdown(config: dict) -> dict:
    """Each replica of `config` checks every 0.1 s (not Serve's 2 s) whether what it holds is done when
    it is told to stop: the same draining, found sooner (a teardown measured 7 s -> 3 s on 2 cores)."""
    for d in config["applications"][0]["deployments"]:
        d.setdefault("graceful_shutdown_wait_loop_s", 0.1)
    return config


# The modules that deploy the app share one cluster (and Serve's controller and proxy) instead of
# starting their own: a cluster took about 20 s to start and stop on 2 cores, once per module before.
# conftest runs those modules one after another and stops the cluster after the last of them.
_shared: dict = {}


def shared_cluster() -> int:
    """Start the session's cluster unless it runs; returns the HTTP port its Serve proxy listens on."""
    if not _shared:
        from cluster.local import LocalCluster

        _shared["cluster"] = LocalCluster().start()
        _shared["port"] = free_port()
    return _shared["port"]


def stop_shared_cluster() -> None:
    if _shared:
        _shared.pop("cluster").shutdown()
        _shared.clear()


def remove_app(name: str) -> None:
    """Delete application `name` and what outlives its replicas (its metric totals' detached actor),
    so that the next module's app starts from nothing."""
    import ray
    from ray import serve

    from deployments.vllm_metrics import TOTALS_NAMESPACE, totals_actor_name

    serve.delete(name)
    with contextlib.suppress(ValueError):  # no replica asked for the totals
        ray.kill(ray.get_actor(totals_actor_name(name), namespace=TOTALS_NAMESPACE))


@contextlib.contextmanager
def running_app(target: str, draft: str | None, args: dict | None = None, deployments: dict | None = None,
                env: dict | None = None, system_config: dict | None = None, compiled: bool = True):
    """Yield the base URL of the app deployed on the session's cluster; delete the app after.

    `env`: environment variables of every replica (the application's runtime_env), e.g. OTEL_*.
    `system_config`: Ray's, on a cluster of the app's own, stopped after.
    `compiled=False`: eager forwards, for tests of what lies around the engine (the protocol, security,
    metrics, scaling): each replica then starts about 8 s sooner on 2 cores (no step compiled at warm-up).
    """
    from cluster.local import LocalCluster, deploy, load_config

    def config(port: int) -> dict:
        # compiled: one decoder layer a graph (the test pairs have 1 and 2 layers), the compile these
        # replicas spend on 2 cores kept as it was; tests/test_compiled.py proves longer graphs' tokens
        eager = {"compile_layers": 1} if compiled else {"compile": "off"}
        base = {"target": {"model": target, "dtype": "float32", **eager},
                "draft": {"model": draft, **eager} if draft else None,
                "speculation": {"draft_timeout_s": 30.0}}
        out = quick_shutdown(load_config(args={**base, **(args or {})}, deployments=deployments, port=port))
        if env:
            out["applications"][0]["runtime_env"] = {"env_vars": env}
        return out

    if system_config:
        stop_shared_cluster()  # one cluster per driver process
        with LocalCluster(system_config=system_config):
            port = free_port()  # after the cluster's processes took theirs
            deploy(config(port), timeout_s=300)
            yield f"http://127.0.0.1:{port}"
        return
    port = shared_cluster()
    app = config(port)
    try:
        deploy(app, timeout_s=300)
        yield f"http://127.0.0.1:{port}"
    finally:
        remove_app(app["applications"][0]["name"])


class S3Server:
    """An S3-compatible server on loopback (moto's server mode: no S3-compatible server installs from
    the registries here), with a bucket, the credentials and endpoint its clients read from the
    environment (`env`), and a record of the requests it served (`gets()`: GetObject keys)."""

    def __init__(self, bucket: str = "models"):
        import os
        import tempfile

        import httpx
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.record = os.path.join(tempfile.mkdtemp(), "moto-recording")
        os.environ["MOTO_RECORDER_FILEPATH"] = self.record  # read by the server's recorder, in this process
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.url = f"http://127.0.0.1:{self.port}"
        # moto's buckets live in this process, not in the server: start from none (another module's
        # server left its objects behind)
        httpx.post(f"{self.url}/moto-api/reset", timeout=30).raise_for_status()
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_DEFAULT_REGION": "us-east-1"}
        self.bucket = bucket
        self.client().create_bucket(Bucket=bucket)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test", aws_secret_access_key="test",
                            region_name="us-east-1")

    def upload(self, directory: str, prefix: str) -> str:
        """Every file of `directory` under `prefix`; returns the s3:// source."""
        from pathlib import Path

        root = Path(directory)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            self.client().upload_file(str(path), self.bucket, f"{prefix}/{path.relative_to(root)}")
        return f"s3://{self.bucket}/{prefix}"

    def start_recording(self) -> None:
        import httpx

        httpx.post(f"{self.url}/moto-api/recorder/reset-recording", timeout=30)
        httpx.post(f"{self.url}/moto-api/recorder/start-recording", timeout=30)

    def gets(self) -> list[str]:
        """The object keys of the GET requests served since start_recording (each a file fetched)."""
        import json
        from urllib.parse import urlsplit

        import httpx

        text = httpx.get(f"{self.url}/moto-api/recorder/download-recording", timeout=30).text
        out = []
        for line in text.splitlines():
            entry = json.loads(line)
            path = urlsplit(entry["url"]).path
            if entry["method"] == "GET" and "list-type" not in entry["url"] and not path.startswith("/moto-api"):
                out.append(path.removeprefix(f"/{self.bucket}/"))
        return out

    def stop(self) -> None:
        self.server.stop()
