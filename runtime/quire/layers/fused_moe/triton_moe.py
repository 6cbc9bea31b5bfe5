"""The grouped experts forward on CUDA: one Triton kernel launch per projection over all
experts, as vLLM's fused_moe.

`align` sorts the (token, expert) pairs by expert on the device and pads each expert's run to
a multiple of BLOCK_M (padding slots hold the sentinel S = T * k), so every block of BLOCK_M
sorted rows belongs to one expert (`block_experts`). The kernel's program (block of rows,
block of N) gathers its rows of A (token rows for gate/up: pair // k; pair rows for down),
multiplies them by its expert's [N, K] weight, float or int8 / int4 dequantized in registers
from the canonical tensors, and in its epilogue adds the expert's bias and multiplies by the
pair's top-k weight before storing each row at its pair's place. The down projection stores
float32, and a token's k rows are summed in top-k order, as transformers does.

fp32 inputs multiply with IEEE products ("ieee"): equal to the CPU paths up to the order of
the sums. Tested in TRITON_INTERPRET=1 against the per-expert loop (the interpreter's bf16
tl.dot is wrong, so those cases are fp32 and fp16) and compiled on a GPU when one is lent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quire.layers.fused_moe import activation
from quire.layers.fused_moe.experts import logical

QUANT_CODES = {"float": 0, "int8": 8, "int4": 4}


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, k] -> (sorted_ids [capacity] int32: pair ids by expert, each expert's
    run padded to block_m with the sentinel T * k; block_experts [capacity // block_m] int32;
    num_padded [1]: the padded length). No host sync: capacity is a bound, and programs past
    num_padded return at once."""
    flat = topk_ids.reshape(-1)
    s = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    sorted_experts, order = torch.sort(flat, stable=True)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(s, device=flat.device) - first[sorted_experts]
    dest = ends[sorted_experts] - padded[sorted_experts] + rank
    capacity = s + min(s, num_experts) * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((capacity,), s, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_experts.to(torch.int32), ends[-1:]


@triton.jit
def _moe_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, scales_ptr, zeros_ptr, weights_ptr,
                sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
                N, K, capacity, num_valid,
                stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                stride_biase, stride_se, stride_sn,
                A_ROWS_PER_PAIR: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr,
                HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(capacity, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped program order: GROUP_M row blocks share each weight tile while it is cached
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % rows_here)
    pid_n = (pid % per_group) // rows_here
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_mask = pairs < num_valid
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    a_rows = pairs // A_ROWS_PER_PAIR
    b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    s_base = scales_ptr + expert * stride_se + offs_n[None, :] * stride_sn
    z_base = zeros_ptr + expert * stride_se + offs_n[None, :] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        if QUANT == 0:
            b = tl.load(b_base + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0)
        else:
            scale = tl.load(s_base + (offs_k[:, None] // GROUP), mask=b_mask, other=0.0)
            if QUANT == 8:
                q = tl.load(b_base + offs_k[:, None] * stride_bk, mask=b_mask, other=0)
                w = q.to(tl.float32) * scale
            else:  # int4: two k a byte, the even one in the low nibble
                byte = tl.load(b_base + (offs_k[:, None] // 2) * stride_bk, mask=b_mask,
                               other=0).to(tl.int32)
                q = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF
                zero = tl.load(z_base + (offs_k[:, None] // GROUP), mask=b_mask, other=0.0)
                w = (q.to(tl.float32) - 8.0) * scale + zero
            b = w.to(a.dtype)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_biase + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small where each expert gets few rows (decode), larger for prefill."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def grouped_linear(a: torch.Tensor, layer, proj: str, out: torch.Tensor, aligned,
                   a_rows_per_pair: int, bias: torch.Tensor | None = None,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[pair] = (a[pair // a_rows_per_pair] @ W[expert(pair)].T + bias) * weights[pair]."""
    sorted_ids, block_experts, num_padded, block_m = aligned
    method = layer.method
    kind = method.kind
    if kind == "float":
        b = logical(getattr(layer, f"{proj}_weight"))
        scales = zeros = b
        group = 1
    else:
        b = getattr(layer, f"{proj}_qweight")
        scales = getattr(layer, f"{proj}_scales")
        zeros = getattr(layer, f"{proj}_zeros", None)
        zeros = scales if zeros is None else zeros
        group = layer.quant_groups[proj]
    n, k = out.shape[1], a.shape[1]
    if b.numel() == 0:
        raise ValueError(f"{layer.prefix}: the canonical expert weights were freed (they "
                         "load for the CPU kernels); the Triton path needs them on CUDA")
    a = a.contiguous()
    block_n, block_k = 64, 32 if a.dtype == torch.float32 else 64
    grid = (triton.cdiv(sorted_ids.numel(), block_m) * triton.cdiv(n, block_n),)
    _moe_kernel[grid](
        a, b, out, bias if bias is not None else out, scales, zeros,
        weights if weights is not None else out, sorted_ids, block_experts, num_padded,
        n, k, sorted_ids.numel(), weights.numel() if weights is not None else out.shape[0],
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        bias.stride(0) if bias is not None else 0, scales.stride(0), scales.stride(1),
        A_ROWS_PER_PAIR=a_rows_per_pair, GROUP=group, QUANT=QUANT_CODES[kind],
        HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=8)
    return out


def fused_experts(layer, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H] (this rank's partial sum): gate/up, activation, down with the
    bias and top-k weight in its epilogue, then each token's k rows summed."""
    num_tokens, top_k = topk_ids.shape
    pairs = num_tokens * top_k
    block_m = block_m_for(pairs, layer.num_experts)
    aligned = (*align(topk_ids, layer.num_experts, block_m), block_m)
    h = x.new_empty(pairs, 2 * layer.intermediate_size)
    grouped_linear(x, layer, "w13", h, aligned, top_k, bias=layer.w13_bias)
    h = activation.apply(layer.activation, h, layer.swiglu_alpha, layer.swiglu_limit)
    y = torch.empty(pairs, layer.hidden_size, dtype=torch.float32, device=x.device)
    grouped_linear(h, layer, "w2", y, aligned, 1,
                   bias=layer.w2_bias if layer.adds_w2_bias else None,
                   weights=topk_weights.reshape(-1).contiguous())
    return y.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
