"""Preemption by swap: which host blocks hold a swapped-out request's KV. Bookkeeping only;
the (device, host) block pairs go to the worker in the SchedulerOutput."""

from __future__ import annotations

from quire.engine.block_pool import BlockPool, KVBlock
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request


class SwapManager:
    def __init__(self, kv: KVCacheManager, num_host_blocks: int) -> None:
        self.kv = kv
        self.host = BlockPool(num_host_blocks, enable_caching=False)
        self.req_host_blocks: dict[str, list[KVBlock]] = {}

    def try_swap_out(self, req: Request, out) -> bool:
        """Copy the request's blocks to the host and free them on the device. False (and
        nothing done) when the host pool can't hold them: the caller recomputes instead."""
        blocks = self.kv.req_blocks.get(req.request_id, [])
        if not blocks or len(blocks) > self.host.num_free_blocks:
            return False
        host_blocks = self.host.allocate(len(blocks))
        out.swap_out.extend((d.block_id, h.block_id) for d, h in zip(blocks, host_blocks))
        self.req_host_blocks[req.request_id] = host_blocks
        self.kv.free(req)  # the copy runs before this step's forward reuses the blocks
        return True

    def try_swap_in(self, req: Request, num_new_tokens: int, out) -> bool:
        """Bring a swapped request back, with room for this step's tokens."""
        host_blocks = self.req_host_blocks[req.request_id]
        total = self.kv.blocks_needed(req.num_computed_tokens + num_new_tokens)
        if max(total, len(host_blocks)) > self.kv.pool.num_free_blocks:
            return False
        device_blocks = self.kv.pool.allocate(len(host_blocks))
        out.swap_in.extend((h.block_id, d.block_id) for h, d in zip(host_blocks, device_blocks))
        self.kv.adopt_blocks(req, device_blocks)
        self.free(req)
        return True

    def free(self, req: Request) -> None:
        blocks = self.req_host_blocks.pop(req.request_id, None)
        if blocks:
            self.host.free(blocks)
