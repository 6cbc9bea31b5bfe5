"""Plain float32 attention in transformers' eager order, the reference the attention tests
compare every backend path with when soft-capping (Gemma 2), sinks (gpt-oss) or key limits
(Gemma 3's image runs) are on: scores = (q . k) * scale; scores = cap * tanh(scores / cap);
the causal and sliding-window mask (added as float32's lowest value; a step's key limits
stand for each query's own position as the last key it sees, the window still counting back
from the position); with sinks, the sink's logit is one more column, the row's max is
subtracted, softmax, and the column dropped; then P @ V.
"""

from __future__ import annotations

import torch

# Options each attention path is checked with: a cap small enough to clip (scores of random
# q and k have a standard deviation of ~1 here, so most exceed it), sinks comparable to the
# rows' sums of exp(score), and a window shorter than the longer contexts.
OPTIONS = {
    "softcap": dict(softcap=0.5),
    "sinks": dict(sinks=True),
    "softcap+window": dict(softcap=0.5, window=24),
    "softcap+sinks+window": dict(softcap=0.5, sinks=True, window=24),
}


def options(name: str, num_heads: int, device=None) -> dict:
    """OPTIONS[name] as keyword arguments: softcap, sinks ([num_heads] float32) and window."""
    opts = OPTIONS[name]
    sinks = torch.linspace(-2.0, 4.0, num_heads, device=device) if opts.get("sinks") else None
    return dict(softcap=opts.get("softcap"), sinks=sinks, window=opts.get("window"))


def eager_attention(q, k, v, scale, q_pos, softcap=None, sinks=None, window=None,
                    key_limits=None):
    """One sequence: q [Lq, H, D] at positions q_pos [Lq], k/v [Lk, Hkv, D] at positions
    0..Lk-1; key_limits None or [Lq]: each query's last visible key. Returns [Lq, H, D]
    float32."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)   # [H, Lk, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [H, Lq, Lk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kpos = torch.arange(k.shape[1], device=q.device)[None, :]
    visible = kpos <= (q_pos if key_limits is None else key_limits.long())[:, None]
    if window is not None:
        visible &= kpos > q_pos[:, None] - window
    scores = scores + torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, q.shape[0], 1)], -1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1)


def paged_reference(q, k_cache, v_cache, meta, scale, softcap=None, sinks=None, window=None):
    """Every sequence of a step (AttentionMetadata) over the K/V its block table holds in the
    caches, the step's own tokens already written. Returns [T, H, D] float32 on the CPU."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu().float(), v_cache.cpu().float()
    tables = meta.block_tables.cpu()
    sinks = None if sinks is None else sinks.cpu()
    _, bs, hkv, d = k_cache.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    qsl = meta.query_start_loc_cpu
    limits = getattr(meta, "key_limits", None)  # (some tests pass a namespace)
    limits = None if limits is None else limits.cpu()
    for i, ctx in enumerate(meta.seq_lens_cpu):
        q0, q1 = qsl[i], qsl[i + 1]
        pos = torch.arange(ctx)
        slots = tables[i][pos // bs].long() * bs + pos % bs
        k, v = k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots]
        out[q0:q1] = eager_attention(q[q0:q1], k, v, scale, pos[ctx - (q1 - q0):], softcap,
                                     sinks, window,
                                     None if limits is None else limits[q0:q1])
    return out


def check(got, q, k_cache, v_cache, meta, scale, tol, softcap=None, sinks=None, window=None):
    """`got` (a step's output) equals the reference within tol, and each option given moves
    the reference by far more than tol: a path that ignored one would fail."""
    opts = dict(softcap=softcap, sinks=sinks, window=window)
    want = paged_reference(q, k_cache, v_cache, meta, scale, **opts)
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
    for name in [n for n, value in opts.items() if value is not None]:
        without = paged_reference(q, k_cache, v_cache, meta, scale, **{**opts, name: None})
        moved = (want - without).abs().max().item()
        assert moved > 20 * tol, f"{name} moves the output by only {moved:.3g}"
