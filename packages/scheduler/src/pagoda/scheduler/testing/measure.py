"""How much of the KV memory a scheduler holds carries real tokens: the simulator's and the policy bench's gauge."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.scheduler.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class KVOccupancy:
    """Token slots of the running sequences at one moment."""

    real_tokens: int  # slots holding a running sequence's KV; a shared full block counts once
    reserved_tokens: int  # slots of every block the allocator counts as used (a contiguous region: all of it)
    table_entries: int  # block-table entries over the running sequences
    num_running: int

    @property
    def utilization(self) -> float:
        """Real over reserved slots (0 when nothing is reserved)."""
        return self.real_tokens / self.reserved_tokens if self.reserved_tokens else 0.0


def kv_occupancy(scheduler: Scheduler) -> KVOccupancy:
    """Real and reserved KV token slots of `scheduler`'s running sequences now."""
    kv, bs = scheduler.kv, scheduler.kv.block_size
    full: set[int] = set()  # full blocks can be shared (prefix cache, forks): count each once
    partial = entries = 0
    for request in scheduler.running:
        table = kv.block_table(request.request_id)
        n = kv.num_tokens(request.request_id)
        full.update(table[: n // bs])
        partial += n % bs
        entries += len(table)
    reserved = kv.stats().num_used_blocks * bs
    return KVOccupancy(len(full) * bs + partial, reserved, entries, len(scheduler.running))
