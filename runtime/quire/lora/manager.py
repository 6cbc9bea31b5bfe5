"""LoRAManager: adapters on the host (an LRU of `max_cpu_loras`), in device slots
(`max_loras` of them), and each step's mapping from rows to slots.

Adapters are read and packed into every layer's layout once, when they enter the host cache;
moving one into a slot is then a copy per layer. A step's adapters go into slots just before
its forward: an adapter already in a slot stays put, one that is not takes a free slot or the
least recently used one whose adapter no running request holds (`in_use`). The scheduler
admits no more distinct adapters than there are slots (`admission.py`), so one always exists.

Every sequence the engine has accepted and not finished holds a reference to its adapter
(`hold` / `release`, called through the scheduler). A held adapter's host copy is never
evicted (the host cache may then hold more than `max_cpu_loras`), and an adapter removed while
held is kept, host copy and slot, until its last sequence ends: a waiting request never has to
re-read its adapter from a folder that may be gone by then. Should bringing an adapter into a
slot fail anyway, `fill` reports it per adapter, and only the requests that need it fail.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from quire.layers.linear import LinearBase
from quire.lora.batch import LoRABatch, build_lora_batch
from quire.lora.layers import LoRALinear
from quire.lora.peft_format import load_peft_adapter
from quire.lora.request import AdapterHandle, LoRARequest

logger = logging.getLogger(__name__)

Packed = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer prefix -> (lora_a, lora_b)


class _StepContext:
    """What every LoRALinear reads during a forward: the step's LoRABatch, or None."""

    batch: LoRABatch | None = None


def lora_targets(model) -> dict[str, tuple[object, list[tuple[str, object]]]]:
    """layer prefix ("layers.3.qkv_proj") -> (the linear, its parts as (transformers module,
    shard id)), from the model's own checkpoint-name maps."""
    parts: dict[str, list] = {}
    for hf_name, (fused, shard_id) in model._FUSED.items():
        parts.setdefault(fused, []).append((hf_name, shard_id))
    for hf_name, ours in model._PLAIN.items():
        parts[ours] = [(hf_name, None)]
    out = {}
    for i, layer in enumerate(model.layers):
        for ours, ps in parts.items():
            linear = getattr(layer, ours, None)  # a MoE layer: no dense MLP, a router
            if isinstance(linear, LinearBase):
                out[f"layers.{i}.{ours}"] = (linear, ps)
    return out


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, use_triton: bool) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.use_triton = use_triton
        self.context = _StepContext()
        self.linears: dict[str, LoRALinear] = {}
        for prefix, (linear, parts) in lora_targets(model).items():
            lora = LoRALinear(linear, parts, max_loras, max_lora_rank, self.context, dtype,
                              device)
            linear.lora = lora  # the layer's extension point (quire/layers/linear.py)
            self.linears[prefix] = lora
        self.host: OrderedDict[int, Packed] = OrderedDict()  # key -> packed, LRU first
        self.slots: list[int | None] = [None] * max_loras      # slot -> adapter key
        self.slot_use: OrderedDict[int, int] = OrderedDict()   # key -> slot, LRU first
        self.num_slot_loads = 0
        self.refs: Counter[int] = Counter()  # key -> unfinished sequences that compute with it
        self.retired: set[int] = set()       # removed while held: dropped at the last release

    # --- host cache ----------------------------------------------------------------------
    def load(self, handle: AdapterHandle, packed: Packed | None = None) -> Packed:
        """The adapter's packed weights, read (and checked) unless the host cache has them
        or `packed` (from read(), done off the engine thread) is given; raises ValueError
        naming what is wrong with it."""
        cached = self.host.get(handle.key)
        if cached is not None:
            self.host.move_to_end(handle.key)
            return cached
        if packed is None:
            packed = self.read(handle.request)
        self.host[handle.key] = packed
        self._trim(keep=handle.key)
        return packed

    def _trim(self, keep: int | None = None) -> None:
        """Evict least recently used host copies down to max_cpu_loras, never a held one."""
        for key in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                return
            if key != keep and not self.refs.get(key):
                del self.host[key]
                logger.debug("adapter %d left the host cache", key)

    def read(self, req: LoRARequest) -> Packed:
        """Reads, checks and packs an adapter into every layer's layout. Touches no state of
        the manager or the layers, so the server runs it on a thread of its own while the
        engine keeps stepping."""
        adapter = load_peft_adapter(req.name, req.path, self.max_lora_rank)
        packed = {}
        for prefix, lora in self.linears.items():
            p = lora.pack(req.name, adapter.modules, prefix.rsplit(".", 1)[0], self.dtype)
            if p is not None:
                packed[prefix] = p
        unused = set(adapter.modules) - {f"{prefix.rsplit('.', 1)[0]}.{name}"
                                         for prefix, lora in self.linears.items()
                                         for name, _ in lora.parts}
        if unused:
            raise ValueError(f"adapter {req.name!r} has weights for {sorted(unused)[0]}, "
                             f"which this model does not have")
        if self.device.type == "cuda":
            packed = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in packed.items()}
        logger.info("loaded LoRA adapter %r (rank %d, %d modules) from %s", req.name,
                    adapter.rank, len(adapter.modules), req.path)
        return packed

    def forget(self, key: int, in_use: frozenset[int] = frozenset()) -> None:
        """An adapter was removed. While sequences hold it, it stays (host copy and slot)
        until the last of them ends; otherwise its host copy goes, and its slot unless a
        running request still computes with it (that slot is freed by LRU later)."""
        if self.refs.get(key):
            self.retired.add(key)
            return
        self.host.pop(key, None)
        if key in self.slot_use and key not in in_use:
            self.slots[self.slot_use.pop(key)] = None

    # --- references by unfinished sequences ----------------------------------------------
    def hold(self, key: int, n: int = 1) -> None:
        self.refs[key] += n

    def release(self, key: int, n: int = 1) -> None:
        """n sequences that computed with the adapter ended; at the last one a removed
        adapter goes (host copy and slot), a registered one becomes evictable again."""
        left = self.refs[key] - n
        if left > 0:
            self.refs[key] = left
            return
        del self.refs[key]
        if key in self.retired:
            self.retired.discard(key)
            self.host.pop(key, None)
            if key in self.slot_use:
                self.slots[self.slot_use.pop(key)] = None
            logger.debug("removed adapter %d dropped: its last request ended", key)
        else:
            self._trim()

    # --- slots ---------------------------------------------------------------------------
    def slot_of(self, handle: AdapterHandle, needed: set[int], in_use: frozenset[int]) -> int:
        slot = self.slot_use.get(handle.key)
        if slot is not None:
            self.slot_use.move_to_end(handle.key)
            return slot
        packed = self.load(handle)  # first: a slot is given up only for a readable adapter
        slot = self._free_slot(needed | in_use)
        for prefix, lora in self.linears.items():
            lora.set_slot(slot, packed.get(prefix))
        self.slots[slot] = handle.key
        self.slot_use[handle.key] = slot
        self.num_slot_loads += 1
        return slot

    def _free_slot(self, pinned: set[int]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        for key, slot in self.slot_use.items():  # least recently used first
            if key not in pinned:
                del self.slot_use[key]
                self.slots[slot] = None
                return slot
        raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters of running "
                           f"requests; the scheduler must not admit more (max_loras)")

    # --- the step ------------------------------------------------------------------------
    def fill(self, adapters: Sequence[AdapterHandle | None],
             in_use: frozenset[int] = frozenset()) -> dict[int, str]:
        """Before a step's forward: puts each of its adapters in a slot. One that can't be
        brought in (its weights unreadable, say) is left out and reported, {key: why}, so
        that only the requests that need it fail; the others' slots are untouched."""
        needed = {h.key: h for h in adapters if h is not None}
        failed = {}
        for key, handle in needed.items():
            try:
                self.slot_of(handle, set(needed), in_use)
            except Exception as e:  # reported to the requests that need it, and only them
                logger.exception("LoRA adapter %r could not be put in a slot", handle.name)
                failed[key] = (f"LoRA adapter {handle.name!r} could not be loaded into a "
                               f"device slot: {e}")
        return failed

    def prepare(self, adapters: Sequence[AdapterHandle | None], num_tokens: np.ndarray,
                in_use: frozenset[int] = frozenset()) -> None:
        """adapters: each scheduled request's adapter (None: base model), in batch order;
        num_tokens: its tokens this step. Puts the adapters in slots and sets the mapping
        the layers read."""
        needed = {h.key for h in adapters if h is not None}
        if not needed:
            self.context.batch = None
            return
        slots = np.asarray([-1 if h is None else self.slot_of(h, needed, in_use)
                            for h in adapters], dtype=np.int64)
        self.context.batch = build_lora_batch(np.repeat(slots, num_tokens), self.device,
                                              self.use_triton, self.max_loras)

    @property
    def loaded_keys(self) -> list[int]:
        """Adapters in device slots, least recently used first."""
        return list(self.slot_use)
