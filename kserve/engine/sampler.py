"""Batched sampling on the logits' device.

Every step the sampler turns `[B, V]` float32 logits into one token per row. Work is vectorised
over rows that need it; a feature no row uses costs nothing. The only host transfer in the common
path is the final list of sampled ids (plus the requested logprobs, when any row asks).

Random rows use the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is an exact sample of p.
A seeded request draws its E from its own torch.Generator, so its samples depend only on its own
seed and history, never on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kserve.engine.outputs import TokenLogprob
from kserve.engine.sequence import Sequence
from kserve.engine.token_bitmask import apply_token_bitmask, new_bitmask, set_allowed

# Seeds for the completions of one n > 1 request: completion i uses seed + i * SEED_STRIDE.
SEED_STRIDE = 1_000_003


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, eos_token_ids: list[int], device: torch.device | str, seed: int = 0) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def stop_ids_for(self, seq: Sequence) -> list[int]:
        return self.eos_token_ids + [t for t in seq.params.stop_token_ids if t not in self.eos_token_ids]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        logits = logits.float()
        batch, vocab = logits.shape
        params = [s.params for s in seqs]

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        )  # the model's own distribution, before any processing

        self._apply_logits_processors(logits, seqs)
        self._apply_logit_bias(logits, seqs)
        self._apply_penalties(logits, seqs)
        self._apply_min_tokens(logits, seqs)
        self._apply_constraints(logits, seqs)

        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample_random(logits, seqs, greedy)
        token_ids: list[int] = sampled.tolist()

        logprobs: list[TokenLogprob | None] = [None] * batch
        if raw_logprobs is not None:
            rows = torch.tensor(logprob_rows, device=logits.device)
            chosen = raw_logprobs.gather(1, sampled[rows].unsqueeze(1)).squeeze(1).tolist()
            k = max(params[i].logprobs or 0 for i in logprob_rows)
            top_vals: list[list[float]] = [[] for _ in logprob_rows]
            top_ids: list[list[int]] = [[] for _ in logprob_rows]
            if k > 0:
                vals, ids = raw_logprobs.topk(k, dim=-1)
                top_vals, top_ids = vals.tolist(), ids.tolist()
            for j, i in enumerate(logprob_rows):
                kk = params[i].logprobs or 0
                top = dict(zip(top_ids[j][:kk], top_vals[j][:kk]))
                logprobs[i] = TokenLogprob(token_ids[i], chosen[j], top)
        return SamplerOutput(token_ids, logprobs)

    # ------------------------------------------------------------------ logits processing
    def _apply_logits_processors(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            if seq.params.logits_processors:
                out = seq.output_token_ids
                row = logits[i]
                for proc in seq.params.logits_processors:
                    row = proc(out, row)
                logits[i] = row

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            for tok, bias in (seq.params.logit_bias or {}).items():
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

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [
            i
            for i, s in enumerate(seqs)
            if s.params.presence_penalty != 0.0
            or s.params.frequency_penalty != 0.0
            or s.params.repetition_penalty != 1.0
        ]
        if not rows:
            return
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

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                for tok in self.stop_ids_for(seq):
                    if 0 <= tok < vocab:
                        rows.append(i)
                        cols.append(tok)
        if rows:
            dev = logits.device
            logits.index_put_(
                (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                torch.tensor(float("-inf"), device=dev),
            )

    def _apply_constraints(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return
        vocab = logits.shape[1]
        bitmask = new_bitmask(len(rows), vocab)
        for j, i in enumerate(rows):
            seq = seqs[i]
            if seq.constraint.is_terminated():
                stop = [t for t in self.stop_ids_for(seq) if 0 <= t < vocab][:1]
                set_allowed(bitmask, j, stop)
            else:
                seq.constraint.fill_bitmask(bitmask, j)
        apply_token_bitmask(logits, bitmask, torch.tensor(rows, device=logits.device))

    # ------------------------------------------------------------------ sampling
    def _sample_random(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]
    ) -> torch.Tensor:
        dev = logits.device
        params = [s.params for s in seqs]
        greedy_argmax = logits.argmax(dim=-1) if any(greedy) else None
        temps = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params)], device=dev
        ).unsqueeze(1)
        scaled = logits / temps

        if any(p.top_k not in (-1, 0, None) or p.top_p < 1.0 for p in params):
            scaled = _top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
            threshold = min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)

        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not greedy[i]:
                noise[i].exponential_(generator=seq.generator)
        sampled = (probs / noise).argmax(dim=-1)
        if greedy_argmax is not None:
            sampled = torch.where(torch.tensor(greedy, device=dev), greedy_argmax, sampled)
        return sampled


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


def _top_k_top_p(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p), with one sort."""
    dev = logits.device
    vocab = logits.shape[1]
    top_k = torch.tensor(
        [p.top_k if p.top_k not in (-1, 0, None) else vocab for p in params], device=dev
    ).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    remove = ranks >= top_k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove = mass_before >= top_p  # the first token always stays (mass_before == 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
