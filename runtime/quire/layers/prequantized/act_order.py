"""Input columns grouped by an arbitrary column -> group map (GPTQ's act-order `g_idx`, or a
rank's shard of it), brought to the contiguous, uniform groups the int kernels take.

The columns are sorted by group (stable); each group's run is padded, where needed, to a
multiple of the kernel group with columns that read a zero input. The layer then multiplies
x[:, perm] (x with one zero column appended when padded) by the sorted weight: the same
products, the same values, only the order of the sum differs. Without act-order the map is
k // G and nothing moves (perm is None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INT4_KERNEL_GROUPS = (128, 64, 32)


@dataclass
class Plan:
    perm: torch.Tensor | None   # [K'] input column per kernel column (K = a padded column)
    group: int                  # the kernel's group size
    block_groups: torch.Tensor  # [K' // group] the checkpoint group each kernel group reads
    padded: bool                # perm holds K (x gets a zero column appended)


def plan(g_idx: torch.Tensor, int4: bool) -> Plan:
    g_idx = g_idx.long()
    k = g_idx.numel()
    order = torch.sort(g_idx, stable=True).indices
    sorted_groups = g_idx[order]
    starts = torch.ones(k, dtype=torch.bool)
    starts[1:] = sorted_groups[1:] != sorted_groups[:-1]
    run_starts = torch.nonzero(starts).flatten()
    lengths = torch.diff(torch.cat([run_starts, torch.tensor([k])])).tolist()
    groups = sorted_groups[run_starts]
    common = math.gcd(*lengths)
    if int4:
        group = next((g for g in INT4_KERNEL_GROUPS if common % g == 0), 32)
    else:  # the int8 kernels take any group that divides K
        group = common if common >= 16 else 32
    identity = bool((order == torch.arange(k)).all())
    if all(n % group == 0 for n in lengths):
        perm = None if identity else order
        block_groups = torch.repeat_interleave(groups, torch.tensor(lengths) // group)
        return Plan(perm, group, block_groups, False)
    columns, blocks = [], []
    for start, n, g in zip(run_starts.tolist(), lengths, groups.tolist()):
        padded = -(-n // group) * group
        columns.append(order[start:start + n])
        columns.append(torch.full((padded - n,), k, dtype=torch.long))
        blocks += [g] * (padded // group)
    return Plan(torch.cat(columns), group, torch.tensor(blocks), True)


def gather_input(x: torch.Tensor, perm: torch.Tensor, padded: bool) -> torch.Tensor:
    if padded:
        x = torch.nn.functional.pad(x, (0, 1))
    return x.index_select(-1, perm)


def ungather_weight(w: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """The [N, K'] kernel-order weight back in the checkpoint's column order [N, K]."""
    out = torch.zeros(w.shape[0], k + 1, dtype=w.dtype)
    out[:, perm] = w
    return out[:, :k]
