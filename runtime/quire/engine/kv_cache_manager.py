"""Per-request block tables on top of the block pool: prefix hits, slot allocation, fork and
copy-on-write. Bookkeeping only; block copies are returned for the worker to carry out."""

from __future__ import annotations

from quire.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from quire.engine.request import Request


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.enable_caching = block_pool.enable_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}   # leading blocks already registered in the cache
        self.prefix_queries = 0                 # prompt tokens looked up in the cache
        self.prefix_hits = 0                    # ... and found there
        self._cached_this_step: list[KVBlock] = []

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.request_id, ())]

    # --- prefix cache --------------------------------------------------------------------
    def _extend_hashes(self, request: Request, num_full_blocks: int) -> None:
        hashes, bs, tokens = request.block_hashes, self.block_size, request.token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.cache_salt
            hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs:(i + 1) * bs])))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The cached blocks that cover the longest prefix of the request's tokens. The last
        token is always left to compute: its logits are needed to sample."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission, not per attempt, so the hit rate means something."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # --- allocation ----------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: list[KVBlock] = ()) -> bool:
        return self._num_required(request, num_new_tokens, computed) is not None

    def _num_required(self, request, num_new_tokens, computed):
        blocks = self.req_blocks.get(request.request_id, [])
        start = request.num_computed_tokens + len(computed) * self.block_size
        total_blocks = len(blocks) + len(computed)
        new = max(0, self.blocks_needed(start + num_new_tokens) - total_blocks)
        cow = self._needs_copy(blocks, start, num_new_tokens)
        revived = sum(1 for b in computed if b.ref_cnt == 0)  # leave the free queue on touch
        need = new + int(cow)
        if need > self.pool.num_free_blocks - revived:
            return None
        return new, cow

    def _needs_copy(self, blocks: list[KVBlock], start: int, num_new_tokens: int) -> bool:
        """Writing into a partly filled block that others share: copy it first."""
        return (num_new_tokens > 0 and bool(blocks) and start % self.block_size != 0
                and start // self.block_size == len(blocks) - 1 and blocks[-1].ref_cnt > 1)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[KVBlock] = ()) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after the
        prefix-cache hits `computed`, for a request being admitted). Returns the block copies
        (src, dst) that copy-on-write requires, or None if the pool can't cover it."""
        required = self._num_required(request, num_new_tokens, computed)
        if required is None:
            return None
        num_new_blocks, cow = required
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if computed:
            self.pool.touch(list(computed))
            blocks.extend(computed)
        copies = []
        if cow:
            old = blocks[-1]
            (new,) = self.pool.allocate(1)
            copies.append((old.block_id, new.block_id))
            self.pool.free([old])
            blocks[-1] = new
        blocks.extend(self.pool.allocate(num_new_blocks))
        if self.enable_caching:
            start = request.num_computed_tokens + len(computed) * self.block_size
            self._cache_full_blocks(request, blocks, start + num_new_tokens)
        return copies

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Registered now, filled during this step: the forward writes a layer's K/V for the
        # whole batch before any sequence reads it, so same-step hits are safe.
        num_full = min(num_tokens // self.block_size, len(blocks))
        done = self._num_hashed.get(request.request_id, 0)
        if num_full <= done:
            return
        self._extend_hashes(request, num_full)
        for i in range(done, num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], request.block_hashes[i])
                self._cached_this_step.append(blocks[i])
        self._num_hashed[request.request_id] = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; writes later copy what they touch."""
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def adopt_blocks(self, request: Request, blocks: list[KVBlock]) -> None:
        """Freshly allocated blocks that now hold the request's KV (a swap-in). They are
        registered in the prefix cache again at the next allocation."""
        self.req_blocks[request.request_id] = blocks
        self._num_hashed[request.request_id] = 0

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])

    # --- step boundaries -----------------------------------------------------------------
    def step_done(self) -> None:
        self._cached_this_step.clear()

    def step_failed(self) -> None:
        """The forward did not run: blocks registered this step hold nothing."""
        self.pool.uncache(self._cached_this_step)
        self._cached_this_step.clear()

    # --- accounting ----------------------------------------------------------------------
    def num_slack_tokens(self, requests: list[Request]) -> int:
        """Allocated slots not (yet) filled, over the given requests."""
        return sum(len(self.req_blocks.get(r.request_id, ())) * self.block_size
                   - r.num_computed_tokens for r in requests
                   if r.request_id in self.req_blocks)
