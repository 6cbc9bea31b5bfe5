"""/v1/models: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Request

from quire.entrypoints.routers.common import serving_of

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    info = serving_of(request).check_model(None)
    return {"object": "list", "data": [{
        "id": info.served_name, "object": "model", "created": request.app.state.started,
        "owned_by": "quire", "root": info.name, "parent": None,
        "max_model_len": info.max_model_len}]}
