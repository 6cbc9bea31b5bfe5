"""Preemption by swap: which host blocks hold a swapped-out sequence's KV. Bookkeeping only;
the (device, host) block pairs go to the worker in the SchedulerOutput. The device side goes
through the KV-cache manager's public methods; the host pool is this class's own."""

from __future__ import annotations

from quire.engine.block_pool import BlockPool, KVBlock
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request


class SwapManager:
    def __init__(self, kv_manager: KVCacheManager, num_host_blocks: int) -> None:
        self.kv_manager = kv_manager
        self.host = BlockPool(num_host_blocks, enable_caching=False)
        self.host_tables: dict[str, list[KVBlock]] = {}  # sequence id -> its host blocks

    def try_swap_out(self, seq: Request, out) -> bool:
        """Copy the sequence's blocks to the host and free them on the device. False (and
        nothing done) when the host pool can't hold them: the caller recomputes instead."""
        device_ids = self.kv_manager.block_ids(seq)
        if not device_ids or len(device_ids) > self.host.num_free_blocks:
            return False
        host_blocks = self.host.allocate(len(device_ids))
        out.swap_out.extend((d, h.block_id) for d, h in zip(device_ids, host_blocks))
        self.host_tables[seq.request_id] = host_blocks
        self.kv_manager.free(seq)  # the copy runs before this step's forward reuses the blocks
        return True

    def try_swap_in(self, seq: Request, num_new_tokens: int, out) -> bool:
        """Bring a swapped sequence back, with room for this step's tokens."""
        host_blocks = self.host_tables[seq.request_id]
        total = self.kv_manager.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        if max(total, len(host_blocks)) > self.kv_manager.num_free_blocks:
            return False
        device_ids = self.kv_manager.adopt_fresh_blocks(seq, len(host_blocks))
        out.swap_in.extend((h.block_id, d) for h, d in zip(host_blocks, device_ids))
        self.free(seq)
        return True

    def free(self, seq: Request) -> None:
        blocks = self.host_tables.pop(seq.request_id, None)
        if blocks:
            self.host.free(blocks)
