"""/v1/models: the base model (parent null; one entry per --served-model-name, as in vLLM)
and each loaded LoRA adapter (parent: the base
model's served name, or the base_model_name --lora-modules gave it; root: its folder). The
operator reads this list to see which adapters a replica has loaded."""

from __future__ import annotations

from fastapi import APIRouter, Request

from quire.entrypoints.routers.common import serving_of

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
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
    return {"object": "list", "data": data}
