"""Physical KV blocks: reference counts, a free queue in LRU order, and hash -> cached block.

Plain bookkeeping: no tensors here. A block with ref_cnt 0 is free; if it still carries a
hash it is also *cached*, reusable by a later request with the same prefix until it is
evicted (least recently freed first). Only the KVCacheManager (and the swap manager's own
host pool) calls the methods that change ownership.

Public interface:
    allocate(n) -> blocks       n blocks with ref_cnt 1 (evicts cached-free ones, LRU first)
    touch(blocks)               one more reference each (a prefix hit or a fork)
    free(blocks)                one reference less each; at 0 the block joins the free queue
    cache_block(block, hash)    register a full block under its chained hash (block_hash.py)
    get_cached_block(hash)      the block holding that content, or None
    uncache(blocks)             forget hashes whose contents can't be trusted
    reset_prefix_cache()
    on_removed                  None, or called with the hashes the pool forgets (KV events)
    num_blocks, num_free_blocks, num_used_blocks, num_cached_free, num_evictions, usage()

With enable_caching off, full blocks are still registered while someone holds them (so the
sequences of one client request can share them: see KVCacheManager), but a freed block
forgets its hash at once: nothing outlives its owners.
"""

from __future__ import annotations

from collections import OrderedDict

from quire.collector import collector_paused


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash
        short = h.hex()[:12] if isinstance(h, bytes) else h  # a digest's head is enough to tell
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={short})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # (the collector paused meanwhile: every few hundred new blocks started a collection
        # that walked the process's heap, torch's included: 1.3-2.0 s for a 4 GiB cache's
        # 350K blocks, 0.2 s without; each server and engine start paid it)
        with collector_paused():
            self.blocks = [KVBlock(i) for i in range(num_blocks)]
            # Front = next to hand out. Uncached blocks go to the front, cached ones to the
            # back, so a cached prefix survives as long as there is anything else to give.
            self._free: OrderedDict[int, KVBlock] = OrderedDict(
                (b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self.num_cached_free = 0  # free blocks that still hold a reusable prefix
        self.num_evictions = 0
        self.on_removed = None  # callable(list[bytes]): the KV-events recorder, when on

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-free ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    # --- ownership -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; pass a request's blocks tail first, so that its
        head (the part most likely shared by later prompts) is evicted last."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than it was taken")
            self._free[block.block_id] = block
            if block.block_hash is not None and not self.enable_caching:
                del self._cached[block.block_hash]  # caching off: nothing outlives its owners
                self._removed([block.block_hash])
                block.block_hash = None
            if block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)
            else:
                self.num_cached_free += 1

    # --- prefix cache --------------------------------------------------------------------
    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        if block.block_hash is not None:
            return
        if block_hash in self._cached:  # same content already cached under another block
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache(self, blocks: list[KVBlock]) -> None:
        """Forget the hashes of blocks whose contents can't be trusted (a failed step)."""
        gone = []
        for block in blocks:
            if block.block_hash is not None and self._cached.get(block.block_hash) is block:
                if block.ref_cnt == 0:
                    self.num_cached_free -= 1
                    self._free.move_to_end(block.block_id, last=False)
                del self._cached[block.block_hash]
                gone.append(block.block_hash)
                block.block_hash = None
        self._removed(gone)

    def reset_prefix_cache(self) -> None:
        self.uncache([b for b in self.blocks if b.block_hash is not None])

    def _evict(self, block: KVBlock) -> None:
        del self._cached[block.block_hash]
        self._removed([block.block_hash])
        block.block_hash = None
        self.num_cached_free -= 1
        self.num_evictions += 1

    def _removed(self, hashes: list[bytes]) -> None:
        if self.on_removed is not None and hashes:
            self.on_removed(hashes)
