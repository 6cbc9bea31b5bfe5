"""The executor: everything of a step that touches tensors (model, KV tensors, sampler, draft
model, tensor-parallel workers), behind `execute(SchedulerOutput) -> StepResult`."""

from quire.executor.executor import Executor
from quire.worker.model_runner import StepResult

__all__ = ["Executor", "StepResult"]
