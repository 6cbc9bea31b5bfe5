"""A stand-in replica for the router tests: the runtime's stream formats, no model.

    python fake_backend.py --host 127.0.0.11 --port 9000 --name a

Streams `--chunks` SSE chunks (or NUL-separated /generate chunks) `--interval` seconds apart,
each naming this replica, so a test can tell who answered. /metrics exports the runtime's gauge
names: `quire:num_requests_running` is the number of streams open now (a client that goes away
closes its stream, so the figure drops), the queue and KV usage are whatever POST /control set.
A request whose prompt contains "__die__" kills the process after the second chunk (unless it
is a router's continuation of one, with continue_token_ids). GET /seen
lists the prompts received. `--ssl-certfile` and `--ssl-keyfile` make it an HTTPS replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

ARGS = argparse.Namespace()
STATE = {"running": 0, "waiting": 0.0, "kv": 0.0, "seen": [], "status": 200, "models": ["fake"]}


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        return json.dumps(body["messages"])
    return json.dumps(body.get("prompt"))


async def _stream(body: dict, sse: bool):
    STATE["running"] += 1
    try:
        # (a migrated request, continue_token_ids set, is served whole wherever it goes)
        die = "__die__" in _prompt_text(body) and body.get("continue_token_ids") is None
        for i in range(int(body.get("max_tokens") or ARGS.chunks)):
            if die and i == 2:
                os._exit(1)
            text = f"{ARGS.name}-{i} "
            if sse:
                choice = {"index": 0, "text": text}
                if body.get("return_token_ids"):  # the runtime's contract, as a router asks
                    choice["token_ids"] = [1000 + i]
                yield f"data: {json.dumps({'choices': [choice], 'backend': ARGS.name})}\n\n"
            else:
                yield json.dumps({"text": [text], "backend": ARGS.name}) + "\0"
            await asyncio.sleep(ARGS.interval)
        if sse:
            yield "data: [DONE]\n\n"
    finally:
        STATE["running"] -= 1


def build() -> FastAPI:
    app = FastAPI()

    async def answer(request: Request, sse: bool):
        body = await request.json()
        STATE["seen"].append(_prompt_text(body))
        if STATE["status"] != 200:
            return JSONResponse({"error": {"message": "busy", "code": "queue_full"}},
                                STATE["status"], headers={"Retry-After": "1"})
        if body.get("stream", not sse):
            return StreamingResponse(_stream(body, sse),
                                     media_type="text/event-stream" if sse else None)
        chunks = [c async for c in _stream(body, False)]
        return {"backend": ARGS.name, "text": "".join(chunks)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, True)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, True)

    @app.post("/generate")
    async def generate(request: Request):
        return await answer(request, False)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():  # the base model, then the LoRA adapters POST /control says are loaded
        return {"object": "list", "data": [{"id": m, "backend": ARGS.name, "parent": None if i == 0 else "fake"}
                                           for i, m in enumerate(STATE["models"])]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE quire:num_requests_running gauge\n"
            f'quire:num_requests_running{{model_name="fake"}} {STATE["running"]}\n'
            "# TYPE quire:num_requests_waiting gauge\n"
            f'quire:num_requests_waiting{{model_name="fake"}} {STATE["waiting"]}\n'
            "# TYPE quire:kv_cache_usage_perc gauge\n"
            f'quire:kv_cache_usage_perc{{model_name="fake"}} {STATE["kv"]}\n')

    @app.post("/control")
    async def control(request: Request):
        STATE.update(await request.json())
        return {"ok": True}

    @app.get("/seen")
    async def seen():
        return {"seen": STATE["seen"], "running": STATE["running"]}

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--ssl-certfile", default=None)  # HTTPS, as `quire serve` takes it
    parser.add_argument("--ssl-keyfile", default=None)
    parser.parse_args(namespace=ARGS)
    uvicorn.run(build(), host=ARGS.host, port=ARGS.port, log_level="warning",
                ssl_certfile=ARGS.ssl_certfile, ssl_keyfile=ARGS.ssl_keyfile)
