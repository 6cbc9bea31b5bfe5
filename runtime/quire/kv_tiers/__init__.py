"""A prefix cache that outlives the KV block pool: host RAM, disk and a shared Redis/Valkey
server under the pool, behind one small interface (tier.py).

The engine side stays plain Python: the KV-cache manager asks the chain for the payloads of a
hash chain's leading blocks (chain.py `lookup`) and hands the worker (block id, payload)
pairs to load and (block id, hash) entries to copy out (step_batch.py `TierLoad`/`TierStore`);
the worker (worker/kv_cache.py) moves the bytes and gives them to the chain's `store`.
"""

from quire.kv_tiers.chain import TierChain
from quire.kv_tiers.config import KVOffloadConfig
from quire.kv_tiers.fingerprint import kv_fingerprint
from quire.kv_tiers.tier import KVTier, TierStats

__all__ = ["KVOffloadConfig", "KVTier", "TierChain", "TierStats", "kv_fingerprint"]
