"""A replica's forwards on cores of their own (`pin_cores`, CPU nodes).

Serve places a replica on a node, never on a core. Left to the OS, the target's forward thread and
the draft's share a core now and then while the other core idles, and each moves between cores
(measured on 2 cores, one float32 server, vLLM's client, unpinned and pinned passes alternated:
speculative C4 108.8 -> 116.7 tok/s, off C16 192.1 -> 222.6, C1 0-2 %; docs/performance.md). A replica that pins claims as many
cores as it runs forward threads, among the cores its process may use (a container's CPU set),
one logical CPU per physical core first, none claimed by another replica of the node; every thread
of the process is then bound to them, and the threads it starts later inherit the binding.

Written here because nothing below does it: Ray reserves CPUs as counts, and OpenMP's binding
(OMP_PROC_BIND, set before a process starts) binds only its own pool's threads, not the forward
thread or Serve's, and knows nothing of the other replicas on the node.

A claim is an exclusive `flock` on one file per core in a directory shared by the node's replicas
(`SPECSERVE_CORE_LOCKS`, default the temp directory): the OS drops it when the process ends, so a
replica that dies or scales down frees its cores for the next without any bookkeeping. A replica
that finds too few free cores runs unpinned, where it would have run without the setting.
"""

import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("ray.serve")
LOCKS_ENV = "SPECSERVE_CORE_LOCKS"


@dataclass
class Claim:
    """Cores this process holds; held while the object (its open lock files) lives."""

    cores: list[int]
    files: list = field(default_factory=list, repr=False)

    def release(self) -> None:
        for f in self.files:
            f.close()
        self.files.clear()


def lock_dir() -> Path:
    """Where the node's replicas take their cores: shared by the processes of one node (or one pod)."""
    return Path(os.environ.get(LOCKS_ENV) or Path(tempfile.gettempdir()) / "specserve-cores")


def physical_core(cpu: int) -> tuple[int, int]:
    """(package, core) of a logical CPU, from sysfs; the CPU itself where sysfs does not say."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text())
    except (OSError, ValueError):
        return 0, cpu


def preferred_order(allowed: set[int], core_of=physical_core) -> list[int]:
    """The allowed CPUs, one per physical core first (SMT siblings share a core's units), then the rest."""
    seen: dict[tuple[int, int], int] = {}
    ranked = []
    for cpu in sorted(allowed):
        core = core_of(cpu)
        ranked.append((seen.get(core, 0), cpu))  # 0 for a core's first sibling, 1 for its second, ...
        seen[core] = seen.get(core, 0) + 1
    return [cpu for _, cpu in sorted(ranked)]


def claim_cores(count: int, allowed: set[int] | None = None, where: Path | None = None,
                core_of=physical_core) -> Claim | None:
    """`count` allowed cores no other process of the node holds, or None (and nothing held)."""
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    where = where or lock_dir()
    where.mkdir(parents=True, exist_ok=True)
    claim = Claim([])
    for cpu in preferred_order(allowed, core_of):
        if len(claim.cores) == count:
            break
        f = open(where / f"cpu{cpu}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another replica's core
            f.close()
            continue
        claim.cores.append(cpu)
        claim.files.append(f)
    if len(claim.cores) < count:
        claim.release()
        return None
    return claim


def pin_threads(cores: list[int]) -> int:
    """Bind every thread of this process to `cores`; returns how many threads were bound. Passes repeat
    until one finds no new thread (a thread started meanwhile by one not yet bound would escape)."""
    bound: set[int] = set()
    for _ in range(5):
        todo = {int(t) for t in os.listdir("/proc/self/task")} - bound
        if not todo:
            break
        for tid in todo:
            try:
                os.sched_setaffinity(tid, cores)
            except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
                continue
            bound.add(tid)
    return len(bound)


def pin_replica(threads: int, name: str) -> Claim | None:
    """Claim `threads` cores for this replica and bind its threads to them; None: it runs unpinned."""
    try:
        claim = claim_cores(threads)
    except OSError as e:  # no lock directory to write in: serve unpinned rather than not at all
        log.warning("%s: cannot claim cores in %s (%s); running unpinned (set %s)", name, lock_dir(), e, LOCKS_ENV)
        return None
    if claim is None:
        log.warning("%s: fewer than %d free cores among %s; running unpinned", name, threads,
                    sorted(os.sched_getaffinity(0)))
        return None
    bound = pin_threads(claim.cores)
    log.info("%s: %d threads pinned to cores %s", name, bound, claim.cores)
    return claim
