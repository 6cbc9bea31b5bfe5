"""The pooling runner: embeddings from the same engine (prefill only, no KV kept after).

    config.py   which runner a model gets, and how it pools (sentence-transformers' files)
    params.py   PoolingParams: a request's dimensions and normalization
    batch.py    a scheduler output -> a StepBatch whose finished prompts are pooled
    engine.py   PoolingEngine: add_request / step / abort for embedding requests
"""
