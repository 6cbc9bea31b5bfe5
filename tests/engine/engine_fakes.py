"""Model-free doubles for the engine's bookkeeping: fake sequences, a fake model that samples
deterministically from a sequence's history, and an engine loop that drives the real block
pool, KV-cache manager, scheduler, swap manager and beam groups exactly as LLMEngine.step
does, minus the tensors. Plus the invariant audit that names what it finds broken."""

from __future__ import annotations

from collections import Counter

from quire.engine.beam_search import (
    BeamSearchGroup,
    BeamSearchParams,
    num_blocks_for_beam_search,
)
from quire.engine.block_pool import BlockPool
from quire.engine.features.beam_search import BeamSearch
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus
from quire.engine.scheduler import Scheduler
from quire.engine.swap_manager import SwapManager
from quire.outputs import TokenLogprobs
from quire.sampling_params import SamplingParams

VOCAB = 1000


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 8, first_token: int = 10,
             client_request_id: str | None = None, logprobs: int | None = None,
             lockstep_group: str | None = None) -> Request:
    """A sequence with prompt tokens first_token, first_token + 1, ... (never EOS: none)."""
    prompt = [(first_token + i) % VOCAB for i in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)
    return Request(request_id, prompt, params, frozenset(), max_tokens,
                   client_request_id=client_request_id, lockstep_group=lockstep_group)


def fake_token(seq: Request) -> int:
    """What the fake model samples next: a function of the sequence's whole history."""
    return hash((seq.request_id.split("#")[0], tuple(seq.token_ids))) % VOCAB


def fake_logprobs(seq: Request, k: int) -> TokenLogprobs:
    """k distinct candidates with strictly decreasing logprobs, a function of the history."""
    h = hash(tuple(seq.token_ids))
    ids = [(h + 7 * i) % VOCAB for i in range(k)]
    lps = [-0.5 * (i + 1) - (h >> (4 * i)) % 7 / 100 for i in range(k)]
    return TokenLogprobs(lps[0], 1, ids, lps)


class FakeEngine:
    """LLMEngine.step without a model: schedule, 'run', update, advance beam groups."""

    def __init__(self, num_blocks: int, block_size: int = 4, caching: bool = True,
                 swap_blocks: int = 0, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 64) -> None:
        self.kv_manager = KVCacheManager(BlockPool(num_blocks, caching), block_size)
        self.swapper = SwapManager(self.kv_manager, swap_blocks) if swap_blocks else None
        self.beams = BeamSearch()
        self.scheduler = Scheduler(self.kv_manager, max_num_seqs, max_num_batched_tokens,
                                   self.swapper, features=[self.beams])
        self.clients: dict[str, list[Request]] = {}  # client id -> its sequences
        self.beam_groups = self.beams.groups  # search id -> its BeamSearchGroup
        self.finished: dict[str, object] = {}  # client id -> token lists, or a BeamSearchGroup
        self.failed: dict[str, str] = {}  # client id -> error
        self.outputs: dict[str, list[int]] = {}
        self.steps = 0

    # --- requests ------------------------------------------------------------------------
    def add(self, rid: str, prompt_len: int, max_tokens: int, n: int = 1,
            first_token: int = 10) -> list[Request]:
        assert prompt_len + max_tokens <= self.kv_manager.capacity_tokens, "engine rejects it"
        seqs = [make_seq(rid if n == 1 else f"{rid}#{i}", prompt_len, max_tokens, first_token,
                         client_request_id=rid) for i in range(n)]
        self.clients[rid] = seqs
        self.scheduler.add_request(seqs[0], seqs[1:])
        return seqs

    def add_beam(self, rid: str, prompt_len: int, max_tokens: int, width: int,
                 first_token: int = 10) -> BeamSearchGroup:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
        need = num_blocks_for_beam_search(prompt_len, params, self.kv_manager.block_size)
        assert need <= self.kv_manager.num_blocks, "engine rejects it"
        root = make_seq(f"{rid}#beam0", prompt_len, max_tokens, first_token,
                        client_request_id=rid, logprobs=2 * width, lockstep_group=rid)
        group = BeamSearchGroup(rid, None, root, params, frozenset())
        self.beams.add(group)
        self.scheduler.add_request(root)
        return group

    def abort(self, rid: str) -> None:
        self.beams.end(rid, self.scheduler)
        for seq in self.clients.pop(rid, ()):
            self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)

    # --- the step ------------------------------------------------------------------------
    def step(self):
        self.steps += 1
        out = self.scheduler.schedule()
        for client_id, why in out.failed:
            self.failed[client_id] = why
            self.beams.end(client_id, self.scheduler, error=why)
        self.beams.pop_finished()  # failed ones: no output
        if out.empty:
            self._collect()
            return out
        sampled, logprobs = {}, {}
        for rid, n in zip(out.seq_ids, out.num_new_tokens):
            seq = self.scheduler.sequence(rid)
            if seq.num_computed_tokens + n == seq.num_tokens:
                for row_id in (rid, *out.forks.get(rid, ())):
                    row = self.scheduler.sequence(row_id)
                    sampled[row_id] = fake_token(row)
                    if row.lockstep_group is not None:
                        width = self.beam_groups[row.lockstep_group].params.beam_width
                        logprobs[row_id] = fake_logprobs(row, 2 * width)
        self.scheduler.update(out, sampled, logprobs)
        for group in self.beams.pop_finished():
            self.finished[group.request_id] = group
        self._collect()
        return out

    def _collect(self) -> None:
        for rid, seqs in list(self.clients.items()):
            if all(s.finished for s in seqs):
                del self.clients[rid]
                if any(s.status == RequestStatus.FINISHED_ERROR for s in seqs):
                    continue
                self.finished[rid] = [s.output_token_ids for s in seqs]

    def run(self, max_steps: int = 2000, audit: bool = True) -> None:
        """Step until done; fail (never hang) if it takes more than max_steps."""
        while self.scheduler.has_unfinished():
            assert self.steps < max_steps, (
                f"no end after {max_steps} steps: the scheduler is spinning "
                f"(running {self.scheduler.running}, waiting {list(self.scheduler.waiting)})")
            self.step()
            if audit:
                assert_blocks_owned_as_counted(self)


def live_seqs(engine: FakeEngine) -> list[Request]:
    s = engine.scheduler
    return [*s.running, *s.waiting, *s.swapped]


def assert_blocks_owned_as_counted(engine: FakeEngine) -> None:
    """After any step: every device block is held by exactly as many block tables as its
    reference count says; only running sequences hold device blocks; the free queue holds
    exactly the blocks nobody holds; swapped sequences hold host blocks and nothing else."""
    kv, sched = engine.kv_manager, engine.scheduler
    pool = kv.pool
    broken = []
    owners = Counter()
    running_ids = {s.request_id for s in sched.running}
    for seq_id, blocks in kv._tables.items():  # the audit may read what callers may not
        if seq_id not in running_ids:
            broken.append(f"leak: sequence {seq_id} is not running but holds device blocks "
                          f"{[b.block_id for b in blocks]}")
        owners.update(b.block_id for b in blocks)
    for b in pool.blocks:
        if b.ref_cnt != owners[b.block_id]:
            broken.append(f"ref count: block {b.block_id} has ref_cnt {b.ref_cnt} but "
                          f"{owners[b.block_id]} block tables hold it")
    nobody = sum(1 for b in pool.blocks if b.ref_cnt == 0)
    if pool.num_free_blocks != nobody:
        broken.append(f"free queue: {pool.num_free_blocks} blocks free but {nobody} have "
                      f"ref_cnt 0")
    cached_free = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    if pool.num_cached_free != cached_free:
        broken.append(f"cache count: num_cached_free {pool.num_cached_free}, actual {cached_free}")
    if engine.swapper is not None:
        swapped_ids = {s.request_id for s in sched.swapped}
        held = set(engine.swapper.host_tables)
        if held != swapped_ids:
            broken.append(f"host leak: host blocks held by {sorted(held)}, swapped are "
                          f"{sorted(swapped_ids)}")
        host_owned = sum(len(v) for v in engine.swapper.host_tables.values())
        if engine.swapper.host.num_used_blocks != host_owned:
            broken.append(f"host ref count: {engine.swapper.host.num_used_blocks} host blocks "
                          f"used, {host_owned} held")
    assert not broken, "block ownership invariant broken:\n  " + "\n  ".join(broken)


def assert_nothing_held(engine: FakeEngine) -> None:
    """Everything finished: no device block in use (only cached-free ones), no host block."""
    kv = engine.kv_manager
    assert kv.num_used_blocks == 0, f"leak: {kv.num_used_blocks} KV blocks still in use"
    if engine.swapper is not None:
        used = engine.swapper.host.num_used_blocks
        assert used == 0, f"leak: {used} host blocks still in use"
