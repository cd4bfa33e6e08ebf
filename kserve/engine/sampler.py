"""Batched sampling on the logits' device: `[B, V]` float32 logits in, one token per row out.

Each feature runs only over the rows whose `Needs` flags ask for it; random rows use the exponential race over
seeded counter-based noise. Details: docs/engine.md, 'Sampler'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kserve.engine.outputs import TokenLogprob
from kserve.engine.sequence import Needs, Sequence
from kserve.engine.token_bitmask import apply_token_bitmask, new_bitmask, set_allowed

# Seeds for the completions of one n > 1 request: completion i uses seed + i * SEED_STRIDE.
SEED_STRIDE = 1_000_003
_M32 = 0xFFFFFFFF


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # rows whose user code (logits processor, constraint) raised: their request fails, no one else's
    errors: dict[int, Exception] = field(default_factory=dict)


class EmptyDistributionError(RuntimeError):
    """Every token of a row was masked: there is nothing to sample."""


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32  # wraps in int64; the low 32 bits are exact either way
    return x ^ (x >> 16)


def seeded_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] Exp(1) noise, a pure function of (seed, position, token id) per row."""
    dev = seeds.device
    # Chained, not xor-ed side by side: (lo, hi) and (hi, lo) must not meet (seeds s and s << 32).
    row = _mix32(_mix32(_mix32((seeds & _M32) ^ 0x3C6EF372) ^ ((seeds >> 32) & _M32)) ^ (positions & _M32))
    col = _mix32(torch.arange(vocab, device=dev, dtype=torch.int64) + 0x9E3779B9)
    # 23 bits keep u strictly below 1 in float32 (with 24, u rounds up to 1.0, the noise to 0, and a
    # masked token's 0/0 = NaN wins the argmax).
    bits = _mix32(row.unsqueeze(1) ^ col.unsqueeze(0)) >> 9
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(u)


class Sampler:
    def __init__(self, eos_token_ids: list[int], device: torch.device | str) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)

    def stop_ids_for(self, seq: Sequence) -> list[int]:
        return self.eos_token_ids + [t for t in seq.params.stop_token_ids if t not in self.eos_token_ids]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        batch = logits.shape[0]
        rows: dict[Needs, list[int]] = {flag: [] for flag in Needs}
        constrained: list[int] = []
        any_needs = Needs.NOTHING
        for i, seq in enumerate(seqs):
            needs = seq.needs
            if needs:
                any_needs |= needs
                for flag in needs:
                    rows[flag].append(i)
            if seq.constraint is not None:
                constrained.append(i)

        # Processing writes into the logits; work on a copy then, so that the caller can still
        # sample rows one by one from the untouched logits if this batched call raises.
        edits = any_needs & (Needs.PROCESSORS | Needs.LOGIT_BIAS | Needs.PENALTIES | Needs.MIN_TOKENS)
        logits = logits.to(torch.float32, copy=bool(edits or constrained))

        lp_rows = rows[Needs.LOGPROBS]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

        errors: dict[int, Exception] = {}
        if any_needs & Needs.PROCESSORS:
            self._apply_logits_processors(logits, [(i, seqs[i]) for i in rows[Needs.PROCESSORS]], errors)
        if any_needs & Needs.LOGIT_BIAS:
            self._apply_logit_bias(logits, [(i, seqs[i]) for i in rows[Needs.LOGIT_BIAS]])
        if any_needs & Needs.PENALTIES:
            self._apply_penalties(logits, rows[Needs.PENALTIES], seqs)
        if constrained:
            self._apply_constraints(logits, [(i, seqs[i]) for i in constrained], errors)
        if any_needs & Needs.MIN_TOKENS:
            self._apply_min_tokens(logits, [(i, seqs[i]) for i in rows[Needs.MIN_TOKENS]])

        if any_needs & Needs.RANDOM:
            sampled = self._sample_random(logits, seqs, rows, any_needs)
        else:
            sampled = logits.argmax(dim=-1)
        # A row that masking left with no finite logit has no token to give (its argmax would be an
        # arbitrary 0): it fails its own request. Checked only where masking can empty a row.
        maskable = constrained or any_needs & Needs.PROCESSORS
        if maskable:
            empty = ~torch.isfinite(logits).any(dim=-1)
            host = torch.stack((sampled, empty.to(sampled.dtype))).tolist()
            token_ids: list[int] = host[0]
            for i, is_empty in enumerate(host[1]):
                if is_empty and i not in errors:
                    errors[i] = EmptyDistributionError(
                        "no token is allowed at this position (the logits processors and the grammar "
                        "together masked the whole vocabulary)")
        else:
            token_ids = sampled.tolist()

        logprobs: list[TokenLogprob | None] = [None] * batch
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, lp_rows, sampled, token_ids, seqs, logprobs)
        return SamplerOutput(token_ids, logprobs, errors)

    # ------------------------------------------------------------------ logits processing
    def _apply_logits_processors(
        self, logits: torch.Tensor, items: list[tuple[int, Sequence]], errors: dict[int, Exception]
    ) -> None:
        for i, seq in items:
            out = seq.output_token_ids
            row = logits[i]
            try:
                for proc in seq.params.logits_processors:
                    row = proc(out, row)
                logits[i] = row
            except Exception as exc:  # noqa: BLE001 -- user code: fails only its request
                errors[i] = exc

    def _apply_logit_bias(self, logits: torch.Tensor, items: list[tuple[int, Sequence]]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        vocab = logits.shape[1]
        for i, seq in items:
            for tok, bias in seq.params.logit_bias.items():
                if 0 <= int(tok) < vocab:
                    rows.append(i)
                    cols.append(int(tok))
                    vals.append(float(bias))
        if rows:
            dev = logits.device
            logits.index_put_(
                (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                torch.tensor(vals, device=dev),
                accumulate=True,
            )

    def _apply_penalties(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        dev = logits.device
        vocab = logits.shape[1]
        chosen = [seqs[i] for i in rows]
        idx = torch.tensor(rows, device=dev)
        sub = logits.index_select(0, idx)
        output_counts = _token_counts([s.output_token_ids for s in chosen], vocab, dev)
        prompt_counts = _token_counts([s.token_ids[: s.num_prompt_tokens] for s in chosen], vocab, dev)

        rep = torch.tensor([s.params.repetition_penalty for s in chosen], device=dev).unsqueeze(1)
        seen = (output_counts + prompt_counts) > 0
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)

        freq = torch.tensor([s.params.frequency_penalty for s in chosen], device=dev).unsqueeze(1)
        pres = torch.tensor([s.params.presence_penalty for s in chosen], device=dev).unsqueeze(1)
        sub = sub - freq * output_counts - pres * (output_counts > 0).float()
        logits.index_copy_(0, idx, sub)

    def _apply_min_tokens(self, logits: torch.Tensor, items: list[tuple[int, Sequence]]) -> None:
        """Forbid stop tokens before min_tokens, except in a row where nothing else is allowed (a
        grammar that can only stop): there the stop wins, rather than an empty distribution."""
        row_ids: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[1]
        for i, seq in items:
            if seq.num_output_tokens < seq.params.min_tokens:
                stops = [t for t in self.stop_ids_for(seq) if 0 <= t < vocab]
                if stops:
                    rows.extend([len(row_ids)] * len(stops))
                    cols.extend(stops)
                    row_ids.append(i)
        if not row_ids:
            return
        dev = logits.device
        index = torch.tensor(row_ids, device=dev)
        before = logits.index_select(0, index)
        after = before.index_put(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.tensor(float("-inf"), device=dev),
        )
        keeps_a_token = (after > float("-inf")).any(dim=-1, keepdim=True)
        logits.index_copy_(0, index, torch.where(keeps_a_token, after, before))

    def _apply_constraints(
        self, logits: torch.Tensor, items: list[tuple[int, Sequence]], errors: dict[int, Exception]
    ) -> None:
        vocab = logits.shape[1]
        bitmask = new_bitmask(len(items), vocab)
        for j, (i, seq) in enumerate(items):
            try:
                if seq.constraint.is_terminated():
                    stop = [t for t in self.stop_ids_for(seq) if 0 <= t < vocab][:1]
                    set_allowed(bitmask, j, stop)
                else:
                    seq.constraint.fill_bitmask(bitmask, j)
            except Exception as exc:  # noqa: BLE001 -- user code: fails only its request
                errors[i] = exc
        rows = torch.tensor([i for i, _ in items], device=logits.device)
        apply_token_bitmask(logits, bitmask, rows)

    # ------------------------------------------------------------------ sampling
    def _sample_random(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: dict[Needs, list[int]], any_needs: Needs
    ) -> torch.Tensor:
        """Sample the rows with temperature > 0 (greedy rows take the argmax); vectorised."""
        dev = logits.device
        random_rows = rows[Needs.RANDOM]
        all_random = len(random_rows) == len(seqs)
        picked = seqs if all_random else [seqs[i] for i in random_rows]
        sub = logits if all_random else logits[random_rows]
        temps = torch.tensor([s.params.temperature for s in picked], device=dev).unsqueeze(1)
        sub = sub / temps
        if any_needs & Needs.TOP_K_TOP_P:
            sub = _top_k_top_p(sub, picked)
        probs = torch.softmax(sub, dim=-1)
        if any_needs & Needs.MIN_P:
            min_p = torch.tensor([s.params.min_p for s in picked], device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        seeds = torch.tensor([s.seed for s in picked], dtype=torch.int64)
        positions = torch.tensor([len(s.token_ids) - s.num_prompt_tokens for s in picked], dtype=torch.int64)
        noise = seeded_exponential(seeds.to(dev, non_blocking=True), positions.to(dev, non_blocking=True), probs.shape[1])
        sampled = (probs / noise).argmax(dim=-1)
        if all_random:
            return sampled
        out = logits.argmax(dim=-1)
        out[random_rows] = sampled
        return out

    def _gather_logprobs(
        self,
        raw_logprobs: torch.Tensor,
        lp_rows: list[int],
        sampled: torch.Tensor,
        token_ids: list[int],
        seqs: list[Sequence],
        out: list[TokenLogprob | None],
    ) -> None:
        rows = torch.tensor(lp_rows, device=raw_logprobs.device)
        chosen = raw_logprobs.gather(1, sampled[rows].unsqueeze(1)).squeeze(1).tolist()
        k = max(seqs[i].params.logprobs or 0 for i in lp_rows)
        top_vals: list[list[float]] = [[] for _ in lp_rows]
        top_ids: list[list[int]] = [[] for _ in lp_rows]
        if k > 0:
            vals, ids = raw_logprobs.topk(k, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for j, i in enumerate(lp_rows):
            kk = seqs[i].params.logprobs or 0
            out[i] = TokenLogprob(token_ids[i], chosen[j], dict(zip(top_ids[j][:kk], top_vals[j][:kk])))


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32 occurrence counts, built with one scatter."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for r, toks in enumerate(token_lists):
        if toks:
            padded[r, : len(toks)] = torch.tensor(toks, dtype=torch.long).clamp_(0, vocab)
    padded = padded.to(device, non_blocking=True)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p).

    Only the rows that ask are touched. When each of them sets a top_k, a partial sort (topk) of
    the largest top_k suffices; otherwise those rows are fully sorted.
    """
    rows = [i for i, s in enumerate(seqs) if s.needs & Needs.TOP_K_TOP_P]
    dev = logits.device
    vocab = logits.shape[1]
    params = [seqs[i].params for i in rows]
    ks = [min(p.top_k, vocab) if p.top_k not in (-1, 0, None) else vocab for p in params]
    sub = logits if len(rows) == len(seqs) else logits[rows]
    width = max(ks)
    if width < vocab // 2:
        sorted_logits, order = sub.topk(width, dim=-1)
    else:
        sorted_logits, order = sub.sort(dim=-1, descending=True)
    top_k = torch.tensor(ks, device=dev).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
    ranks = torch.arange(sorted_logits.shape[1], device=dev).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))  # first token stays
    masked = torch.full_like(sub, float("-inf")).scatter(1, order, sorted_logits)
    if len(rows) == len(seqs):
        return masked
    out = logits.clone()
    out[rows] = masked
    return out
