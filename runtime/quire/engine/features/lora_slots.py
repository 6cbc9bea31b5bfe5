"""LoRA as a scheduler feature: the running sequences use at most max_loras distinct
adapters (lora/admission.py), and before each forward the step's adapters are put in device
slots; an adapter that can't be brought in fails its requests alone, not the step."""

from __future__ import annotations

from quire.engine.features.base import Feature


class LoRASlots(Feature):
    def __init__(self, adapters) -> None:
        self.adapters = adapters  # quire.lora.adapters.EngineAdapters
        self.admission = adapters.admission

    def added(self, seq) -> None:
        self.admission.hold(seq)  # its adapter stays until it ends

    def finished(self, seqs) -> None:
        self.admission.release(seqs)

    def start_admission(self, running) -> None:
        self.admission.start_step(running)

    def may_admit(self, seq) -> bool:
        return self.admission.try_admit(seq)

    def after_schedule(self, plan, running) -> dict[str, str]:
        plan.lora_keys_in_use = self.admission.in_use(running)  # pinned while they run
        failed = self.adapters.fill_slots(plan.requests, plan.lora_keys_in_use)
        return {s.request_id: failed[s.lora.key] for s in plan.requests
                if s.lora is not None and s.lora.key in failed}
