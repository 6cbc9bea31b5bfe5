"""Structured output: grammars that constrain what a request may generate.

params.py            GuidedDecodingParams (what the output must match), validated
backend.py           the one grammar library (llguidance) behind a small interface
compiler.py          compiles off the engine thread; bounded LRU cache by grammar key
(the engine's side, per-sequence grammar state and the batch bitmask, is the scheduler
feature quire/engine/features/structured_output.py)
bitmask.py           applying a batch's masks to logits in one op
request_formats.py   OpenAI response_format and vLLM guided_* fields -> GuidedDecodingParams
"""

from quire.structured.params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams"]
