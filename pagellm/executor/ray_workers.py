"""--distributed-executor-backend ray: the same workers and protocol as "mp", placed by Ray (for users who
already run a Ray cluster; `pip install pagellm[ray]`). Ray only starts the processes: they still join the
engine's TCPStore and gloo groups, so --master-addr must be an address of this node that every Ray node
reaches (127.0.0.1 for a one-machine cluster)."""

from __future__ import annotations

import os

from pagellm.executor.multiproc import MultiprocExecutor
from pagellm.executor.worker import worker_main


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'pagellm[ray]'") from None
    if not ray.is_initialized():  # RAY_ADDRESS or a running cluster, else a local one
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
    return ray


class RayWorker:
    """A worker running as a Ray task, with the process-handle interface MultiprocExecutor polls."""

    def __init__(self, ray, rank: int, master_addr: str, master_port: int, local_ranks: int, cpus: int):
        self.ray, self.name = ray, f"pagellm worker rank {rank} (ray)"
        task = ray.remote(num_cpus=cpus, max_retries=0)(worker_main)
        self.ref = task.remote(rank, master_addr, master_port, local_ranks)

    @property
    def exitcode(self) -> int | None:
        done, _ = self.ray.wait([self.ref], timeout=0)
        if not done:
            return None
        try:
            self.ray.get(self.ref)
            return 0
        except Exception:  # the task raised or its process died (os._exit)
            return 1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.ray.cancel(self.ref, force=True)

    def join(self, timeout: float | None = None) -> None:
        self.ray.wait([self.ref], timeout=timeout)


class RayExecutor(MultiprocExecutor):
    name = "ray"
    local_channels = False  # Ray may place workers on other hosts

    def _launch(self, ranks: list[int], master_addr: str, master_port: int) -> list[RayWorker]:
        ray = _ray()
        cpus = self.spec.threads_per_rank or 1
        return [RayWorker(ray, r, master_addr, master_port, len(ranks), cpus) for r in ranks]
