"""Multi-LoRA serving: PEFT adapters in device slots, mixed in one batch.

    peft_format.py  reading and checking an adapter folder
    layers.py       a linear layer's slot stack (`linear.lora`) and packing into it
    batch.py        a step's rows grouped by slot
    ops.py          the batched delta (torch); triton_ops.py: its CUDA kernels
    manager.py      host LRU, device slots, the step's mapping
    registry.py     names -> adapters; admission.py: the scheduler's max_loras rule
    adapters.py     what the engine holds and calls
    stats.py        what the metrics show (adapters loaded, running, waiting)

Over HTTP (quire/entrypoints): a request's `model` names its adapter; routers/lora.py loads
and unloads them at runtime through AsyncLLMEngine.add_lora / remove_lora.
"""

from quire.lora.request import LoRARequest

__all__ = ["LoRARequest"]
