"""Multimodal inputs: images checked, hashed and run through the model's own processor
before the engine sees a prompt. What the engine keeps of them is plain data (inputs.py); the
pixels go to the executor, which owns the encoder and its cache."""
