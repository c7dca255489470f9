"""Hypothesis state machine over KV cache groups: random workloads keep every invariant, every group's window
blocks hold the right tokens (a simulated KV store follows the slots, copies and swaps the manager returns), and
after each decode step a sliding-window group holds at most ceil(W / block_size) + 1 blocks per sequence."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagoda.blockalloc import FULL_ATTENTION, BlockManager, KVCacheGroupSpec, SlotAllocation

BS = 4
GROUPS = (FULL_ATTENTION, KVCacheGroupSpec(sliding_window=6), KVCacheGroupSpec(sliding_window=9))
PREFIXES = [[1000 * p + i for i in range(5 * BS)] for p in range(2)]

# What a slot holds in the simulated cache: (group, position, token id).
Content = tuple[int, int, int]


class GroupsMachine(RuleBasedStateMachine):
    """Drives a grouped BlockManager and a dict-backed KV store with the same block moves."""

    def __init__(self) -> None:
        """A small pool so that allocations fail and sliding blocks get evicted."""
        super().__init__()
        self.kv = BlockManager(40, BS, num_host_blocks=24, groups=GROUPS)
        self.device: dict[int, Content] = {}
        self.host: dict[int, Content] = {}
        self.tokens: dict[str, list[int]] = {}  # every known token of each live sequence
        self.next_id = 0
        self.next_token = 50_000

    def _write(self, seq: str, start: int, out: SlotAllocation) -> None:
        """Perform the copies, then write the new tokens at their slots in each group."""
        self._copy(self.device, self.device, out.copies)
        group_slots = out.group_slots
        assert len(group_slots) == len(GROUPS)
        for gi, slots in enumerate(group_slots):
            for offset, slot in enumerate(slots):
                pos = start + offset
                self.device[slot] = (gi, pos, self.tokens[seq][pos])

    def _copy(self, src: dict[int, Content], dst: dict[int, Content], pairs: object) -> None:
        """Copy whole blocks, (src_block, dst_block) pairs."""
        assert isinstance(pairs, (list, tuple))
        for s, d in pairs:
            for i in range(BS):
                if s * BS + i in src:
                    dst[d * BS + i] = src[s * BS + i]
                else:
                    dst.pop(d * BS + i, None)

    def _live_seqs(self) -> list[str]:
        return [s for s in self.tokens if self.kv.has_seq(s)]

    @rule(prefix=st.integers(0, 1), suffix=st.integers(0, 14), chunk=st.integers(1, 12), cache=st.booleans())
    def new_sequence(self, prefix: int, suffix: int, chunk: int, cache: bool) -> None:
        """Admit a prompt (maybe on a prefix hit) and prefill its first chunk."""
        seq = f"s{self.next_id}"
        self.next_id += 1
        tokens = [*PREFIXES[prefix][: BS * 3 + suffix], *range(self.next_token, self.next_token + suffix)]
        self.next_token += suffix
        self.tokens[seq] = tokens
        cached = self.kv.get_num_cached_tokens(tokens, max_tokens=len(tokens) - 1) if cache else 0
        n = min(chunk, len(tokens) - cached)
        can = self.kv.can_allocate(seq, n, num_computed_tokens=cached)
        out = self.kv.allocate_slots(seq, tokens, n, num_computed_tokens=cached)
        assert not can or out is not None
        if out is None:
            del self.tokens[seq]
            return
        assert out.num_cached_tokens == cached
        self._write(seq, cached, out)
        self._check_visible(seq, cached)

    @precondition(lambda self: bool(self._live_seqs()))
    @rule(data=st.data(), n=st.integers(1, 6))
    def step(self, data: st.DataObject, n: int) -> None:
        """Advance a sequence by a chunk (prompt tokens first, then new ones); a one-token step is a decode."""
        seq = data.draw(st.sampled_from(self._live_seqs()))
        start = self.kv.num_tokens(seq)
        tokens = self.tokens[seq]
        while len(tokens) < start + n:
            tokens.append(self.next_token)
            self.next_token += 1
        free = self.kv.num_free_blocks()
        needed = self.kv.num_blocks_needed(seq, n)
        out = self.kv.allocate_slots(seq, tokens, n)
        assert (out is not None) == (needed <= free)
        if out is None:
            return
        assert self.kv.num_free_blocks() == free - needed or needed == 0
        self._write(seq, start, out)
        self._check_visible(seq, start)  # what this step's forward pass reads
        if n == 1:
            for spec, table in zip(GROUPS[1:], self.kv.block_tables(seq)[1:], strict=True):
                assert spec.sliding_window is not None
                assert sum(1 for b in table if b != 0) <= -(-spec.sliding_window // BS) + 1

    @precondition(lambda self: bool(self._live_seqs()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """Fork a sequence (parallel sampling, beams)."""
        parent = data.draw(st.sampled_from(self._live_seqs()))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent][: self.kv.num_tokens(parent)])

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """Finish a sequence in either tier."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: bool(self._live_seqs()))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        """Preempt by swapping to the host tier."""
        seq = data.draw(st.sampled_from(self._live_seqs()))
        can = self.kv.can_swap_out(seq)
        pairs = self.kv.swap_out(seq)
        assert (pairs is not None) == can
        if pairs is not None:
            self._copy(self.device, self.host, pairs)

    @precondition(lambda self: any(self.kv.is_swapped(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        """Bring a swapped sequence back."""
        seq = data.draw(st.sampled_from([s for s in self.tokens if self.kv.is_swapped(s)]))
        can = self.kv.can_swap_in(seq)
        pairs = self.kv.swap_in(seq)
        assert (pairs is not None) == can
        if pairs is not None:
            self._copy(self.host, self.device, pairs)

    @invariant()
    def consistent(self) -> None:
        """Bookkeeping invariants, per-group usage, and the KV every group's window needs is in place."""
        self.kv.check_invariants()
        stats = self.kv.stats()
        assert sum(stats.num_used_blocks_per_group) == stats.num_used_blocks
        for seq in self._live_seqs():
            # The next query sits at num_tokens.
            self._check_visible(seq, self.kv.num_tokens(seq))

    def _check_visible(self, seq: str, first_query: int) -> None:
        """Every key that queries from `first_query` on see is in place: W - 1 before it (all, W None) and on."""
        num = self.kv.num_tokens(seq)
        for gi, (spec, table) in enumerate(zip(GROUPS, self.kv.block_tables(seq), strict=True)):
            first_key = 0 if spec.sliding_window is None else max(0, first_query - spec.sliding_window + 1)
            for pos in range(first_key, num):
                slot = table[pos // BS] * BS + pos % BS
                assert self.device.get(slot) == (gi, pos, self.tokens[seq][pos]), (seq, gi, pos)


GroupsMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_groups_state_machine = GroupsMachine.TestCase
