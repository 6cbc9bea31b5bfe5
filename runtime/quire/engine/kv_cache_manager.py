"""The KV-cache manager: the block table of every sequence, on top of the block pool.

Bookkeeping only; block copies and swaps are returned for the worker to carry out. Its methods
are the only way to allocate, share, fork, free and query KV blocks: nothing else changes the
block pool or reads the tables (tests/engine/test_boundaries.py checks it).

Public interface (`seq` is a Request: one sequence):
    queries    capacity_tokens, num_blocks, num_free_blocks, num_used_blocks,
               num_cached_free_blocks, usage(), blocks_needed(num_tokens), block_ids(seq),
               num_slack_tokens(seqs), prefix_queries, prefix_hits
    admission  get_computed_blocks(seq) -> (blocks, num_tokens)   prefix hits, kept for
               allocate_slots; record_prefix_lookup(num_tokens, num_hit_tokens)
    growth     allocate_slots(seq, n, computed=(), num_lookahead=0) -> copies | None
                                                       room for n more tokens (and proposals)
               trim(seq)                               give back the slots of rejected
                                                       proposals (speculative decoding)
               num_blocks_to_grow(seqs, ns) -> int     what a beam group's step needs, exactly
               max_fitting_tokens(seq, n) -> int       the largest chunk that fits now
    sharing    fork(parent, child)                     the child shares every parent block
    release    free(seq)                               tail first: the head is evicted last
    swap       adopt_fresh_blocks(seq, n) -> ids | None   new blocks for a swap-in
    steps      step_done(), step_failed()              a failed step un-caches its blocks
               step_dropped()                          so do sequences dropped from a step
    tiers      take_tier_moves() -> (loads, stores)    the step's KV-tier byte moves, for
                                                       the worker (step_batch.py)

Sharing: full blocks are registered under a chained hash of their tokens when allocated
(block_hash.py: SHA-256, each block hashed once, when it fills). The chain is seeded with the
sequence's extra keys: its LoRA adapter, its client's cache_salt, the LongRoPE long table, so
blocks under different keys never match. With prefix caching on, any sequence with the same
keys can hit them, and they stay cached after they are freed. With it off, the client request
id is a key too, so only the sequences of one client request (a beam group or n > 1 samples
coming back from preemption) share blocks, and nothing outlives its owners.

KV tiers (quire/kv_tiers, optional): a prefix-cache miss in the pool goes on in the tier chain;
each block found there becomes a fresh pool block, registered under its hash at once, whose
payload the worker writes before the forward. Every block that fills is copied out to the
tiers after the forward that fills it. Both lists are plain data, taken once per step.
With KV events on, the pool's stored and removed blocks are reported (medium "GPU").
"""

from __future__ import annotations

from collections import Counter

from quire.engine.block_hash import NO_EXTRA_KEYS, ExtraKeys, extend_block_hashes
from quire.engine.block_pool import BlockPool, KVBlock
from quire.engine.prompt_logprobs import wants_prompt_logprobs
from quire.engine.request import Request
from quire.kv_events.structs import POOL_MEDIUM
from quire.step_batch import TierStore


class TierHit:
    """A prefix block that a KV tier holds: in get_computed_blocks' result, after the pool's
    own hits; allocate_slots gives it a pool block and queues its payload for loading."""
    __slots__ = ("block_hash", "payload", "ref_cnt")

    def __init__(self, block_hash: bytes, payload: bytes) -> None:
        self.block_hash, self.payload = block_hash, payload
        self.ref_cnt = 1  # not a free pool block: allocate_slots' "revived" count skips it


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, tiers=None,
                 events=None) -> None:
        self.pool = block_pool  # read it for accounting; change it only through this class
        self.tiers = tiers    # a kv_tiers.TierChain, or None
        self.events = events  # a kv_events KVEventRecorder, or None
        if events is not None:
            block_pool.on_removed = lambda hashes: events.removed(hashes, POOL_MEDIUM)
        self._tier_loads: list[tuple[KVBlock, bytes, bytes]] = []  # block, hash, payload
        self._tier_stores: list[tuple[KVBlock, TierStore]] = []
        self.block_size = block_size
        self.enable_caching = block_pool.enable_caching
        self._tables: dict[str, list[KVBlock]] = {}  # sequence id -> its blocks, in order
        self._num_hashed: dict[str, int] = {}  # leading blocks already registered in the cache
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # ... and found there
        self._cached_this_step: list[KVBlock] = []

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq: Request) -> list[int]:
        return [b.block_id for b in self._tables.get(seq.request_id, ())]

    def num_slack_tokens(self, seqs: list[Request]) -> int:
        """Allocated slots not (yet) filled, over the given sequences."""
        return sum(len(self._tables[s.request_id]) * self.block_size - s.num_computed_tokens
                   for s in seqs if s.request_id in self._tables)

    # --- admission: prefix hits ------------------------------------------------------------
    def get_computed_blocks(self, seq: Request) -> tuple[list[KVBlock], int]:
        """The registered blocks that cover the longest prefix of the sequence's tokens. The
        last token is always left to compute: its logits are needed to sample. A sequence
        that asks for prompt logprobs gets no hits: every prompt position's logits are needed
        (its blocks are still cached for others)."""
        if wants_prompt_logprobs(seq):
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hits: list[KVBlock | TierHit] = []
        for h in seq.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        if self.tiers is not None and len(hits) < max_blocks:
            rest = seq.block_hashes[len(hits):max_blocks]
            payloads = self.tiers.lookup(rest, shared_ok=seq.lora is None)
            hits.extend(TierHit(h, p) for h, p in zip(rest, payloads))
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission, not per attempt, so the hit rate means something."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def _extend_hashes(self, seq: Request, num_full_blocks: int) -> None:
        if len(seq.block_hashes) < num_full_blocks:  # only the first block needs the keys
            keys = self.extra_keys(seq) if not seq.block_hashes else NO_EXTRA_KEYS
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size,
                                num_full_blocks, keys, seq.images)

    def extra_keys(self, seq: Request) -> ExtraKeys:
        """What seeds the sequence's hash chain besides its tokens."""
        return ExtraKeys(
            adapter=None if seq.lora is None else seq.lora.key, cache_salt=seq.cache_salt,
            long_rope=seq.long_rope,
            client_request=None if self.enable_caching else seq.client_request_id)

    # --- growth ----------------------------------------------------------------------------
    def allocate_slots(self, seq: Request, num_new_tokens: int,
                       computed: list[KVBlock] = (), num_lookahead: int = 0
                       ) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after the
        prefix hits `computed`, for a sequence being admitted), plus `num_lookahead` slots
        for proposals being verified (never registered in the prefix cache: their tokens are
        not the sequence's until accepted). Returns the block copies (src, dst) that
        copy-on-write requires, or None (and nothing done) if the pool can't cover it."""
        blocks = self._tables.get(seq.request_id, [])
        start = seq.num_computed_tokens + len(computed) * self.block_size
        num_new = max(0, self.blocks_needed(start + num_new_tokens + num_lookahead)
                      - len(blocks) - len(computed))
        cow = self._needs_copy(blocks, start, num_new_tokens + num_lookahead)
        revived = sum(1 for b in computed if b.ref_cnt == 0)  # they leave the free queue
        from_tiers = [c for c in computed if isinstance(c, TierHit)]
        if num_new + int(cow) + len(from_tiers) > self.pool.num_free_blocks - revived:
            return None
        blocks = self._tables.setdefault(seq.request_id, [])
        if computed:
            in_pool = [c for c in computed if not isinstance(c, TierHit)]
            self.pool.touch(in_pool)  # before allocating: they must not be evicted for it
            blocks.extend(in_pool)
            if from_tiers:
                first = len(blocks)
                blocks.extend(self._load_from_tiers(from_tiers))
                if self.events is not None:
                    self.events.stored(self._entries(seq, blocks, range(first, len(blocks))),
                                       POOL_MEDIUM)
        copies = []
        if cow:
            old = blocks[-1]
            (new,) = self.pool.allocate(1)
            copies.append((old.block_id, new.block_id))
            self.pool.free([old])
            blocks[-1] = new
        blocks.extend(self.pool.allocate(num_new))
        self._register_full_blocks(seq, blocks, start + num_new_tokens)
        return copies

    def _load_from_tiers(self, hits: list[TierHit]) -> list[KVBlock]:
        """Fresh blocks for the tier hits, registered now (the worker writes them before the
        forward, so hits later in this step are safe, as for blocks computed this step)."""
        fresh = self.pool.allocate(len(hits))
        for block, hit in zip(fresh, hits):
            self.pool.cache_block(block, hit.block_hash)
            self._cached_this_step.append(block)
            self._tier_loads.append((block, hit.block_hash, hit.payload))
        return fresh

    def num_blocks_to_grow(self, seqs: list[Request], ns: list[int]) -> int:
        """Free blocks that allocate_slots(seq, n) needs, for all the sequences together: the
        beams of one group share their last block, and the last of them to write it needs no
        copy (the others have copied away)."""
        need, writers = 0, Counter()
        for seq, n in zip(seqs, ns):
            blocks = self._tables.get(seq.request_id, [])
            need += max(0, self.blocks_needed(seq.num_computed_tokens + n) - len(blocks))
            if self._needs_copy(blocks, seq.num_computed_tokens, n):
                writers[blocks[-1]] += 1
        return need + sum(k - (block.ref_cnt == k) for block, k in writers.items())

    def max_fitting_tokens(self, seq: Request, num_new_tokens: int) -> int:
        """The largest chunk of `num_new_tokens` that fits in the free blocks now."""
        room_in_last = (len(self._tables.get(seq.request_id, ())) * self.block_size
                        - seq.num_computed_tokens)
        return max(0, min(num_new_tokens, self.num_free_blocks * self.block_size + room_in_last))

    def _needs_copy(self, blocks: list[KVBlock], start: int, num_new_tokens: int) -> bool:
        """Writing into a partly filled block that others share: copy it first."""
        return (num_new_tokens > 0 and bool(blocks) and start % self.block_size != 0
                and start // self.block_size == len(blocks) - 1 and blocks[-1].ref_cnt > 1)

    def _register_full_blocks(self, seq: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Registered now, filled during this step: the forward writes a layer's K/V for the
        # whole batch before any sequence reads it, so same-step hits are safe.
        num_full = min(num_tokens // self.block_size, len(blocks))
        done = self._num_hashed.get(seq.request_id, 0)
        if num_full <= done:
            return
        self._extend_hashes(seq, num_full)
        fresh = []
        for i in range(done, num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], seq.block_hashes[i])
                self._cached_this_step.append(blocks[i])
                if blocks[i].block_hash is not None:
                    fresh.append(i)
        self._num_hashed[seq.request_id] = num_full
        if fresh and (self.tiers is not None or self.events is not None):
            self._report_filled(seq, blocks, fresh)

    def _report_filled(self, seq: Request, blocks: list[KVBlock], indices: list[int]) -> None:
        """Blocks that fill this step: queued for the tiers, reported as pool events."""
        entries = self._entries(seq, blocks, indices)
        if self.tiers is not None:
            self._tier_stores.extend(zip((blocks[i] for i in indices), entries))
        if self.events is not None:
            self.events.stored(entries, POOL_MEDIUM)

    def _entries(self, seq: Request, blocks: list[KVBlock], indices) -> list[TierStore]:
        bs, lora = self.block_size, seq.lora
        return [TierStore(
            block_id=blocks[i].block_id, block_hash=seq.block_hashes[i],
            parent_hash=seq.block_hashes[i - 1] if i else None,
            token_ids=list(seq.token_ids[i * bs:(i + 1) * bs]),
            lora_id=None if lora is None else lora.key, shared=lora is None)
            for i in indices]

    def trim(self, seq: Request) -> None:
        """After verification: blocks past the computed tokens held only rejected proposals'
        slots; give them back (the next step allocates what it needs)."""
        blocks = self._tables.get(seq.request_id)
        keep = self.blocks_needed(seq.num_computed_tokens)
        if blocks and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free(extra[::-1])

    # --- sharing and release ---------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; writes later copy what they touch."""
        blocks = self._tables[parent.request_id]
        self.pool.touch(blocks)
        self._tables[child.request_id] = list(blocks)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Request) -> None:
        blocks = self._tables.pop(seq.request_id, None)
        self._num_hashed.pop(seq.request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])

    def adopt_fresh_blocks(self, seq: Request, num_blocks: int) -> list[int] | None:
        """A swap-in: `num_blocks` new blocks become the sequence's table (their ids returned
        for the copy from the host), or None if they are not free. They are registered in the
        prefix cache again at the next allocation."""
        if num_blocks > self.num_free_blocks:
            return None
        assert seq.request_id not in self._tables, f"{seq} swapped in while holding blocks"
        self._tables[seq.request_id] = blocks = self.pool.allocate(num_blocks)
        self._num_hashed[seq.request_id] = 0
        return [b.block_id for b in blocks]

    # --- step boundaries -------------------------------------------------------------------
    def step_done(self) -> None:
        self._cached_this_step.clear()

    def step_failed(self) -> None:
        """The forward did not run: blocks registered this step hold nothing."""
        self.pool.uncache(self._cached_this_step)
        self._cached_this_step.clear()
        self._tier_loads.clear()
        self._tier_stores.clear()

    def take_tier_moves(self) -> tuple[list[tuple[int, bytes]], list[TierStore]]:
        """This step's tier loads (block id, payload) and stores, for the StepBatch; only
        blocks still held and still registered under that hash (a sequence dropped from the
        step, or a failed one, took its blocks' hashes with it). Flushes the KV events."""
        loads = [(b.block_id, p) for b, h, p in self._tier_loads
                 if b.ref_cnt > 0 and b.block_hash == h]
        stores = [e for b, e in self._tier_stores
                  if b.ref_cnt > 0 and b.block_hash == e.block_hash]
        self._tier_loads.clear()
        self._tier_stores.clear()
        if self.events is not None:
            self.events.flush()
        return loads, stores

    def step_dropped(self) -> None:
        """Some sequences left the step before its forward and were freed: blocks they
        registered this step that no one holds now will never be written; forget them."""
        unwritten = [b for b in self._cached_this_step if b.ref_cnt == 0]
        self.pool.uncache(unwritten)
        self._cached_this_step = [b for b in self._cached_this_step if b.ref_cnt > 0]
