"""Turns sampled tokens into a completion: text, stop conditions and finish reasons.

Stop strings are searched in the decoded text, so one that spans several tokens is still caught.
While a sequence runs, any tail of its text that could still grow into a stop string is held back
(`Sequence.visible_len`), so a stop string never leaks into streamed output.
"""

from __future__ import annotations

from typing import Any

from kserve.engine.outputs import TokenLogprob
from kserve.engine.sequence import Sequence, SequenceStatus


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def start(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            seq.detokenizer = self.tokenizer.detokenizer(
                skip_special_tokens=seq.params.skip_special_tokens
            )

    def append_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        """Record one sampled token and finish the sequence if a stop condition is met."""
        self._append(seq, token_id, logprob)
        if seq.logprobs is not None:
            seq.token_text_ends.append(len(seq.text))
            self._release_logprobs(seq)

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        params = seq.params
        seq.token_ids.append(token_id)
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        if logprob is not None and seq.logprobs is not None:
            seq.logprobs.append(logprob)
        ignore_eos = params.ignore_eos
        constraint = seq.constraint
        if constraint is not None:
            if not constraint.is_terminated() and not constraint.accept_token(token_id):
                # The sampler masked it, so this is a constraint bug; the output may be invalid and
                # must not look complete.
                self._finish(seq, "abort", None)
                return
            if constraint.is_terminated():
                ignore_eos = False  # the grammar is complete: its stop token ends the completion
                if not (self.eos_token_ids or params.stop_token_ids):
                    self._finish(seq, "stop", None)  # complete, and no stop token to force
                    return
                # The grammar allowed nothing but a stop token: the schema wins over min_tokens.
                if token_id in self.eos_token_ids or token_id in params.stop_token_ids:
                    self._finish(seq, "stop", token_id)
                    return

        check_stops = num_output >= params.min_tokens
        if check_stops and (
            (token_id in self.eos_token_ids and not ignore_eos) or token_id in params.stop_token_ids
        ):
            self._finish(seq, "stop", token_id)
            return

        if seq.detokenizer is not None:
            piece = seq.detokenizer.add([token_id])
            if piece:
                start = len(seq.text)
                seq.text += piece
                if not params.stop:
                    seq.visible_len = len(seq.text)
                elif check_stops:
                    if self._check_stop_strings(seq, start):
                        return
                else:
                    seq.visible_len = len(seq.text) - _held_back(seq.text, params.stop)

        if (params.max_tokens is not None and num_output >= params.max_tokens) or (
            len(seq.token_ids) >= self.max_model_len
        ):
            self._finish(seq, "length", None)

    def finish_aborted(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self._finish(seq, "abort", None)
            if seq.logprobs is not None:
                self._release_logprobs(seq)

    @staticmethod
    def _release_logprobs(seq: Sequence) -> None:
        """Advance `num_released_logprobs`: while running, the tokens whose text is all visible; at
        the end, every token but those wholly inside a stop string that was cut off."""
        ends = seq.token_text_ends
        released = seq.num_released_logprobs
        if seq.is_finished:
            if isinstance(seq.stop_reason, str):  # ended by a stop string: its tokens are not shown
                cut = len(seq.text)
                while released < len(ends) and (ends[released - 1] if released else 0) < cut:
                    released += 1
            else:
                released = len(ends)
        else:
            visible = seq.visible_len
            while released < len(ends) and ends[released] <= visible:
                released += 1
        seq.num_released_logprobs = min(released, len(seq.logprobs or ()))

    # ------------------------------------------------------------------ internals
    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.detokenizer is not None:
            start = len(seq.text)
            seq.text += seq.detokenizer.flush()
            seq.detokenizer = None
            # The flushed tail may complete a stop string too; then that string is why it stopped.
            if reason != "stop" or isinstance(stop_reason, int):
                found = self._cut_at_stop_string(seq, start)
                if found is not None and reason != "abort":
                    seq.finish_reason, seq.stop_reason = "stop", found
        seq.visible_len = len(seq.text)

    def _check_stop_strings(self, seq: Sequence, start: int) -> bool:
        stops = seq.params.stop
        if not stops:
            seq.visible_len = len(seq.text)
            return False
        found = self._cut_at_stop_string(seq, start)
        if found is not None:
            self._finish(seq, "stop", found)
            return True
        seq.visible_len = len(seq.text) - _held_back(seq.text, stops)
        return False

    def _cut_at_stop_string(self, seq: Sequence, start: int) -> str | None:
        stops = seq.params.stop
        if not stops:
            return None
        longest = max(len(s) for s in stops)
        search_from = max(0, start - longest + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            at = seq.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        seq.text = seq.text[: at + len(stop)] if seq.params.include_stop_str_in_output else seq.text[:at]
        return stop


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    if not stops:
        return 0
    for k in range(min(max(len(s) for s in stops) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
