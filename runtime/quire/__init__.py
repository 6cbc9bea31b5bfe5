"""Quire: a paged-KV LLM inference runtime."""

# Before torch is imported: importing it needs a writable temporary folder, and without one it
# fails with an error that says nothing of what to mount (quire/writable_dirs.py).
from quire.writable_dirs import ensure_temp_dir

ensure_temp_dir()

from quire.config import EngineArgs
from quire.engine.beam_search import BeamSearchParams
from quire.entrypoints.llm import LLM
from quire.lora.request import LoRARequest
from quire.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from quire.pooling.params import PoolingParams
from quire.sampling_params import RequestOutputKind, SamplingParams
from quire.validation import QuireValidationError
from quire.version import __version__

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutputKind", "EngineArgs", "RequestOutput",
           "CompletionOutput", "Logprob", "LoRARequest", "QuireValidationError", "PoolingParams",
           "EmbeddingRequestOutput", "__version__"]
