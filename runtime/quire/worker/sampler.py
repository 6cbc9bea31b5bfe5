"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Everything runs on [rows, vocab] tensors. The only per-row work is drawing a uniform for rows
that carry their own seed, so that a seeded request samples the same tokens whatever else
shares its batch. Tokens are drawn by inverse CDF, one uniform a row (worker/draws.py says
why not the exponential race).

It reads a SamplingBatch (quire/sampling_batch.py): per-row values the engine built, with the
seeded rows' own generators, which the engine keeps with their sequences across steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quire.native import fused_ops
from quire.sampling_batch import SamplingBatch
from quire.structured.bitmask import apply_token_bitmask
from quire.worker.draws import draw_rows, uniforms
from quire.worker.rejection import verify_greedy, verify_sampled


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: None, or (sampled logprob, sampled rank, top ids, top logprobs)
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


# top-p decides among this many of a row's likeliest tokens, in turn, before it sorts the row
NUCLEUS_CANDIDATES = (256, 4096)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """`logits` [rows, vocab], row i sampled by column i of `batch`. A verification
        group's first row gets the list of tokens its sequence keeps (the accepted proposals
        and the one drawn after them), its other rows None."""
        if batch.spec_groups:
            return self._verify_and_sample(logits, batch)
        # grammars first, in one op for the batch: every later step (greedy, penalties,
        # top-k/p, logprobs, beam candidates) sees only the tokens the grammar allows
        if batch.bitmask is not None:
            logits = apply_token_bitmask(logits, batch.bitmask)
        want_logprobs = batch.logprobs
        if (all(batch.greedy) and all(k is None for k in want_logprobs)
                and not any(batch.penalized) and not any(batch.banned_token_ids)):
            # the first maximum is the same in any float dtype: skip widening [rows, vocab]
            # (fused_ops.argmax_rows: max().indices' first maximum, natively on the CPU, torch's
            # elsewhere; torch's argmax is slower still)
            return SamplerOutput(fused_ops.argmax_rows(logits), [None] * len(batch))
        logits = logits.float()
        raw_logprobs = None
        if any(k is not None for k in want_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, batch)
        logits = self._ban_early_stops(logits, batch)
        if all(batch.greedy):
            tokens = logits.max(dim=-1).indices
        else:
            tokens = self._sample(logits, batch)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, want_logprobs, tokens))

    # --- logits processing ---------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        idx = [i for i, pen in enumerate(batch.penalized) if pen]
        if not idx:
            return logits
        logits = logits.clone()
        out_counts = self._counts([batch.output_token_ids[i] for i in idx])
        seen = out_counts > 0
        seen |= self._counts([batch.prompt_token_ids[i] for i in idx]) > 0
        x = logits[idx]
        rep = self._tensor([batch.repetition_penalty[i] for i in idx])[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = self._tensor([batch.frequency_penalty[i] for i in idx])[:, None]
        pres = self._tensor([batch.presence_penalty[i] for i in idx])[:, None]
        x = x - freq * out_counts - pres * (out_counts > 0).float()
        # a penalty near 0 (or huge) divides a logit past float's range: +inf would make the
        # softmax NaN (and the draw token 0, whatever the grammar allows). Saturate at the
        # largest finite value instead; a token that was -inf (a grammar's or a ban's "never")
        # stays -inf.
        big = torch.finfo(x.dtype).max
        x = torch.where(torch.isneginf(logits[idx]), logits[idx], x.clamp(-big, big))
        logits[idx] = x
        return logits

    def _counts(self, token_lists: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in token_lists), default=0)
        padded = torch.full((len(token_lists), max(width, 1)), self.vocab_size, dtype=torch.long)
        for i, t in enumerate(token_lists):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        counts = torch.zeros(len(token_lists), self.vocab_size + 1, device=self.device)
        counts.scatter_add_(1, padded.to(self.device), torch.ones_like(padded, dtype=torch.float,
                                                                          device=self.device))
        return counts[:, : self.vocab_size]

    def _ban_early_stops(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Under min_tokens, EOS and stop_token_ids can't be sampled."""
        bans = [(i, ids) for i, ids in enumerate(batch.banned_token_ids) if ids]
        if not bans:
            return logits
        logits = logits.clone()
        for i, ids in bans:
            logits[i, ids] = float("-inf")
        return logits

    # --- speculative decoding: verification (worker/rejection.py) --------------------
    def _verify_and_sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        grouped = {start + j for start, p in batch.spec_groups for j in range(len(p) + 1)}
        plain = [i for i in range(len(batch)) if i not in grouped]
        tokens: list = [None] * len(batch)
        logprobs: list = [None] * len(batch)
        if plain:
            out = self(logits[plain], batch.subset(plain))
            for i, token, lp in zip(plain, out.token_ids, out.logprobs):
                tokens[i], logprobs[i] = token, lp
        for start, proposals in batch.spec_groups:
            rows = list(range(start, start + len(proposals) + 1))
            tokens[start] = self._verify(logits[start:start + len(rows)], batch.subset(rows),
                                         proposals)
        return SamplerOutput(tokens, logprobs)

    def _verify(self, x: torch.Tensor, rows: SamplingBatch, proposals: list[int]) -> list[int]:
        """One sequence's k + 1 positions: the same processing as sampling one at a time
        (grammar masks and min_tokens bans per position), then acceptance."""
        if rows.bitmask is not None:
            x = apply_token_bitmask(x, rows.bitmask)
        if any(rows.banned_token_ids):
            x = self._ban_early_stops(x.float(), rows)
        if rows.greedy[0]:
            return verify_greedy(x.max(dim=-1).indices.tolist(), proposals)
        return verify_sampled(self._probs(x.float(), rows), proposals,
                              rows.generators[0] or self.generator)

    # --- sampling ------------------------------------------------------------------------
    def _probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distributions the rows sample from: temperature, top-k / top-p, min-p."""
        greedy = batch.greedy
        temps = self._tensor([1.0 if g else t for g, t in zip(greedy, batch.temperature)])
        x = logits / temps[:, None]
        top_k = [k if 0 < k < self.vocab_size else 0 for k in batch.top_k]
        top_p = batch.top_p
        if any(p < 1.0 for p in top_p):
            x = self._top_k_top_p(x, top_k, top_p)
        elif any(top_k):
            x = self._top_k(x, top_k)
        probs = torch.softmax(x, dim=-1)
        min_p = batch.min_p
        if any(min_p):
            floor = self._tensor(min_p)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy = batch.greedy
        probs = self._probs(logits, batch)
        sampled = draw_rows(probs, self._uniforms(batch))
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=self.device),
                                  logits.max(dim=-1).indices, sampled)
        return sampled

    def _uniforms(self, batch: SamplingBatch) -> torch.Tensor:
        """A uniform per row: a seeded row's from its own generator, the others' in one call
        to the engine's (greedy rows draw none: they take the argmax)."""
        u = torch.zeros(len(batch), dtype=torch.float64, device=self.device)
        shared = []
        for i, (g, greedy) in enumerate(zip(batch.generators or [None] * len(batch),
                                            batch.greedy)):
            if greedy:
                continue
            if g is None:
                shared.append(i)
            else:
                u[i] = uniforms(1, g, self.device)[0]
        if shared:
            u[shared] = uniforms(len(shared), self.generator, self.device)
        return u

    def make_generator(self, seed: int) -> torch.Generator:
        """A request's own generator (made when it is added, so a bad seed fails alone; the
        engine keeps it with the request and hands it over in each step's SamplingBatch)."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def _top_k(self, x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        k_max = max(top_k)
        kth = x.topk(k_max, dim=-1).values
        k = torch.tensor([max(k, 1) - 1 for k in top_k], device=self.device)
        threshold = kth.gather(1, k[:, None])
        threshold[torch.tensor([k == 0 for k in top_k], device=self.device)] = float("-inf")
        return x.masked_fill(x < threshold, float("-inf"))

    def _top_k_top_p(self, x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """transformers' warpers' rule (top-k, then drop the least likely tokens while their
        mass stays <= 1 - top_p), without sorting the vocabulary: a full sort of 32 rows of a
        49k vocabulary took ~300 ms on a 2-core Zen 1 EPYC, and a nucleus rarely reaches past
        a few hundred tokens. A row's top NUCLEUS_CANDIDATES[0] tokens decide; one whose nucleus
        reaches past them tries 16 times as many, then is sorted whole."""
        if any(top_k):
            x = self._top_k(x, top_k)
        rows = [i for i, p in enumerate(top_p) if p < 1.0]
        if not rows:
            return x
        x = x.clone()
        p = torch.tensor([top_p[i] for i in rows], dtype=torch.float64, device=self.device)
        sub = x[rows]
        left = torch.arange(len(rows), device=self.device)  # rows not settled yet
        for n in NUCLEUS_CANDIDATES:
            if not len(left) or n >= x.shape[-1]:
                break
            part, fits = _top_p_among(sub[left], p[left], n)
            sub[left[fits]] = part[fits]
            left = left[~fits]
        if len(left):
            sub[left] = _sorted_top_p(sub[left], p[left])
        x[rows] = sub
        return x

    # --- logprobs ------------------------------------------------------------------------
    def _logprobs(self, raw: torch.Tensor | None, want: list[int | None], tokens: torch.Tensor):
        if raw is None:
            return [None] * len(want)
        rows = [i for i, k in enumerate(want) if k is not None]
        sel = raw[rows]
        chosen = tokens[rows]
        chosen_lp = sel.gather(1, chosen[:, None])
        ranks = (sel > chosen_lp).sum(dim=-1) + 1
        k_max = max(want[i] for i in rows)
        top_lp, top_ids = sel.topk(k_max, dim=-1) if k_max else (sel[:, :0], chosen[:, None][:, :0])
        out: list = [None] * len(want)
        chosen_lp, ranks = chosen_lp[:, 0].tolist(), ranks.tolist()
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            k = want[i]
            out[i] = (chosen_lp[j], ranks[j], top_ids[j][:k], top_lp[j][:k])
        return out

    def _tensor(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)


def _top_p_among(x: torch.Tensor, top_p: torch.Tensor, n: int):
    """Top-p decided by each row's n likeliest tokens: the filtered rows, and which rows they
    settle (those whose n tokens hold at least top_p of the mass: no token past them stays)."""
    lse = torch.logsumexp(x, dim=-1, keepdim=True).double()
    top = x.topk(n, dim=-1).values  # descending
    probs = (top.double() - lse).exp()
    above = probs.cumsum(dim=-1) - probs  # the mass of the tokens ranked above each
    # a prefix, the first always in it (p > 0; the clamp: a row of NaN keeps its NaN)
    keep = (above < top_p[:, None]).sum(dim=-1).clamp_(min=1)
    threshold = top.gather(1, (keep - 1)[:, None])
    fits = ~(probs.sum(dim=-1) < top_p)  # (NaN rows settle here too)
    return x.masked_fill(x < threshold, float("-inf")), fits


def _sorted_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p by a full sort, ascending, as transformers' TopPLogitsWarper does it."""
    sorted_x, order = x.sort(dim=-1)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - top_p.to(cum.dtype)[:, None]
    drop[:, -1] = False  # always keep the most likely token
    return torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill(drop, float("-inf")))
