"""The synchronous engine core: requests in, one model step at a time, completions out.

`LLM` (offline) and `AsyncLLMEngine` (server) both drive this class; neither duplicates its logic.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kserve.config import EngineConfig, ModelConfig
from kserve.engine.block_manager import BlockManager
from kserve.engine.device import resolve_device, resolve_dtype
from kserve.engine.errors import EngineDeadError, PromptRejected, RequestFailedError, is_fatal
from kserve.engine.faults import STEP_FAULTS_KEY
from kserve.engine.model_runner import ModelRunner, num_kv_blocks_for, profile_memory, resolve_kv_cache_dtype
from kserve.engine.output_processor import OutputProcessor
from kserve.engine.request import Request
from kserve.engine.sampler import Sampler, SamplerOutput
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.scheduler import Scheduler
from kserve.engine.seeds import completion_seed
from kserve.engine.sequence import Sequence
from kserve.engine.speculative import NgramProposer, Proposer, SpecDecodeStats, SpeculativeConfig
from kserve.engine.stop_tokens import collect_eos_ids
from kserve.model import kv_cache_bytes_per_token


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    prefix_cache_hit_tokens: int
    prefix_cache_miss_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    spec_decode: SpecDecodeStats | None = None  # with --speculative-config


logger = logging.getLogger(__name__)

# Model steps failing in a row before the engine declares itself dead (EngineConfig.extra can lower it).
MAX_CONSECUTIVE_STEP_FAILURES = 3
MAX_FAILURES_KEY = "max_consecutive_step_failures"
PROBE_PREFIX = "kserve-probe-"  # one-token requests the engine runs itself to test a failing model step


def _is_token_id(value: Any, vocab: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < vocab


def make_proposer(config: SpeculativeConfig, model: Any, device: Any, dtype: Any) -> Proposer:
    """The proposer a configuration names (an EAGLE-3 draft is loaded beside the target model, on rank 0)."""
    if config.method == "ngram":
        return NgramProposer(config)
    from kserve.engine.eagle3 import Eagle3Proposer

    return Eagle3Proposer(config, model, device, dtype)


class LLMEngine:
    consecutive_step_failures = 0  # model steps failed in a row; a step that runs resets it
    _suspects: dict[str, Exception] | None = None  # requests set aside after failed steps (see step())

    def __init__(
        self,
        model: Any,
        model_config: ModelConfig,
        tokenizer: Any,
        config: EngineConfig,
        model_dir: Path | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        tp_workers: Any = None,  # kserve.engine.tp_workers.TensorParallelWorkers, ranks 1..N-1
        vision: Any = None,  # kserve.model.moonvit.KimiVisionModel: the checkpoint's tower, when loaded
    ) -> None:
        self.config = config
        self.vision = vision
        self.dtype = dtype
        self.tp_workers = tp_workers
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.device = torch.device(device)

        eos = collect_eos_ids(tokenizer, self.model_dir, model_config.eos_token_id)
        self.eos_token_ids = eos

        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        bytes_per_token = kv_cache_bytes_per_token(model_config, kv_dtype)
        profile = None
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            # size the cache from what a full step really takes (rank 0 stands for every rank)
            profile = profile_memory(model, model_config, config, self.device, kv_dtype)
        num_blocks = num_kv_blocks_for(config, bytes_per_token, self.device, profile)
        # under decode context parallelism a block spans the group: block_size tokens on each of its ranks
        table_block_size = config.block_size * config.decode_context_parallel_size
        capacity = num_blocks * table_block_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings, capacity)

        self.block_manager = BlockManager(num_blocks, table_block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        runner_options = {
            "kv_cache_dtype": config.kv_cache_dtype,
            "max_num_seqs": config.max_num_seqs,
            "max_model_len": self.max_model_len,
            "enforce_eager": config.enforce_eager,
            "context_chunk_tokens": config.context_chunk_tokens,
            "batch_invariant": config.batch_invariant,
        }
        self.spec_config = SpeculativeConfig.parse(config.speculative_config)
        self.proposer = (make_proposer(self.spec_config, model, self.device, dtype)
                         if self.spec_config is not None else None)
        self.spec_stats = SpecDecodeStats() if self.spec_config is not None else None
        context_parallel = None
        if tp_workers is not None:
            tp_workers.init_cache(num_blocks, config.block_size, runner_options, config.decode_context_parallel_size)
            context_parallel = tp_workers.context_parallel
        self.runner = ModelRunner(
            model, model_config, num_blocks, config.block_size, self.device, dtype, peers=tp_workers,
            context_parallel=context_parallel,
            aux_hidden_layers=self.proposer.aux_layers if self.proposer is not None else (), **runner_options,
        )
        if self.proposer is not None:
            self.proposer.runner = self.runner
        self.sampler = Sampler(eos, self.device)
        self._seed_rng = random.Random(config.seed)  # seeds for requests that bring none
        self.output_processor = OutputProcessor(tokenizer, eos, self.max_model_len)

        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ images
    @property
    def media_placeholder_token_id(self) -> int | None:
        return self.model_config.media_placeholder_token_id

    @property
    def supports_images(self) -> bool:
        return self.vision is not None

    @property
    def images_unsupported_reason(self) -> str:
        if self.model_config.vision_config is None:
            return "this model takes text only (it has no vision tower)"
        if self.config.language_model_only:
            return "the server was started with --language-model-only, so the vision tower is not loaded"
        return "the vision tower is not loaded"

    @property
    def image_config(self) -> Any:
        """The image preprocessing rules of this model (None without a tower)."""
        if self.vision is None:
            return None
        from kserve.model.vision_preprocess import ImageProcConfig

        if self._image_config is None and self.model_dir is not None:
            self._image_config = ImageProcConfig.from_model_dir(self.model_dir)
        return self._image_config

    _image_config: Any = None

    def validate_images(self, prompt_token_ids: list[int], images: list | None) -> None:
        """Raise PromptRejected unless every image has its run of placeholders, in order (any thread may call)."""
        from kserve.engine.multimodal import placeholder_runs

        placeholder = self.media_placeholder_token_id
        runs = placeholder_runs(prompt_token_ids, placeholder) if placeholder is not None else []
        images = images or []
        if images and self.vision is None:
            raise PromptRejected(f"image input is not supported: {self.images_unsupported_reason}")
        if len(runs) != len(images) or any(length != image.num_tokens for (_, length), image in zip(runs, images)):
            raise PromptRejected(
                f"the prompt has {len(runs)} image placeholder runs of lengths {[n for _, n in runs]} for "
                f"{len(images)} images of {[image.num_tokens for image in images]} tokens"
            )

    def _encode_images(self, scheduled: list) -> None:
        """Run the tower once for every scheduled sequence whose images are not encoded yet."""
        from kserve.model.moonvit import embed_images

        pending = [item.seq for item in scheduled if item.seq.images and item.seq.image_embeds is None]
        if not pending:
            return
        images = [image for seq in pending for image in seq.images]
        pixels = torch.cat([image.pixel_values for image in images])
        embeds = embed_images(self.vision, pixels, [image.grid_thw for image in images])
        at = 0
        for seq in pending:
            count = len(seq.images)
            seq.image_embeds = torch.cat(embeds[at : at + count]).to(self.dtype)
            at += count

    @staticmethod
    def _load_vision(model: Any, model_dir: Path, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Any:
        if model.config.vision_config is None or config.language_model_only:
            return None
        from kserve.model.moonvit import load_vision_model

        return load_vision_model(model_dir, dtype=dtype, device=device)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from kserve.chat import load_tokenizer
        from kserve.model import load_model
        from kserve.model.deepseek_v3 import check_tensor_parallel

        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if config.model is None:
            from kserve.tiny import embedded_model_dir

            model_dir = Path(embedded_model_dir())
        else:
            model_dir = Path(config.model)
        tokenizer = load_tokenizer(model_dir)
        # a tensor-parallel size that cannot split the model fails here, before any worker starts
        check_tensor_parallel(ModelConfig.from_model_dir(model_dir), config.tensor_parallel_size)
        if config.tensor_parallel_size == 1:
            model = load_model(model_dir, device=device, dtype=dtype)
            vision = cls._load_vision(model, model_dir, config, device, dtype)
            return cls(model, model.config, tokenizer, config, model_dir, device, dtype, vision=vision)

        from kserve.engine.rank_launch import RANK_LAYOUT_KEY
        from kserve.engine.tp_workers import TensorParallelWorkers

        workers = TensorParallelWorkers(model_dir, config.tensor_parallel_size, device, dtype,
                                        layout=config.extra.get(RANK_LAYOUT_KEY))
        try:
            model = load_model(model_dir, device=device, dtype=dtype, parallel=workers.parallel)
            # rank 0 alone holds the tower: it encodes images and sends their embeddings with the step
            vision = cls._load_vision(model, model_dir, config, device, dtype)
            return cls(model, model.config, tokenizer, config, model_dir, device, dtype, tp_workers=workers,
                       vision=vision)
        except BaseException:
            workers.shutdown()
            raise

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        images: list | None = None,
    ) -> Request:
        """`images` (kserve.engine.multimodal.ImageInput): one per run of placeholder ids in the prompt, in order."""
        params = params if params is not None else SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        self.validate_images(prompt_token_ids, images)
        request = Request(request_id, prompt, prompt_token_ids, params)
        arrival = next(self._arrivals)
        share_prompt = params.n > 1 and self.config.enable_prefix_caching
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, index, prompt_token_ids, params, arrival)
            seq.seed = (
                completion_seed(params.seed, index) if params.seed is not None else self._seed_rng.getrandbits(63)
            )
            if params.guided is not None:
                seq.constraint = params.guided.make_constraint()
            if images:
                from kserve.engine.multimodal import placeholder_runs

                seq.images = list(images)
                seq.image_spans = placeholder_runs(prompt_token_ids, self.media_placeholder_token_id)
            if share_prompt and index > 0:
                seq.wait_for = request.seqs[0]
            self.output_processor.start(seq)
            request.seqs.append(seq)
        for seq in request.seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = request
        self.prompt_tokens_total += len(prompt_token_ids)
        return request

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raise PromptRejected if this engine cannot take the request. Reads only fixed
        configuration, so any thread may call it."""
        if not prompt_token_ids:
            raise PromptRejected("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptRejected(
                f"the prompt has {len(prompt_token_ids)} tokens, but this model's maximum context "
                f"length is {self.max_model_len} tokens, prompt and completion together"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not _is_token_id(t, vocab)]
        if bad:
            raise PromptRejected(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if params is not None and params.prompt_logprobs is not None:
            raise PromptRejected("prompt_logprobs is not supported")

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            self.output_processor.finish_aborted(seq)
            if self.proposer is not None:
                self.proposer.forget(seq.seq_id)
        self.scheduler.abort(request.seqs)
        return request

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any, and free the model and KV cache (the engine is unusable
        afterwards)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
            self.tp_workers = None
        self.runner.release()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Request]:
        """Run one scheduled step; return the requests that changed (finished ones included).

        A model step that raises changes nothing: the same work is scheduled again next step (a
        transient fault is invisible to requests). Before the last allowed retry the requests of the
        failing step are set aside and the step runs without them (or, if nothing else waits, with a
        one-token probe): if that works they were the cause and fail alone (RequestFailedError), so a
        request can never kill the engine; if it fails too, that is `max_consecutive_step_failures`
        in a row and EngineDeadError is raised (also at once for a fatal error, `errors.is_fatal`):
        the engine can serve no more. Per-request failures (a logits processor or grammar raising, a
        row with no allowed token) fail only their request and never count here.
        """
        if self.proposer is not None:
            self._propose_drafts()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return self._unblock()
        sampling = [item.seq for item in out.scheduled if item.samples]
        drafts = {item.seq.seq_id: item.draft_token_ids for item in out.scheduled if item.num_draft_tokens}
        try:
            faults = self.config.extra.get(STEP_FAULTS_KEY)  # tests and the fault harness only
            if faults is not None:
                faults.before_step()
            if self.vision is not None:
                self._encode_images(out.scheduled)
            logits = self.runner.run(out.scheduled)
            self.scheduler.finish_step(out)
        except Exception as exc:  # noqa: BLE001 -- retried; the engine dies only if it keeps failing
            return self._step_failed(out.scheduled, exc)
        self.consecutive_step_failures = 0
        changed: dict[str, Request] = {}
        if self._suspects:  # the step ran without them: they made it fail
            suspects, self._suspects = self._suspects, {}
            for request_id, error in suspects.items():
                for request in self.fail_requests({request_id}, error):
                    changed[request_id] = request
        if drafts:
            return self._verify_and_append(logits, out.scheduled, sampling, drafts, changed)
        sampled = self._sample(logits, sampling) if sampling else None
        if sampled is not None:
            append_token = self.output_processor.append_token
            requests = self.requests
            errors = sampled.errors
            for row, (seq, token_id, logprob) in enumerate(zip(sampling, sampled.token_ids, sampled.logprobs)):
                if errors and row in errors:
                    continue
                try:
                    append_token(seq, token_id, logprob)
                except Exception as exc:  # noqa: BLE001 -- user code (a constraint) raised
                    errors[row] = exc
                    continue
                changed[seq.request_id] = requests[seq.request_id]
            self.generation_tokens_total += len(sampling) - len(errors)
            self.scheduler.remove_finished(sampling)
            for row, exc in errors.items():
                for request in self.fail_requests({sampling[row].request_id}, exc):
                    changed[request.request_id] = request
        if self.proposer is not None:
            self.proposer.observe(out.scheduled, {})
        for request_id, request in changed.items():
            if request.finished:
                self.requests.pop(request_id, None)
        return list(changed.values())

    # ------------------------------------------------------------------ speculative decoding
    def _propose_drafts(self) -> None:
        """Drafts for every running sequence about to decode, never past its max_tokens or the context."""
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            if len(seq.token_ids) - seq.num_computed_tokens != 1:
                continue
            room = self.max_model_len - len(seq.token_ids) - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            if room > 0:
                seq.draft_token_ids = self.proposer.propose(seq, room)

    def _verify_and_append(self, logits: torch.Tensor, scheduled: list, sampling: list[Sequence],
                           drafts: dict[int, list[int]], changed: dict[str, Request]) -> list[Request]:
        """Sample position by position, exactly as plain decoding would, while the target agrees with the
        drafts. Logits rows come in scheduled order: one per sequence, or 1 + k for a verified one.
        Position j of every sequence still accepting is sampled in one batched call after position j - 1's
        tokens were appended (penalties, grammar, stop strings and seeds all see the same history)."""
        first_row: dict[int, int] = {}
        row = 0
        for seq in sampling:
            first_row[seq.seq_id] = row
            row += 1 + len(drafts.get(seq.seq_id, ()))
        accepted = dict.fromkeys(drafts, 0)
        active, position, appended = list(sampling), 0, 0
        while active:
            rows = torch.tensor([first_row[s.seq_id] + position for s in active], device=logits.device)
            sampled = self._sample(logits.index_select(0, rows), active)
            still = []
            for i, (seq, token_id, logprob) in enumerate(zip(active, sampled.token_ids, sampled.logprobs)):
                error = sampled.errors.get(i)
                if error is None:
                    try:
                        self.output_processor.append_token(seq, token_id, logprob)
                        appended += 1
                    except Exception as exc:  # noqa: BLE001 -- user code (a constraint) raised
                        error = exc
                if error is not None:
                    for request in self.fail_requests({seq.request_id}, error):
                        changed[request.request_id] = request
                    continue
                changed[seq.request_id] = self.requests[seq.request_id]
                proposal = drafts.get(seq.seq_id, ())
                if position < len(proposal) and token_id == proposal[position] and not seq.is_finished:
                    accepted[seq.seq_id] += 1
                    still.append(seq)
            active, position = still, position + 1
        self.generation_tokens_total += appended
        for seq in sampling:
            if seq.seq_id in drafts:
                self.spec_stats.record(len(drafts[seq.seq_id]), accepted[seq.seq_id])
                self.scheduler.accept_drafts(seq, accepted[seq.seq_id])
        self.proposer.observe(scheduled, accepted)
        self.scheduler.remove_finished(sampling)
        for request_id, request in changed.items():
            if request.finished:
                self.requests.pop(request_id, None)
        return list(changed.values())

    @property
    def max_consecutive_step_failures(self) -> int:
        return int(self.config.extra.get(MAX_FAILURES_KEY, MAX_CONSECUTIVE_STEP_FAILURES))

    def _step_failed(self, scheduled: list, exc: Exception) -> list[Request]:
        """Nothing the failed step did is kept (computed counts, prefix cache, samples); its blocks stay
        with their sequences, which `append_slots` reuses when the step is scheduled again."""
        self.consecutive_step_failures += 1
        count, limit = self.consecutive_step_failures, self.max_consecutive_step_failures
        fatal = is_fatal(exc)
        if fatal or count >= limit:
            why = "a fatal error" if fatal else f"{count} failed steps in a row"
            raise EngineDeadError(f"the engine is dead after {why}; last error: {type(exc).__name__}: {exc}") from exc
        logger.warning("model step failed (%d of %d in a row before the engine is declared dead); retrying: %s: %s",
                       count, limit, type(exc).__name__, exc)
        if count == limit - 1:
            self._set_aside({item.seq.request_id for item in scheduled}, exc, count)
        return []

    def _set_aside(self, request_ids: set[str], exc: Exception, count: int) -> None:
        """Take these requests out of scheduling; the next step tells whether they are the cause."""
        error = RequestFailedError(f"the model step failed {count} times in a row while running this request, "
                                   f"and ran without it: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        if self._suspects is None:
            self._suspects = {}
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request_id.startswith(PROBE_PREFIX):
                self.scheduler.abort(request.seqs)  # frees its blocks; it stays in self.requests
                self._suspects[request_id] = error
        if not self.scheduler.has_work():
            probe = f"{PROBE_PREFIX}{next(self._arrivals)}"
            self.add_request(probe, [0], SamplingParams(temperature=0.0, max_tokens=1))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample the batch; if that raises, sample row by row so only the failing rows fail."""
        try:
            return self.sampler.sample(logits, seqs)
        except Exception as exc:  # noqa: BLE001 -- isolated below, on this rare path only
            if len(seqs) == 1:
                return SamplerOutput([0], [None], {0: exc})
        token_ids: list[int] = []
        logprobs: list = []
        errors: dict[int, Exception] = {}
        for row, seq in enumerate(seqs):
            try:
                one = self.sampler.sample(logits[row : row + 1], [seq])
            except Exception as exc:  # noqa: BLE001 -- fails only this row's request
                one = SamplerOutput([0], [None], {0: exc})
            token_ids.append(one.token_ids[0])
            logprobs.append(one.logprobs[0])
            if 0 in one.errors:
                errors[row] = one.errors[0]
        return SamplerOutput(token_ids, logprobs, errors)

    def _unblock(self) -> list[Request]:
        """Nothing could be scheduled: finish a waiting head that can never fit in the cache."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        request = self.requests[seq.request_id]
        self.abort_request(seq.request_id)
        for s in request.seqs:
            if s.finish_reason == "abort":
                s.finish_reason = "length"
        return [request]

    def fail_requests(self, request_ids: set[str], exc: Exception) -> list[Request]:
        """Abort these requests, recording `exc` as the reason; returns them."""
        failed = []
        for request_id in request_ids:
            request = self.abort_request(request_id)
            if request is not None:
                request.error = exc
                failed.append(request)
        return failed

    # ------------------------------------------------------------------ metrics
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_usage=bm.num_used_blocks / bm.num_blocks,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            prefix_cache_miss_tokens=bm.prefix_miss_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions=self.scheduler.num_preemptions,
            spec_decode=self.spec_stats,
        )
