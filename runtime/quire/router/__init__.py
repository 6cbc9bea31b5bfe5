"""`quire router`: the cluster request router in front of a model's replicas.

An async HTTP proxy that speaks the runtime's API (OpenAI's /v1/completions,
/v1/chat/completions, /v1/models, and /generate), streams answers through as they come, and
aborts the replica's request when the client goes away. Its parts, one job each:

    backends.py        the replicas known now, their scraped load and the router's in-flight count
    discovery_k8s.py   replicas from the EndpointSlices of a headless Service (watched)
    backend_tls.py     how https:// replicas' certificates are checked
    load_scraper.py    each replica's /metrics, periodically
    prompt_hashing.py  prompt -> tokens -> chained KV-block hashes (the engine's own hash)
    prefix_index.py    which replica was sent which block hashes (bounded LRU)
    policies.py        round-robin, least-load, prefix-aware
    holding.py         requests held while no replica is ready (scale from zero)
    flow_control.py    requests held while every replica is saturated: by priority, tenants
                       in turn; sheddable ones 429, a wait bound's 503
    objectives.py      a request's priority (InferenceObjective header, body) and tenant
    migration.py       a broken stream goes on on another replica (continue_token_ids)
    proxy.py           one request: pick, retry before the first byte, stream, disconnects
    endpoint_picking.py  one pick without proxying (for ext_proc): strict body reading, subset
    ext_proc*.py       --ext-proc-port: Envoy ext_proc as a GIE endpoint picker (server,
                       one request's conversation, the messages)
    app.py             the ASGI app: routes, /metrics, /health, the admin API
    metrics.py         the router's own Prometheus metrics
    cli.py             flags and `main`; `python -m quire.router` and `quire router`
"""
