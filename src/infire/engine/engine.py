"""LLMEngine: the synchronous step loop that ties scheduler, block pool and runner together.

`add_request` queues; each `step()` schedules a batch, runs one forward, appends the
sampled tokens, detokenizes, checks stop conditions and frees the blocks of finished
sequences, then reports a RequestDelta (what changed, not the whole output) for every
request that changed. In a disaggregated role (disagg/transfer.py) a prefill engine
ends each request after its first token and leases its KV blocks out, and a decode
engine starts each request from a prefill engine's first token and pulls the KV. The
engine clients (in a thread, or in the engine-core process), the offline API (LLM) and
the CLI drive this class.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from infire.config import EngineConfig, resolve_dtype
from infire.disagg.transfer import KVTransfer, first_token_fields, first_token_output, sign
from infire.engine.executor import MultiprocExecutor, UniprocExecutor
from infire.engine.kv_cache import BlockManager
from infire.engine.messages import (
    ChoiceDelta,
    EngineStats,
    GenerateRequest,
    ModelInfo,
    RequestDelta,
)
from infire.engine.request import Sequence
from infire.engine.runner import ModelRunner, StepResult
from infire.engine.scheduler import Scheduler, SchedulerOutput
from infire.engine.stop import append_token
from infire.engine.structured import GrammarCache
from infire.engine.validation import check_params, check_prompt
from infire.errors import InvalidRequestError, UnsupportedModelError
from infire.kernels import cpu_forward
from infire.models.loader import gguf_blocks, load_model
from infire.outputs import RequestMetrics
from infire.sampling_params import SamplingParams
from infire.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class StepCounters:
    """Counters since the engine started (snapshotted into EngineStats for the metrics)."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_finished_requests: int = 0


class LLMEngine:
    """Generates for many requests at once; not thread-safe (one caller drives step())."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        sharded = config.parallel.world_size > 1  # TP / PP ranks run the PyTorch path
        fused_bf16 = (
            config.cpu_kernels and config.device == "cpu" and cpu_forward.available()
            and not sharded
        )  # fmt: skip
        self.dtype = resolve_dtype(config.dtype, config.device, fused_bf16)
        if sharded:
            self.executor: UniprocExecutor | MultiprocExecutor = MultiprocExecutor(
                config, self.dtype
            )
            loaded = self.executor.loaded
        else:
            if config.parallel.threads_per_rank:  # e.g. one thread each for a prefill and
                torch.set_num_threads(config.parallel.threads_per_rank)  # a decode worker
            loaded = load_model(config.model, self.dtype, config.device)
            runner = ModelRunner(
                loaded.config, loaded.weights, config.cache, self.dtype, config.device,
                config.seed, config.cpu_kernels, palette=loaded.palette,
                blocks=gguf_blocks(loaded, config.quantization), scheduler_config=config.scheduler,
                enforce_eager=config.enforce_eager,
            )  # fmt: skip
            self.executor = UniprocExecutor(runner)
        self.runner = self.executor.runner  # rank 0's
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        del loaded
        context = self.model_config.max_position_embeddings
        self.max_model_len = min(config.scheduler.max_model_len or context, context)
        runner = self.runner
        self.block_manager = BlockManager(
            runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            list(zip(runner.windows, runner.group_num_blocks[1:], strict=True)),
        )  # fmt: skip
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, list[Sequence]] = {}
        self.stats = StepCounters()
        self._next_seq_id = 0
        # Pipeline micro-batches sent but not back yet, oldest first.
        self._in_flight: deque[tuple[SchedulerOutput, object]] = deque()
        self.transfer = self._make_transfer()
        self._to_pull: deque[Sequence] = deque()  # decode: first token in, KV not yet
        self._pulls: dict[int, tuple[Sequence, object]] = {}  # seq_id -> (seq, Pull)
        self._changed: dict[str, None] = {}  # requests changed outside a step
        self.model_info = ModelInfo(
            name=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            num_kv_tokens=self.runner.num_blocks * config.cache.block_size,
            block_size=config.cache.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
            fused_status=self.runner.fused_status,
            chat_template=self.tokenizer.chat_template,
            architecture=self.model_config.architecture,
            kv_bytes_per_token=self.runner.kv_bytes_per_token,
            kv_role=config.disagg.role,
            kv_layout=self.transfer.signature if self.transfer else "",
        )
        # Structured outputs: grammars compile in a thread of their own, off the step loop;
        # a request waits in `_compiling` until its grammar is ready.
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size)
        self._compiling: dict[str, tuple[Future, dict]] = {}  # and the request's kv_transfer
        self._compiler: ThreadPoolExecutor | None = None

    def _make_transfer(self) -> KVTransfer | None:
        """The KV connector and leases of a prefill or decode engine (None for `both`)."""
        disagg = self.config.disagg
        if disagg.role == "both":
            return None
        from infire.disagg.connector import make_connector
        from infire.disagg.transfer import PoolLayout

        if self.runner.device.type != "cpu":
            raise UnsupportedModelError(
                f"--role {disagg.role} moves KV blocks of CPU pools only for now"
            )
        if self.config.parallel.world_size > 1:
            raise UnsupportedModelError(
                f"--role {disagg.role} runs one rank only for now: KV transfer between "
                "tensor/pipeline-parallel engines is not implemented"
            )
        if self.runner.windows:
            raise UnsupportedModelError(
                f"--role {disagg.role}: {self.model_config.architecture} has sliding-window "
                "KV groups, whose transfer is not implemented"
            )
        layout = PoolLayout.of(self.runner.kv_caches, self.runner.num_blocks)
        dtype = str(self.dtype).removeprefix("torch.")
        connector = make_connector(disagg.connector, disagg.kv_host, disagg.kv_protocol)
        return KVTransfer(
            disagg.role, connector, layout, self.block_manager.pool,
            layout.signature(self.config.cache.block_size, dtype), disagg.lease_seconds,
        )  # fmt: skip

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the vocabulary and context."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, self.model_info)
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Validate and queue a request; raises InvalidRequestError without side effects.

        `prompt_token_ids` are taken as already checked (by an EngineClient's edge)."""
        params = params or SamplingParams()
        if prompt_token_ids is None:
            check_params(params, self.model_info)
            prompt_token_ids = self.tokenize_prompt(prompt)
            if params.structured_output is not None:
                self.grammars.check(params.structured_output)  # a bad grammar raises now
        self.add(GenerateRequest(request_id, prompt_token_ids, params))

    def add(self, request: GenerateRequest) -> None:
        """Queue a validated request (one sequence per sample of n)."""
        request_id, ids, params = request.request_id, request.prompt_token_ids, request.params
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        metrics = RequestMetrics(arrival_time=time.monotonic())
        seqs = [self._new_sequence(request_id, i, ids, params, metrics) for i in range(params.n)]
        self.requests[request_id] = seqs
        self.stats.num_prompt_tokens += len(ids) * params.n
        if params.structured_output is not None:
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="infire-grammar")
            compiled = self._compiler.submit(self.grammars.check, params.structured_output)
            self._compiling[request_id] = (compiled, request.kv_transfer or {})
            return
        self._start(seqs, request.kv_transfer or {})

    def _start(self, seqs: list[Sequence], kv_transfer: dict) -> None:
        """Schedule a request's sequences (on a decode engine: its first token, then the
        pull of its KV)."""
        role = self.config.disagg.role
        if role == "decode":
            self._start_decode(seqs[0], kv_transfer)
            return
        for seq in seqs:
            if role == "prefill":
                seq.kv_handle = {}  # filled in when its first token is sampled
            self.scheduler.add(seq)

    def _start_decode(self, seq: Sequence, handle: dict) -> None:
        """A request whose prompt a prefill engine ran: append its first token now (it is
        streamed at once), then queue the pull of the KV blocks it lacks."""
        params = seq.params
        if seq.generator is not None and params.temperature > 0:
            # the prefill engine drew this token's noise from the same seed: draw it here too
            noise = torch.empty(self.model_config.vocab_size, device=self.runner.device)
            noise.exponential_(generator=seq.generator)
        append_token(seq, first_token_output(handle["first"]), 0, self.tokenizer,
                     self.max_model_len)  # fmt: skip
        self.stats.num_generation_tokens += 1
        seq.metrics.first_scheduled_time = seq.metrics.first_token_time = time.monotonic()
        seq.kv_handle = dict(handle)  # marked as pulled here: the caller's stays as it was
        self._changed[seq.request_id] = None
        if not seq.finished and not handle.get("lease"):
            seq.error = ("the prefill worker leased no KV blocks, yet its first token did not "
                         "end the request")  # fmt: skip
            seq.finish("abort")
        if seq.finished:
            self._finish(seq)
        else:
            self._to_pull.append(seq)

    def _new_sequence(
        self,
        request_id: str,
        index: int,
        ids: list[int],
        params: SamplingParams,
        metrics: RequestMetrics,
    ) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.runner.device).manual_seed(params.seed + index)
        self._next_seq_id += 1
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        return Sequence(
            seq_id=self._next_seq_id, request_id=request_id, index=index,
            prompt_token_ids=ids, params=params, detokenizer=detokenizer,
            metrics=metrics, generator=generator,
        )  # fmt: skip

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Stop a request now and free its KV blocks; None if it is unknown or done."""
        if self.transfer is not None:  # a prefill request aborted after it was leased
            self.transfer.release_request(request_id)
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        for seq in seqs:
            if not seq.finished:
                seq.finish("abort")
                self._finish(seq)
        return self._final_delta(request_id)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.executor.release([seq.seq_id])

    def shutdown(self) -> None:
        """Stop the worker ranks, if any (idempotent); micro-batches in flight are drained
        first, so that no rank is left waiting to hand over its tokens."""
        try:
            while self._in_flight:
                self.executor.wait(self._in_flight.popleft()[1])
        except RuntimeError:
            pass  # a rank is gone: nothing to drain
        self.executor.shutdown()
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
        if self.transfer is not None:
            self.transfer.close()

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running (or a micro-batch or a KV pull is
        in flight)."""
        return bool(self.requests or self._in_flight or self._pulls)

    def release_kv(self, lease_id: str) -> bool:
        """A decode engine is done with a lease: free its blocks (False: unknown)."""
        return self.transfer is not None and self.transfer.release(lease_id)

    def idle_timeout(self) -> float | None:
        """How long the loop may wait for a command with nothing to step: until the next
        lease expires (None: forever). Expired leases are freed here."""
        if self.transfer is None:
            return None
        if self.transfer.expire():
            return 0.0  # go round once more, so that the freed blocks show in the stats
        return self.transfer.next_expiry()

    def stats_snapshot(self) -> EngineStats:
        """Queues, KV use and counters now."""
        c, sched = self.stats, self.scheduler
        to_compute = sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                         for s in (*sched.waiting, *sched.running))  # fmt: skip
        transfer = (0, 0) if self.transfer is None else (
            len(self.transfer.leases), self.transfer.leased_blocks)  # fmt: skip
        t = self.transfer.counters if self.transfer is not None else None
        counters = () if t is None else (
            t.leases_granted, t.leases_released, t.leases_expired, t.pulls, t.pulls_failed,
            t.blocks_pulled, t.blocks_reused, t.bytes_pulled, t.pull_seconds,
        )  # fmt: skip
        return EngineStats(
            len(sched.running), len(sched.waiting) + len(self._to_pull) + len(self._pulls),
            self.block_manager.usage, c.num_steps, c.num_prompt_tokens,
            c.num_computed_prompt_tokens, c.num_generation_tokens, c.prefix_cache_queries,
            c.prefix_cache_hits, c.num_preemptions, c.num_finished_requests, to_compute,
            self.block_manager.num_free_blocks, self.block_manager.num_blocks, *transfer,
            len(self._to_pull) + len(self._pulls), *counters,
        )  # fmt: skip

    def step(self) -> list[RequestDelta]:
        """Run one engine iteration; returns what changed, per request.

        With pipeline parallelism up to `pipeline_depth` micro-batches (of disjoint
        sequences) are in flight: it fills the pipeline, then completes the oldest."""
        if self._compiling:
            self._admit_compiled()
        early = self._deltas(self._advance_pulls()) if self.transfer or self._changed else []
        return early + self._step()

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar is compiled (each sequence gets its own
        matcher); fail those whose grammar would not compile. With nothing else to run,
        wait a little for a compile rather than spin."""
        runnable = self.scheduler.waiting or self.scheduler.running or self._in_flight
        if not runnable:
            futures = [future for future, _ in self._compiling.values()]
            wait(futures, timeout=0.005, return_when=FIRST_COMPLETED)
        for request_id, (future, kv_transfer) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            seqs = self.requests.get(request_id)
            if seqs is None or all(seq.finished for seq in seqs):
                continue  # aborted while it compiled
            error = future.exception()
            if error is None:
                for seq in seqs:
                    seq.matcher = self.grammars.matcher(seq.params.structured_output)
                self._start(seqs, kv_transfer)
                continue
            for seq in seqs:
                seq.error = str(error)
                seq.invalid = isinstance(error, InvalidRequestError)
                seq.finish("abort")
                self._finish(seq)
            self._changed[request_id] = None

    def _step(self) -> list[RequestDelta]:
        while len(self._in_flight) < self.executor.pipeline_depth:
            busy = frozenset(i.seq.seq_id for b, _ in self._in_flight for i in b.scheduled)
            batch = self.scheduler.schedule(busy)
            self.executor.preempted(batch.preempted)
            if not batch.scheduled:
                if self._in_flight and not (batch.finished or batch.preempted):
                    break
                return self._deltas(self._update(batch, StepResult([], None)))
            handle = self.executor.submit(batch.scheduled)
            self._in_flight.append((batch, handle))
        batch, handle = self._in_flight.popleft()
        return self._deltas(self._update(batch, self.executor.wait(handle)))

    def _advance_pulls(self) -> dict[str, None]:
        """Decode role: start the pulls that fit (blocks, max_num_seqs) in arrival order,
        and admit the sequences whose pull ended well; a failed pull fails its request.
        Returns the requests that changed (with those changed outside a step)."""
        changed, self._changed = self._changed, {}
        limit, bs = self.config.scheduler.max_num_seqs, self.block_manager.block_size
        while self._to_pull:
            seq = self._to_pull[0]
            if seq.finished:  # aborted while queued
                self._to_pull.popleft()
                continue
            if len(self.scheduler.running) + len(self._pulls) >= limit:
                break
            prompt = seq.num_prompt_tokens
            cached = self.block_manager.acquire_cached_prefix(seq)  # full prompt blocks
            if not self.block_manager.allocate(seq, prompt):
                self.block_manager.free(seq)
                if self.scheduler.running or self._pulls:
                    break  # blocks come back as running sequences finish
                self._to_pull.popleft()  # nothing will ever free enough: as the scheduler
                seq.finish("length")  # does with a prompt the pool cannot hold
                self._finish(seq)
                changed[seq.request_id] = None
                continue
            self._to_pull.popleft()
            seq.num_cached_tokens = cached
            self.stats.prefix_cache_queries += prompt
            self.stats.prefix_cache_hits += cached
            pull = self.transfer.start_pull(seq.request_id, seq.kv_handle, seq.block_table,
                                            cached // bs)  # fmt: skip
            if pull is None:  # the prefix cache held every block: the lease can go now
                seq.kv_handle["pulled"] = True
                changed[seq.request_id] = None
                self._admit_pulled(seq)
            else:
                self._pulls[seq.seq_id] = (seq, pull)
        for seq_id, (seq, pull) in list(self._pulls.items()):
            if not pull.transfer.done:
                continue
            del self._pulls[seq_id]
            error = self.transfer.finish_pull(pull)
            if seq.finished:
                continue  # aborted during the pull: its blocks went back as it ended
            seq.kv_handle["pulled"] = True
            changed[seq.request_id] = None
            if error is None:
                self._admit_pulled(seq)
            else:
                seq.error = error
                seq.finish("abort")
                self._finish(seq)
        if self._pulls and not self.scheduler.has_unfinished():
            next(iter(self._pulls.values()))[1].transfer.wait(0.005)  # no busy loop
        return changed

    def _admit_pulled(self, seq: Sequence) -> None:
        """The prompt's KV is all in seq's blocks: decode from the first token on."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_full_blocks(seq)
        self.scheduler.admit_running(seq)

    def _deltas(self, changed: dict[str, None]) -> list[RequestDelta]:
        deltas = []
        for request_id in changed:
            if request_id not in self.requests:
                continue  # aborted while its micro-batch was in flight: its delta is out
            done = self._done(request_id)
            delta = self._final_delta(request_id) if done else self._delta(request_id)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _update(self, batch: SchedulerOutput, result: StepResult) -> dict[str, None]:
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions += len(batch.preempted)
        stats.prefix_cache_queries += batch.num_queried_tokens
        stats.prefix_cache_hits += batch.num_cached_tokens
        changed: dict[str, None] = {}
        for item in batch.scheduled:
            seq = item.seq
            if seq.finished:
                continue  # aborted while in flight: its blocks are gone already
            start = seq.num_computed_tokens
            stats.num_computed_prompt_tokens += max(
                0, min(seq.num_prompt_tokens - start, item.num_new_tokens)
            )
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
        now = time.monotonic()
        for i, seq in enumerate(result.sampled_seqs):
            if seq.finished:
                continue
            append_token(seq, result.output, i, self.tokenizer, self.max_model_len)
            stats.num_generation_tokens += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if seq.kv_handle == {}:  # prefill role: its first token
                self._hand_over(seq, first_token_fields(result.output, i))
            if seq.finished:
                self._finish(seq)
            changed[seq.request_id] = None
        for seq in batch.finished:  # could never fit the pool
            self.executor.release([seq.seq_id])
            changed[seq.request_id] = None
        return changed

    def _hand_over(self, seq: Sequence, first: dict) -> None:
        """Prefill role: end seq after its first token; unless that token ended it, lease
        its prompt blocks to a decode engine. The handle goes out on its last delta."""
        handle: dict = {"first": first}
        if not seq.finished:
            blocks = seq.block_table[: self.block_manager.blocks_needed(seq.num_prompt_tokens)]
            handle |= self.transfer.hold(seq.request_id, blocks, seq.prompt_token_ids)
            seq.finish("remote_decode")
        seq.kv_handle = sign(handle, self.config.disagg.secret)

    def _done(self, request_id: str) -> bool:
        return all(seq.finished for seq in self.requests[request_id])

    def _final_delta(self, request_id: str) -> RequestDelta:
        seqs = self.requests.pop(request_id)
        seqs[0].metrics.finished_time = time.monotonic()
        self.stats.num_finished_requests += 1
        return self._delta(request_id, seqs)

    def _delta(self, request_id: str, seqs: list[Sequence] | None = None) -> RequestDelta | None:
        """The request's new tokens, text and logprobs; None if nothing can be sent yet."""
        finished = seqs is not None
        seqs = seqs or self.requests[request_id]
        choices = [c for c in map(_choice_delta, seqs) if c is not None]
        if not choices and not finished:
            return None
        first = seqs[0]
        kv, handle, role = None, first.kv_handle, self.config.disagg.role
        if role == "prefill" and finished:
            kv = handle or None
        elif role == "decode" and handle and handle.get("pulled") is True:
            kv = {"lease": handle.get("lease")}  # the front releases it at the prefill engine
            handle["pulled"] = "reported"
        return RequestDelta(
            request_id, choices, finished, first.num_prompt_tokens, first.num_cached_tokens,
            first.metrics if finished else None, kv, first.error, first.invalid,
        )  # fmt: skip


def _choice_delta(seq: Sequence) -> ChoiceDelta | None:
    """What seq gained since its last delta (None if nothing): new tokens at once, their
    text once it can be shown (an incomplete UTF-8 character or a possible stop string is
    held back), and the finish reason once."""
    text = seq.text[seq.num_sent_chars : seq.num_emitted_chars]
    start = seq.num_prompt_tokens + seq.num_sent_tokens
    tokens = seq.token_ids[start:]
    finishing = seq.finished and not seq.finish_sent
    if not text and not tokens and not finishing:
        return None
    logprobs = seq.logprobs[seq.num_sent_tokens :] if seq.logprobs is not None else None
    seq.num_sent_chars = seq.num_emitted_chars
    seq.num_sent_tokens += len(tokens)
    seq.finish_sent = finishing
    return ChoiceDelta(
        seq.index, text, tokens, logprobs,
        seq.cumulative_logprob if seq.logprobs is not None else None,
        seq.finish_reason, seq.stop_reason,
    )  # fmt: skip
