"""The engine loop: schedule -> run -> postprocess, one step at a time. No tensor code here."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from loraserve.config import LATENCY_BUCKETS, CacheConfig, EngineConfig
from loraserve.engine.batch import ScheduledBatch
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.fair_share import UNKEYED, Tenant
from loraserve.engine.grammar import CompiledGrammar, GrammarCompiler
from loraserve.engine.mixes import Mixes
from loraserve.engine.model_runner import ModelRunner
from loraserve.engine.outputs import STEP_FAILED, CompletionOutput, RequestError, RequestOutput, RequestTimings
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.sequence import Request, Sequence
from loraserve.engine.speculative import NgramProposer
from loraserve.engine.stats import EngineStats, LoadTimes, ResidentAdapter, speculation_stats
from loraserve.engine.step_isolation import run_isolating_failures
from loraserve.engine.stop_checker import StopChecker
from loraserve.errors import AdapterError, InvalidRequestError, UnknownAdapterError
from loraserve.lora.adapter import LoraAdapter, read_adapter
from loraserve.lora.adapter_config import AdapterConfig
from loraserve.lora.adapter_sandbox import check_untrusted_adapter
from loraserve.lora.adapter_state import AdapterSource, AdapterState
from loraserve.lora.dora import with_dora_scales
from loraserve.lora.manager import AdapterManager
from loraserve.lora.mix_spec import MixSpec
from loraserve.lora.slots import AdapterSlots, smallest_block_size
from loraserve.memory.page_allocator import PageUse
from loraserve.memory.pool import MemoryPool, pool_pages
from loraserve.models import LoadedModel, load_model
from loraserve.models.dtypes import largest_finite
from loraserve.models.platform import GraphSettings

logger = logging.getLogger(__name__)


class LLMEngine:
    """Accepts requests, steps the batch, reports each request's progress."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model)
        model_window = self.loaded.model.spec.max_positions
        self.max_model_len = min(config.scheduler.max_model_len or model_window, model_window)
        max_num_seqs = config.scheduler.max_num_seqs
        graphs = None if config.model.enforce_eager else GraphSettings(max_num_seqs, self.max_model_len)
        spec, dtype, device = self.loaded.model.spec, self.loaded.dtype, self.loaded.device
        block_size = config.cache.block_size
        if block_size == CacheConfig.block_size:  # the default: as large as this model's adapter rows need
            block_size = smallest_block_size(spec, block_size)
            if block_size != config.cache.block_size:
                logger.info("blocks of %d tokens: a page must hold an adapter's widest row", block_size)
        num_pages = pool_pages(replace(config.cache, block_size=block_size), spec, dtype, device)
        self.pool = MemoryPool(spec, block_size, num_pages, dtype, device)
        slots = AdapterSlots(spec, config.lora.max_loras, config.lora.max_lora_rank, self.pool)
        self.model_runner = ModelRunner(
            self.loaded, self.pool, slots, seed=config.seed, cache_dir=config.model.cache_dir, graphs=graphs
        )
        self.stop_checker = StopChecker(self.tokenizer, self.loaded.eos_token_ids, self.max_model_len)
        self.max_prompt_chars = self.max_model_len * max(map(len, self.tokenizer.get_vocab()))
        self.adapters = AdapterManager(slots, self.read_source, config.lora.host_cache_bytes)
        self.mixes = Mixes(self.adapters, config.lora)
        self.block_manager = BlockManager(
            self.pool.pages, block_size, config.cache.prefix_caching,
            reclaim=self.adapters.reclaim_pages,  # idle adapters give their pages to KV (make_room)
            window=spec.window_of_every_layer,  # KV behind it goes back to the pool
        )  # fmt: skip
        speculation = config.speculation
        proposer = None
        if speculation.speculative == "ngram":
            proposer = NgramProposer(
                speculation.speculative_tokens, speculation.ngram_min, speculation.ngram_max,
                speculation.speculative_cost_check,
            )  # fmt: skip
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, self.stop_checker, self.adapters, proposer=proposer
        )
        self._requests: dict[str, Request] = {}
        self.num_failed_steps = 0  # steps in which some row raised (step_isolation.py)
        self.num_failed_requests = 0  # requests ended because scheduling or computing them raised

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.loaded.tokenizer

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Made at the first structured request (it indexes the vocabulary: half a second)."""
        return GrammarCompiler(self.tokenizer, self.loaded.model.spec.vocab_size, self.loaded.eos_token_ids)

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's grammar, built or from the cache; InvalidRequestError naming the field it came from.
        Touches no engine state: call it from any thread (requests build theirs before taking the lock)."""
        if params.structured_output is None:
            return None
        if params.ignore_eos:
            raise InvalidRequestError("ignore_eos", "cannot be set with structured output: the output ends with it")
        return self.grammars.compile(params.structured_output)

    def read_adapter(self, path: str | Path, trusted: bool = True) -> LoraAdapter:
        """Read and validate a PEFT adapter directory against this base model; raises AdapterError.

        Files not trusted yet (uploads) are parsed in a child process first (adapter_sandbox.py). A DoRA
        adapter comes with its scale vectors (lora/dora.py).
        Touches no engine state: any thread may call it, beside a running step.
        """
        path, spec, max_rank = Path(path), self.loaded.model.spec, self.config.lora.max_lora_rank
        config = None if trusted else self.check_adapter(path)
        base_names = frozenset({self.loaded.name, self.loaded.model_dir.name})
        adapter = read_adapter(path, spec, max_rank, base_names, largest_finite(self.loaded.dtype), config)
        return with_dora_scales(adapter, self.loaded.model)  # from the weights only: once, here

    def check_adapter(self, path: Path) -> AdapterConfig:
        """Check the PEFT directory against this base model in a child process, reading nothing into this one
        (adapter_sandbox.py); its parsed config, or AdapterError naming why not. Blocks only the calling thread."""
        spec, max_rank = self.loaded.model.spec, self.config.lora.max_lora_rank
        return check_untrusted_adapter(path, spec, max_rank, largest_finite(self.loaded.dtype))

    def read_source(self, source: AdapterSource) -> LoraAdapter:
        """A registered adapter's weights: its directory read, or a mix made from its parts."""
        if source.mix is not None:
            return self.mixes.read(source)
        assert source.path is not None
        return self.read_adapter(source.path)

    def mix_adapters(self, spec: MixSpec) -> str:
        """The adapter name a mix is served under, made and registered on its first request (merge.py);
        InvalidRequestError (400) or UnknownAdapterError (404) name the merged_adapters field at fault."""
        prepared = self.mixes.prepare(spec)
        self.mixes.serve(prepared)
        return prepared.name

    def add_adapter(self, name: str, path: str | Path) -> LoraAdapter:
        """Read, validate and serve the PEFT adapter in `path` under `name` (a slot at its first request);
        nothing changes on error."""
        adapter = self.read_adapter(path)
        self.register_adapter(name, Path(path), adapter.sha256, adapter)
        return adapter

    def register_adapter(self, name: str, path: Path, sha256: str | None, adapter: LoraAdapter | None = None) -> None:
        """Serve a stored adapter, read from `path` only when a request needs it (or now: `adapter`)."""
        if not name or "/" in name or name == self.loaded.name:
            raise AdapterError("name", f"{name!r} is not a valid adapter name")
        self.adapters.register(name, AdapterSource(path, sha256), adapter)

    def replace_adapter(self, name: str, path: Path, sha256: str | None, adapter: LoraAdapter | None = None) -> None:
        """New weights under a served name: requests that have started finish on the old version (set aside under an
        alias until they end), the others and every new one get these. The prefix cache keys on content, so no
        block of the old version is found for the new one. Raises UnknownAdapterError."""
        alias = self.adapters.set_aside(name)
        for request in self._requests.values():
            if request.adapter == name and request.first_scheduled_time is not None:
                request.adapter = alias
        self.mixes.retire_mixing(name)
        self.adapters.register(name, AdapterSource(path, sha256), adapter)
        self._forget_retired_adapters()

    def remove_adapter(self, name: str) -> None:
        """Stop accepting requests for the adapter; the ones already queued or running finish with it."""
        self.adapters.drain(name)
        self.mixes.retire_mixing(name)
        self._forget_retired_adapters()

    @property
    def adapter_names(self) -> list[str]:
        return [r.name for r in self.adapters.records() if not r.draining and r.source.mix is None]

    def tokenize(self, text: str) -> list[int]:
        """`tokenizer(text)`'s ids; a text that no tokenization fits in the context window is refused first:
        a token covers at most `longest token` characters, so a text longer than the window times that is
        refused without the work (an 8 MiB body would take seconds to tokenize)."""
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                "prompt",
                f"is {len(text)} characters: more tokens than the context window of {self.max_model_len} holds",
            )
        return list(self.tokenizer(text)["input_ids"])

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        adapter: str | None = None,
        text: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        tenant: Tenant = UNKEYED,
        is_streamed: bool = True,
    ) -> Request:
        """Queue a prompt (text, tokenized as `tokenizer(text)` does, or token ids), with an adapter or none.

        `text`: the text that token ids were tokenized from (`tokenize`), reported with the outputs.
        `priority`: lower first. `timeout`: seconds after which it is dropped if it has not started.
        `tenant`: whose fair share of the engine serves it (fair_share.py). `is_streamed`: whether its client
        sees tokens as they come or only the whole answer, which decides the SLO target that admits it.
        OverloadedError when SLO targets are set and it would miss its target (admission.py).
        """
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        record = None if adapter is None else self.adapters.record(adapter)
        if adapter is not None and (record is None or record.draining):
            raise UnknownAdapterError(adapter)
        text = prompt if isinstance(prompt, str) else text
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_request(token_ids, params)
        grammar = self.compile_grammar(params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=arrival_time,
            adapter=adapter,
            priority=priority,
            tenant=tenant,
            deadline=None if timeout is None else arrival_time + timeout,
            is_streamed=is_streamed,
            grammar=grammar,
        )
        self.scheduler.add_request(request)  # first: a request it refuses (overloaded) must leave nothing here
        self._requests[request_id] = request
        if adapter is not None:
            self.adapters.prefetch(adapter)
        return request

    def abort_request(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request)
            self._forget_retired_adapters()

    def stats(self) -> EngineStats:
        adapters, records, history = self.adapters, self.adapters.records(), self.adapters.stats
        device = [
            ResidentAdapter(r.name, r.slot, r.rank, r.num_bytes, adapters.pages_of(r.name), r.pinned)
            for r in sorted(records, key=lambda r: r.slot)
            if r.state is AdapterState.ON_DEVICE
        ]
        pool = self.pool
        kv_pages, adapter_pages = pool.pages.num_used(PageUse.KV), pool.pages.num_used(PageUse.ADAPTER)
        kv_capacity = pool.num_pages - adapter_pages  # idle adapters would still be evicted for KV
        return EngineStats(
            pool_pages=pool.num_pages,
            page_bytes=pool.page_bytes,
            kv_pages=kv_pages,
            adapter_pages=adapter_pages,
            free_pages=pool.num_pages - kv_pages - adapter_pages,
            kv_capacity_pages=kv_capacity,
            block_size=self.block_manager.block_size,
            adapter_slots_total=adapters.slots.num_slots,
            adapter_slots_used=len(device),
            device_adapters=device,
            host_adapters=[r.name for r in records if r.state is AdapterState.ON_HOST],
            host_cache_bytes=adapters.host.num_bytes,
            host_cache_capacity_bytes=adapters.host.capacity_bytes,
            adapter_disk_reads=history.disk_reads,
            adapter_loads=history.loads,
            adapter_evictions=history.evictions,
            adapter_load_seconds_total=history.load_seconds_total,
            adapter_load_seconds=LoadTimes(LATENCY_BUCKETS, tuple(history.load_counts), history.load_seconds_total),
            running_sequences=len(self.scheduler.running),
            waiting_sequences=len(self.scheduler.waiting),
            running_requests=len({seq.request for seq in self.scheduler.running}),
            waiting_requests=len({seq.request for seq in self.scheduler.waiting}),
            running_adapters=_adapters_of(self.scheduler.running),
            waiting_adapters=_adapters_of(self.scheduler.waiting),
            kv_cache_usage=kv_pages / max(1, kv_capacity),
            preemptions=self.scheduler.num_preemptions,
            released_behind_window=self.block_manager.num_released_behind_window,
            prefix_cache_blocks=self.block_manager.num_cached_blocks,
            prefix_cache_queried_tokens=self.scheduler.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            failed_steps=self.num_failed_steps,
            failed_requests=self.num_failed_requests,
            running_cap=self.scheduler.admission.running_cap,
            admitted_requests=self.scheduler.admission.num_admitted,
            refused_overloaded=self.scheduler.admission.num_refused + self.scheduler.admission.num_refused_late,
            refused_late=self.scheduler.admission.num_refused_late,
            dropped_timed_out=self.scheduler.admission.num_timed_out,
            predicted_queue_seconds=self.scheduler.predicted_queue_seconds(),
            **speculation_stats(self.scheduler.speculation),
        )

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the next prompts are computed in full (benchmarks, after a warm-up)."""
        self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Stop the adapter loader and token mask threads."""
        self.adapters.close()
        self.model_runner.token_masks.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration of the batch; returns the requests that got tokens (finished ones last time)."""
        batch = self.scheduler.schedule()
        touched = [] if batch.is_empty else self._run(batch)
        failed = self.scheduler.take_failed()
        self.num_failed_requests += sum(r.error is not None and r.error.code == STEP_FAILED for r in failed)
        touched = failed + touched
        if batch.is_empty and not touched and self.scheduler.has_unfinished():
            self.adapters.wait_for_load(timeout=0.05)  # nothing can run before an adapter arrives
        results = [self.request_output(request) for request in touched]
        finished = [request for request in touched if request.is_finished]
        for request in finished:
            del self._requests[request.request_id]
        if finished:
            self._forget_retired_adapters()
        return results

    def _run(self, batch: ScheduledBatch) -> list[Request]:
        """Compute the step; a row that raises ends its own request with an error, and the rest go on."""
        self.model_runner.copy_blocks(batch.block_copies)
        started = time.perf_counter()
        ran = run_isolating_failures(self.model_runner.run, batch, self.model_runner.is_unrecoverable)
        if ran.failures:
            self.num_failed_steps += 1
        else:  # what admission predicts with (step_costs.py)
            drafts = sum(len(item.drafts) for item in batch.prefills)
            prompt_tokens = sum(item.num_new_tokens for item in batch.prefills if not item.drafts)
            seconds = time.perf_counter() - started
            self.scheduler.costs.observe(len(batch.scheduled), prompt_tokens, seconds, drafts)
        for failure in ran.failures:
            request = failure.item.seq.request
            logger.error("request %r failed in a step: %r", request.request_id, failure.error, exc_info=failure.error)
            self.scheduler.fail_request(request, RequestError(STEP_FAILED, f"computing it failed: {failure.error!r}"))
        return self.scheduler.postprocess(ran.batch, ran.output)

    def _forget_retired_adapters(self) -> None:
        if draining := self.adapters.draining():
            in_use = {request.adapter for request in self._requests.values()}
            for name in draining:
                if name not in in_use:
                    self.adapters.unregister(name)

    def request_output(self, request: Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index,
                text=self.stop_checker.text(seq),
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
                stop_reason=seq.stop_reason,
            )
            for seq in sorted(request.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.is_finished,
            timings=_timings(request),
            error=request.error,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """What only the engine knows: the vocabulary, the context window, the KV pool's size, its limits."""
        limits = self.config.scheduler
        for field, value, limit, what in (
            ("n", params.n, limits.max_n, "(--max-n)"),
            ("logprobs", params.logprobs or 0, limits.max_logprobs, "(--max-logprobs)"),
            ("stop", len(params.stop), limits.max_stop, "stop strings (--max-stop)"),
        ):
            if value > limit:
                raise InvalidRequestError(field, f"must be at most {limit} {what}, got {value}")
        if not token_ids:
            raise InvalidRequestError("prompt", "is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"is {len(token_ids)} tokens; the context window is {self.max_model_len} tokens, "
                "leaving no room for a new token",
            )
        vocab = self.loaded.model.spec.vocab_size
        for field, ids in (
            ("prompt", token_ids), ("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)
        ):  # fmt: skip
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(field, f"token ids must be in [0, {vocab})")
        # The n completions share the prompt's full blocks; each needs the rest of its own.
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        shared = len(token_ids) // self.block_manager.block_size
        needed = shared + params.n * (self.block_manager.blocks_for_tokens(longest) - shared)
        if needed > self.block_manager.num_blocks:
            field = "max_tokens" if params.n == 1 else "n"
            raise InvalidRequestError(
                field,
                f"n = {params.n} completions of prompt + max_tokens = {longest} tokens need {needed} KV blocks; "
                f"the cache has {self.block_manager.num_blocks} of {self.block_manager.block_size} tokens: "
                "lower n or max_tokens, or raise --pool-memory",
            )


def _adapters_of(seqs: Iterable[Sequence]) -> list[str]:
    """The distinct adapters these sequences use, in order of first use."""
    return list(dict.fromkeys(seq.request.adapter for seq in seqs if seq.request.adapter is not None))


def _timings(request: Request) -> RequestTimings:
    arrival = request.arrival_time
    first = min((seq.token_times[0] for seq in request.seqs if seq.token_times), default=None)
    # Latencies once, when the request finishes: listing them at every step of every running
    # request would cost O(tokens) per token.
    main_times = request.seqs[0].token_times if request.is_finished else []
    return RequestTimings(
        queue_time=None if request.first_scheduled_time is None else request.first_scheduled_time - arrival,
        ttft=None if first is None else first - arrival,
        inter_token_latencies=[b - a for a, b in itertools.pairwise(main_times)],
        e2e=None if request.finished_time is None else request.finished_time - arrival,
        draft_tokens=request.num_draft_tokens,
        accepted_draft_tokens=request.num_accepted_draft_tokens,
    )
