"""/v1/models: the base model (parent null; one entry per --served-model-name, as in vLLM)
and each loaded LoRA adapter (parent: the base
model's served name, or the base_model_name --lora-modules gave it; root: its folder). The
operator reads this list to see which adapters a replica has loaded."""

from __future__ import annotations

from fastapi import APIRouter, Request

from quire.entrypoints.errors import model_not_found
from quire.entrypoints.routers.common import serving_of

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": _cards(request)}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    """One entry of the list (the openai client's models.retrieve); vLLM's 404 otherwise."""
    card = next((c for c in _cards(request) if c["id"] == model_id), None)
    if card is None:
        raise model_not_found(model_id)
    return card


def _cards(request: Request) -> list[dict]:
    serving = serving_of(request)
    info = serving.check_model(None)
    created = request.app.state.started
    data = [{"id": name, "object": "model", "created": created, "owned_by": "quire",
             "root": info.name, "parent": None, "max_model_len": info.max_model_len}
            for name in (info.served_name, *serving.model_aliases)]
    for lora in serving.engine.lora_adapters.values():
        data.append({"id": lora.name, "object": "model", "created": created,
                     "owned_by": "quire", "root": lora.path,
                     "parent": serving.lora_parents.get(lora.name, info.served_name)})
    return data
