"""The chaos soak (cluster/soak.py), short: two replicas of every deployment, a replica of every
layer killed under mixed load. Nothing differs, nothing is cut, every request completes (an
ingress kill included: the proxy's failover continues its streams elsewhere)."""

import contextlib

import pytest

from cluster import soak
from serving import remove_app, save_tiny_pair, shared_cluster

pytestmark = pytest.mark.slow


def test_a_short_soak_with_a_kill_per_layer_loses_nothing(tmp_path, monkeypatch):
    target, draft = save_tiny_pair(tmp_path)
    # eager forwards: four model replicas compiling their steps at once on 2 cores cost the suite about
    # half a minute; the compiled served path is covered by test_serve, test_reliability and the CLI's test
    shipped = soak.soak_config

    def eager(*args, **kwargs):
        config = shipped(*args, **kwargs)
        app = config["applications"][0]["args"]
        for role in ("target", "draft"):
            app[role]["compile"] = "off"
        return config
    monkeypatch.setattr(soak, "soak_config", eager)
    plan = soak.Soak(seconds=32, clients=3, every=(7.0, 8.0), max_tokens=16, in_turn=True)  # kills by 24 s
    try:  # on the session's cluster: the soak kills replicas, never the cluster's own actors
        report = soak.run(target, draft, plan, port=shared_cluster(), cluster=contextlib.nullcontext())
    finally:
        remove_app("specserve")
    table = report["table"]
    print(soak.markdown(table))
    killed = {layer for _, layer, name in report["kills"] if not name.startswith("not")}
    assert killed == {"draft", "target", "ingress"}, report["kills"]  # each layer once, in turn
    assert report["references"] == 2 * len(soak.mix(16)) // 3  # greedy and seeded requests of the mix
    assert soak.lost_nothing(table), table
    for layer, row in table.items():
        assert row["completed"] == row["sent"], (layer, row)
    assert sum(row["checked"] for row in table.values()) > 0
