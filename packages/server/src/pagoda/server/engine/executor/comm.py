"""The tensor-parallel group over torch.distributed: gloo on the CPU, NCCL on CUDA, with a timeout on every op."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import (
    BroadcastOptions,
    FileStore,
    GatherOptions,
    PrefixStore,
    Store,
    TCPStore,
)

# Every rank runs the same layers between two collectives, so a peer that takes this long is stuck or gone; a
# killed peer usually fails gloo's next op at once (its sockets close), the timeout covers the wedged ones.
COLLECTIVE_TIMEOUT_S = 120.0


class Work(Protocol):
    """A started c10d operation (gloo's and NCCL's `Work`)."""

    def wait(self) -> object:
        """Block until it completed (raises if it failed or timed out)."""
        ...


class _Backend(Protocol):
    """The calls used here of a c10d backend (gloo, NCCL); torch's stubs leave them out."""

    def allreduce(self, tensors: list[Tensor]) -> Work: ...
    def gather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: GatherOptions) -> Work: ...
    def broadcast(self, tensors: list[Tensor], opts: BroadcastOptions) -> Work: ...
    def send(self, tensors: list[Tensor], dst: int, tag: int) -> Work: ...
    def recv(self, tensors: list[Tensor], src: int, tag: int) -> Work: ...


class ProcessGroupCollectives:
    """`ParallelGroup` over a process group of its own (no torch.distributed global state, so that several
    engines, each with its workers, can live in one process); counts the time spent in collectives."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size
        self._pg: _Backend | None = None
        # Wall time inside collectives, waits for slower ranks included. gloo's ops return when done; NCCL's are
        # queued on the GPU stream, so on CUDA this counts the launches only (profile the stream for the rest).
        self.seconds = 0.0
        self.calls = 0

    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    def connect(
        self,
        store: Store,
        device: torch.device,
        host: str,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        prefix: str = "pagoda-tp",
    ) -> None:
        """Join the group (blocks until every rank has joined, at most `timeout_s`); gloo listens on `host` only
        (loopback for local workers, the node's IP under Ray) rather than on the hostname's address. `prefix`
        keeps the keys of several groups over one store apart (AFD's FFN ranks form a group of their own)."""
        prefixed = PrefixStore(prefix, store)
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = cast(_Backend, dist.ProcessGroupNCCL(prefixed, self._rank, self._size, options))
        else:
            gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs omit it
            gloo._timeout = timeout
            gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self._pg = cast(_Backend, dist.ProcessGroupGloo(prefixed, self._rank, self._size, gloo))

    def _group(self) -> _Backend:
        if self._pg is None:
            raise RuntimeError("the tensor-parallel group is not connected yet")
        return self._pg

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over the ranks, in place."""
        start = time.perf_counter()
        self._group().allreduce([x]).wait()
        self._count(start)
        return x

    def gather_last_dim(self, x: Tensor) -> Tensor:
        """Rank 0: the ranks' `x` side by side along the last dimension; elsewhere `x`."""
        start = time.perf_counter()
        x = x.contiguous()
        options = GatherOptions()
        options.rootRank = 0
        if self._rank == 0:
            parts = [torch.empty_like(x) for _ in range(self._size)]
            self._group().gather([parts], [x], options).wait()
            x = torch.cat(parts, dim=-1)
        else:
            self._group().gather([], [x], options).wait()
        self._count(start)
        return x

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's `x` everywhere, in place."""
        start = time.perf_counter()
        options = BroadcastOptions()
        options.rootRank = 0
        self._group().broadcast([x], options).wait()
        self._count(start)
        return x

    def send(self, x: Tensor, dst: int, tag: int) -> Work:
        """Start sending `x` to rank `dst` (point to point, matched by `tag`); keep `x` until the work is waited."""
        start = time.perf_counter()
        work = self._group().send([x], dst, tag)
        self._count(start)
        return work

    def recv(self, x: Tensor, src: int, tag: int) -> Work:
        """Start receiving into `x` from rank `src` (matched by `tag`); `x` holds the data once the work is waited."""
        start = time.perf_counter()
        work = self._group().recv([x], src, tag)
        self._count(start)
        return work

    def wait(self, work: Work) -> None:
        """Wait for a send or a receive; counted as time in collectives (a receive's wait includes the peer's
        compute)."""
        start = time.perf_counter()
        work.wait()
        self.seconds += time.perf_counter() - start

    def _count(self, start: float) -> None:
        self.seconds += time.perf_counter() - start
        self.calls += 1


def make_file_store(path: str, world_size: int) -> FileStore:
    """The local rendezvous: a file in the launcher's private (0700) folder, so no TCP port at all."""
    return FileStore(path, world_size)


def make_store(host: str, port: int, world_size: int, *, is_master: bool) -> TCPStore:
    """The rendezvous store across nodes (Ray): rank 0 hosts it (port 0 picks a free one, read back from
    `.port`). torch's TCPStore listens on every interface whatever `host` says: run Ray on a private network."""
    return TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        wait_for_workers=False,
    )
