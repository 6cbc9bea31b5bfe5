"""Loading a vision-language checkpoint's non-decoder parts: transformers' own modules (a
vision tower, a projector) filled under their own names.

Public interface:
    strip_prefix(name, prefixes)              the name after the first prefix it starts with
    load_module(module, tensors, what)        fill a module's parameters from {name: tensor}
                                              or say which it lacks
    split_checkpoint(weights, parts, head, text)
        -> (the decoder's weights under our names, as an iterator; {part: {name: tensor}})
        each of `parts` (name -> its prefixes) collects its tensors as the iterator runs
"""

from __future__ import annotations

import torch

from quire.layers.weights import materialize


def split_checkpoint(weights, parts: dict[str, tuple[str, ...]], head: tuple[str, ...],
                     text: tuple[str, ...]):
    found: dict[str, dict] = {part: {} for part in parts}

    def decoder():
        for name, tensor in weights:
            part = next((p for p, prefixes in parts.items() if name.startswith(prefixes)), None)
            if part is not None:
                found[part][strip_prefix(name, parts[part])] = tensor
            elif name.startswith(head):
                yield "lm_head." + strip_prefix(name, head), tensor
            elif name.startswith(text):
                yield "model." + strip_prefix(name, text), tensor

    return decoder(), found


def strip_prefix(name: str, prefixes: tuple[str, ...]) -> str:
    return name[len(next(p for p in prefixes if name.startswith(p))):]


def load_module(module: torch.nn.Module, tensors: dict, what: str) -> None:
    """A transformers module's weights, under its own names (CLIP's with or without its
    `vision_model.` level)."""
    own = module.state_dict()
    loaded = set()
    for name, tensor in tensors.items():
        key = next((k for k in (name, f"vision_model.{name}", name.removeprefix("vision_model."))
                    if k in own), None)
        if key is None:
            continue  # e.g. position_ids buffers, a head the tower does not use
        value = materialize(tensor)
        if tuple(value.shape) != tuple(own[key].shape):
            raise ValueError(f"{what} weight {name} has shape {tuple(value.shape)}, the "
                             f"config implies {tuple(own[key].shape)}")
        with torch.no_grad():
            own[key].copy_(value)
        loaded.add(key)
    params = {n for n, _ in module.named_parameters()}
    missing = sorted(params - loaded)
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise ValueError(f"the checkpoint lacks {len(missing)} {what} weights: {shown}")
