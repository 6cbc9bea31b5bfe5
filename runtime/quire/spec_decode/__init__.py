"""Speculative decoding's proposers: n-gram lookup (ngram.py) and a draft model's bookkeeping
(draft.py, over the executor's DraftModel), with each sequence's adaptive acceptance record
(spec_state.py). The scheduler feature that drives them is engine/features/speculation.py;
the rejection sampler that verifies proposals is worker/rejection.py; the config is
quire/speculative_config.py."""
