"""KV-cache events as vLLM publishes them (--kv-events-config), so llm-d's KV-cache indexer,
Dynamo and `quire router --routing precise-prefix` can tell which replica holds which blocks.

config.py: vLLM's KVEventsConfig keys; structs.py: the wire structs; recorder.py: what the
block pool and the tiers report, batched per step; publisher.py: ZMQ PUB + replay.
"""
