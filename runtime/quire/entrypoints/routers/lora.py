"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA endpoints,
with its bodies and answers (the operator calls them on every replica, after reading
/v1/models). Registered only with --allow-runtime-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING
=true): without it they answer 404, as vLLM's unregistered routes do. Behind the API key like
the rest of the API.

    load   {"lora_name", "lora_path"}  200 "Success: LoRA adapter 'x' added successfully."
           400: name loaded already, or the base model's; bad folder, rank, targets, format
    unload {"lora_name", "lora_int_id"?}  200 "Success: LoRA adapter 'x' removed
           successfully."; 404: not loaded. lora_int_id is accepted and ignored, as in vLLM.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from quire.engine.async_engine import AdapterExists, AdapterNotFound
from quire.entrypoints.errors import OpenAIError, bad_request, engine_error
from quire.entrypoints.openai_protocol import _Request
from quire.entrypoints.routers.common import read_body, serving_of

router = APIRouter()


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(description="a non-empty string")
    lora_path: str = Field(description="a PEFT adapter folder on the server")


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(description="the name of a loaded adapter")
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    serving = serving_of(request)
    req = await read_body(request, LoadLoRAAdapterRequest)
    info = serving.check_model(None)
    name, path = req.lora_name.strip(), req.lora_path.strip()
    if not name:
        raise bad_request("lora_name must be a non-empty string", "lora_name")
    if not path:
        raise bad_request("lora_path must be a non-empty path to a PEFT adapter folder",
                          "lora_path")
    if name == info.served_name:
        raise bad_request(f"lora_name '{name}' is the base model's name; pick another",
                          "lora_name")
    try:
        await serving.engine.add_lora(name, path)
    except AdapterExists as e:
        raise OpenAIError(400, str(e), "InvalidUserInput", "lora_name", 400) from None
    except ValueError as e:  # the folder, its format, rank or targets: what is wrong
        raise OpenAIError(400, f"could not load LoRA adapter '{name}' from {path!r}: {e}",
                          "BadRequestError", "lora_path", 400) from None
    except Exception as e:  # noqa: BLE001 - engine not ready / dead: 503
        raise engine_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    serving = serving_of(request)
    req = await read_body(request, UnloadLoRAAdapterRequest)
    serving.check_model(None)
    name = req.lora_name
    try:
        await serving.engine.remove_lora(name)
    except AdapterNotFound:
        raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                          "lora_name", 404) from None
    except Exception as e:  # noqa: BLE001
        raise engine_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
