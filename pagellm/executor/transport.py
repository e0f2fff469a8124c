"""How step messages reach the workers and results come back: gloo (any host), or, when every worker runs
on the engine's host, two shared-memory channels (pagellm/distributed/shm_channel.py) that skip gloo's
loopback exchanges (a gloo all-reduce costs 0.78-1.30 ms on the 2-core test VM,
benchmarks/results/parallel_cpu_smollm2.json; a step makes two exchanges). A message too big for a
channel goes through gloo, announced by a marker in the channel."""

from __future__ import annotations

from pagellm.distributed import GlooGroup
from pagellm.distributed.shm_channel import ShmChannel

TO_WORKERS_BYTES = 4 << 20  # step messages: a 100k-token new prompt pickles to ~0.5 MB
FROM_RESULT_BYTES = 16 << 20  # results: 80 rows of 49,152 float32 logits
_VIA_GLOO = "via gloo"


class GlooTransport:
    def __init__(self, world: GlooGroup):
        self.world = world

    def broadcast(self, msg) -> None:  # engine
        self.world.broadcast_object(msg)

    def recv_result(self, src: int):  # engine
        return self.world.recv_object(src)

    def next_message(self):  # worker
        return self.world.broadcast_object(None)

    def send_result(self, result) -> None:  # the result rank
        self.world.send_object(result, 0)


class ShmTransport(GlooTransport):
    """paths: (engine -> workers, result rank -> engine); reader: this worker's index (rank - 1), None on
    the engine; alive: False once the other side is known dead (ends any wait). The channels are mapped at
    once; `world` (for messages too big for them) is set once the gloo group exists."""

    def __init__(self, paths: tuple[str, str], num_workers: int, reader: int | None, alive):
        super().__init__(None)
        self.to = ShmChannel(paths[0], num_workers, TO_WORKERS_BYTES, create=False)
        self.back = ShmChannel(paths[1], 1, FROM_RESULT_BYTES, create=False)
        self.reader, self.alive = reader, alive

    @staticmethod
    def create(num_workers: int) -> tuple[str, str]:
        """The engine makes both files before the workers start (they map them while loading)."""
        paths = ShmChannel.new_path(), ShmChannel.new_path()
        ShmChannel(paths[0], num_workers, TO_WORKERS_BYTES, create=True)
        ShmChannel(paths[1], 1, FROM_RESULT_BYTES, create=True)
        return paths

    def broadcast(self, msg) -> None:
        try:
            self.to.send(msg, self.alive)
        except ValueError:
            self.to.send(_VIA_GLOO, self.alive)
            self.world.broadcast_object(msg)

    def recv_result(self, src: int):
        result = self.back.recv(0, self.alive)
        return self.world.recv_object(src) if isinstance(result, str) and result == _VIA_GLOO else result

    def next_message(self):
        msg = self.to.recv(self.reader, self.alive)
        return self.world.broadcast_object(None) if isinstance(msg, str) and msg == _VIA_GLOO else msg

    def send_result(self, result) -> None:
        try:
            self.back.send(result, self.alive)
        except ValueError:
            self.back.send(_VIA_GLOO, self.alive)
            self.world.send_object(result, 0)
