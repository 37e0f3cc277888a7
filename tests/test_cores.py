"""Replicas pinned to cores of their own (deployments/cores.py): claims, their order, the binding."""

import json
import os
import subprocess
import sys
import textwrap

from deployments.cores import claim_cores, preferred_order

# two packages of two cores, each core with two SMT siblings: cpu -> (package, core)
TOPOLOGY = {0: (0, 0), 4: (0, 0), 1: (0, 1), 5: (0, 1), 2: (1, 0), 6: (1, 0), 3: (1, 1), 7: (1, 1)}


def test_one_sibling_of_every_core_comes_before_any_second_sibling():
    assert preferred_order(set(TOPOLOGY), TOPOLOGY.__getitem__) == [0, 1, 2, 3, 4, 5, 6, 7]
    numbered_by_core = {0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1)}  # siblings adjacent, as on many hosts
    assert preferred_order({0, 1, 2, 3}, numbered_by_core.__getitem__) == [0, 2, 1, 3]
    assert preferred_order({5, 2}, TOPOLOGY.__getitem__) == [2, 5]  # a container's CPU set: only what it allows


def test_replicas_of_a_node_claim_distinct_cores_and_one_that_finds_too_few_claims_none(tmp_path):
    topology = {0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1)}.__getitem__
    first = claim_cores(1, {0, 1, 2, 3}, tmp_path, topology)
    second = claim_cores(2, {0, 1, 2, 3}, tmp_path, topology)
    assert first.cores == [0] and second.cores == [2, 1]
    assert claim_cores(2, {0, 1, 2, 3}, tmp_path, topology) is None  # one core left: nothing held
    third = claim_cores(1, {0, 1, 2, 3}, tmp_path, topology)
    assert third.cores == [3]
    assert claim_cores(1, {0, 1, 2, 3}, tmp_path, topology) is None


def test_a_replica_that_ends_frees_its_cores_for_the_next(tmp_path):
    held = claim_cores(1, {0, 1}, tmp_path)
    other = claim_cores(1, {0, 1}, tmp_path)
    assert {held.cores[0], other.cores[0]} == {0, 1}
    held.release()  # what the OS does when the process ends
    assert claim_cores(1, {0, 1}, tmp_path).cores == held.cores


def test_claims_hold_across_processes(tmp_path):
    """Replicas are processes: a core one process holds is not another's, until the holder exits."""
    allowed = sorted(os.sched_getaffinity(0))[:2]
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from deployments.cores import claim_cores
            claim = claim_cores(1, {{{allowed[0]}}}, Path({str(tmp_path)!r}))
            print(claim.cores, flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == f"[{allowed[0]}]"
        assert claim_cores(1, {allowed[0]}, tmp_path) is None
    finally:
        holder.communicate("", timeout=30)
    assert claim_cores(1, {allowed[0]}, tmp_path).cores == [allowed[0]]


def test_every_thread_of_a_pinned_process_and_every_later_one_runs_on_its_cores(tmp_path):
    """Run in a process of its own: the test process keeps its cores."""
    script = textwrap.dedent("""
        import json, os, threading
        from deployments.cores import pin_replica
        stop = threading.Event()
        before = [threading.Thread(target=stop.wait, daemon=True) for _ in range(3)]  # a failure never hangs
        for t in before:
            t.start()
        claim = pin_replica(1, "test")
        later = []
        t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))
        t.start()
        t.join()
        masks = []
        for tid in os.listdir("/proc/self/task"):
            try:
                masks.append(sorted(os.sched_getaffinity(int(tid))))
            except ProcessLookupError:  # a thread that ended after the listing (the joined one may linger there)
                pass
        stop.set()
        print(json.dumps({"cores": claim.cores, "masks": masks, "later": later}))
    """)
    env = {**os.environ, "SPECSERVE_CORE_LOCKS": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert len(got["cores"]) == 1 and got["cores"][0] in os.sched_getaffinity(0)
    assert len(got["masks"]) >= 4  # the main thread and the three started before pinning
    assert all(mask == got["cores"] for mask in got["masks"]), got
    assert got["later"] == [got["cores"]]


def test_a_replica_that_cannot_claim_runs_unpinned_rather_than_not_at_all(tmp_path, monkeypatch):
    from deployments.cores import pin_replica

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("SPECSERVE_CORE_LOCKS", str(blocked / "locks"))  # mkdir under a file fails
    before = os.sched_getaffinity(0)
    assert pin_replica(1, "test") is None
    assert os.sched_getaffinity(0) == before
