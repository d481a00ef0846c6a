"""EmbeddedEngine: the embedded rollout engine, an in-process torch engine with continuous batching.

It serves HF Qwen3 / Qwen3-MoE decoder models on CPU or CUDA behind the same `RolloutEngine`
contract as an SGLang server, so harnesses and the driver never know which one they talk to.

How it works: ``generate`` enqueues a request and awaits its future. One scheduler task per event
loop (started lazily) repeats: admit waiting requests into free KV-cache slots and prefill them as
one padded batch, run ONE batched decode step over every running sequence, resolve the finished
ones. The torch work runs in a worker thread (``asyncio.to_thread``) so the event loop stays free
for the environment and harness code that runs beside the engine; one hop runs steps back to back
until something needs the loop (a new, finished or cancelled request, a pause or control call). The forward is
`miles_agent.engines.embedded.model_runner.ModelRunner`; sampling is `miles_agent.engines.embedded.sampling`.

Logprob convention (the trainer must match it): ``output_logprobs[i] = log_softmax(logits / T)[token]``
with ``T`` the request's temperature (``T = 1`` for greedy), computed before top-p / top-k
filtering. The trainer divides its logits by the same temperature.

Routed experts (R3), MoE only: every token that goes through the model records its top-k expert ids
per MoE layer, prompt tokens included; a request that asks gets int32
``(prompt_len + len(output_ids) - 1, moe_layers, top_k)`` as SGLang returns it. A retracted request
is re-prefilled, and the re-prefill's routing replaces the earlier rows.

Prefix cache: finished requests and prefilled prompts leave their KV in a radix tree
(`miles_agent.engines.embedded.prefix_cache`), so an episode's next turn prefills only what it appended
and a group's n samples compute their shared prompt once (a request whose prompt is being prefilled
waits one step, then copies it). The cached KV gives the same logprobs (bitwise in true on-policy
mode), keeps R3 routing rows beside it, and is dropped on every weight update. Long prompts are
prefilled in chunks of ``prefill_chunk_tokens`` between decode steps. ``cache_hit_rate`` = prompt
tokens reused / prompt tokens admitted. A freed KV slot also remembers the tokens its KV covers: a request
that starts with them (an episode's next turn) takes that slot back and copies nothing
(``stats["warm_slot_tokens"]``); the tree still serves every other sharer.

EOS: like SGLang (without ``ignore_eos``), the model's EOS ids stop generation (finish ``stop``, EOS
kept) in addition to the request's ``stop_token_ids``.

Weight versions: ``Completion.weight_version`` is the version that sampled the last token; when
weights change under a request (in-place pause, then update), ``meta["weight_versions"]`` lists
``(version, first output index)`` for each version that sampled part of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from miles_agent.engine import (
    Completion,
    FinishReason,
    PauseMode,
    SamplingParams,
    Scores,
    check_score_request,
)
from miles_agent.engines.embedded.model_runner import ModelRunner
from miles_agent.engines.embedded.prefix_cache import PrefixCache
from miles_agent.engines.embedded.sequence import Sequence

_ids = itertools.count()


class EmbeddedEngine:
    """In-process rollout engine with its own KV cache and continuous batching (see module docstring).

    ``cpu_kernels``: run the forward through the compiled CPU kernels (`cpu_kernels.py`; ~2x faster decode
    steps for a small model on a CPU): None (default) wherever they apply -- fp32 on a CPU, not true on-policy
    mode -- and build; False never; True or an error saying why they can't.

    ``stats`` counts decode steps and decoded sequences (their ratio is ``mean_decode_batch``), prefill
    batches / sequences / tokens (tokens computed), prompt tokens admitted and the ones the prefix cache
    supplied, generated tokens, retractions and failed steps. ``eos_ids`` are the
    ids that always stop a request; benchmarks that need fixed-length outputs may set it empty.
    """

    #: Padded prefill batch budget (batch x longest prompt), so one admission does not allocate without bound.
    prefill_token_budget = 32768
    #: Longest span of one prompt prefilled in one step, so a long prompt does not stall the decoders.
    prefill_chunk_tokens = 1024
    #: Most scheduler steps one worker-thread hop runs back to back (see `_steps`).
    max_steps_per_hop = 16

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, max_batch_size: int = 128,
                 device: str | torch.device = "cpu", max_seq_len: int | None = None,
                 weight_version: int = 0, true_on_policy: bool = False,
                 prefix_cache_bytes: int = 1 << 30, cpu_kernels: bool | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 (0 turns the prefix cache off), got {prefix_cache_bytes}")
        text_config = getattr(model.config, "text_config", None) or model.config  # a VLM: its decoder's
        limit = int(getattr(text_config, "max_position_embeddings", 0) or 0)
        max_seq_len = max_seq_len or limit
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2 (set it or the model's max_position_embeddings), "
                             f"got {max_seq_len}")
        self.device = torch.device(device)
        if true_on_policy:  # the trainer's batch-invariant numerics: bitwise-equal logprobs
            from miles_agent import true_on_policy as exact

            exact.apply(model)
        self.runner = ModelRunner(model, self.device, max_seq_len, max_batch_size, exact=true_on_policy,
                                  cpu_kernels=cpu_kernels)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.eos_ids = _eos_ids(model)
        self._version = int(weight_version)
        self.stats: dict[str, int] = dict(decode_steps=0, decoded_sequences=0, prefill_batches=0,
                                          prefilled_sequences=0, prefill_tokens=0, generated_tokens=0,
                                          retractions=0, failed_steps=0, prompt_tokens=0, cached_tokens=0,
                                          warm_slot_tokens=0)
        r = self.runner
        per_token = 2 * len(r.layers) * r.num_kv_heads * r.head_dim * r.dtype.itemsize
        self.cache = PrefixCache(prefix_cache_bytes // per_token)  # 0 bytes turns it off
        self._epoch = 0  # bumped by every weight update: KV from an older epoch never enters the cache
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._free_slots = list(range(max_batch_size))  # a min-heap: the lowest free slot goes first
        # Free slots whose KV is still that of the tokens their last sequence ended with (this weights epoch):
        # an episode's next turn starts with those tokens, and taking that slot back copies nothing.
        self._slot_tokens: dict[int, tuple[list[int], int]] = {}
        self._paused = False
        self._stopped = False
        self._dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._contenders = 0  # control calls waiting for the lock: the worker hands it back after its step

    # -- public API ---------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def mean_decode_batch(self) -> float:
        """Average number of sequences per decode step: > 1 means requests really were batched."""
        return self.stats["decoded_sequences"] / max(1, self.stats["decode_steps"])

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens the prefix cache supplied / prompt tokens admitted (re-prefills included)."""
        return self.stats["cached_tokens"] / max(1, self.stats["prompt_tokens"])

    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None, *,
                       return_routed_experts: bool = False, images: Iterable[Any] = ()) -> Completion:
        """Enqueue one request and wait for it; raises ValueError on bad input before queueing.

        ``images``: the prompt's `ImageInput`s (a vision-language model), each over its run of image
        placeholder ids; they are encoded at prefill, and their requests bypass the prefix cache (it is
        keyed by ids, and every image's placeholder ids are the same)."""
        sampling = sampling or SamplingParams()
        ids = self._check_request(input_ids, sampling, return_routed_experts)
        images = self._check_images(ids, tuple(images))
        self._bind_loop()
        assert self._loop is not None and self._wake is not None
        seq = Sequence(rid=next(_ids), prompt=ids, sampling=sampling, want_routing=return_routed_experts,
                       future=self._loop.create_future(), stop_ids=frozenset(sampling.stop_token_ids) | self.eos_ids,
                       max_seq_len=self.max_seq_len, tokenizer=self.tokenizer, device=self.device, images=images)
        self._waiting.append(seq)
        self._wake.set()
        try:
            return await seq.future
        except asyncio.CancelledError:
            seq.cancelled = True
            if self._lock is not None and not self._lock.locked():
                self._resolve()  # no step in flight (e.g. paused): free its slot now
            self._wake.set()  # else the scheduler drops it at the next step boundary
            raise

    async def score(self, input_ids: list[int], *, logprob_start_len: int = 1,
                    temperature: float = 1.0) -> Scores:
        """Teacher-forced logprobs of ``input_ids[logprob_start_len:]`` (the `Scorer` contract), one
        forward between scheduler steps; waits while the engine is paused (weights may be mid-update)."""
        ids = [int(t) for t in input_ids]
        check_score_request(ids, logprob_start_len, temperature)
        bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(f"input_ids holds {bad[0]}, outside the vocabulary [0, {self.runner.vocab_size})")
        if len(ids) > self.max_seq_len:
            raise ValueError(f"{len(ids)} tokens exceed the context of {self.max_seq_len} tokens (max_seq_len)")
        self._bind_loop()
        assert self._lock is not None
        while True:
            async with self._exclusive():
                if self._stopped:
                    raise RuntimeError("EmbeddedEngine is shut down; create a new engine")
                if not self._paused:
                    logprobs = await asyncio.to_thread(self.runner.score, ids, logprob_start_len, temperature)
                    return Scores(logprobs, logprob_start_len, self._version)
            await asyncio.sleep(0.01)  # paused: poll until resume (pauses last one weight sync)

    async def pause(self, mode: PauseMode = PauseMode.IN_PLACE) -> None:
        """Stop decoding at the next step boundary; returns once no step is in flight."""
        mode = PauseMode(mode)
        self._bind_loop()
        assert self._lock is not None
        self._paused = True
        async with self._exclusive():
            if mode is PauseMode.ABORT:
                for seq in [*self._running, *self._waiting]:
                    seq.finish = seq.finish or FinishReason.ABORT
                self._resolve()
            elif mode is PauseMode.RETRACT:
                self._retract_running()

    async def resume(self) -> None:
        """Continue decoding: in-place requests carry on, retracted ones are re-prefilled first."""
        self._bind_loop()
        assert self._wake is not None
        self._paused = False
        self._wake.set()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                             ready: Callable[[], bool] | None = None) -> bool:
        """Copy tensors into the model by HF name and set the version; waits for any step in flight.

        All names and shapes are checked before anything is copied, so a bad bucket changes nothing.
        ``ready``: blocks, on the loading thread, until the tensors' bytes are in place (views of memory
        another process is still writing); False when they will not come: nothing loads, and this returns
        False. Returns whether the weights loaded.
        """
        self._bind_loop()
        assert self._lock is not None
        items = list(named_tensors)
        async with self._exclusive():
            load = self.runner.load_weights if ready is None else functools.partial(self.runner.load_weights, ready=ready)
            if await asyncio.to_thread(load, items) is False:  # the bytes will not come: nothing loaded
                return False
            self._epoch += 1
            self.cache.clear()  # everything cached was computed by the old weights
            self._slot_tokens.clear()  # and so was every free slot's KV
            self._version = int(version)
        return True

    async def health(self) -> bool:
        """True while the scheduler task is alive (starting it if needed) and the engine is not shut down."""
        if self._stopped or self._dead is not None:
            return False
        self._bind_loop()
        return self._task is not None and not self._task.done()

    async def shutdown(self) -> None:
        """Abort everything in flight, stop the scheduler and free the KV cache."""
        if self._stopped:
            return
        self._bind_loop()
        assert self._lock is not None and self._wake is not None
        self._stopped = True
        async with self._exclusive():
            for seq in [*self._running, *self._waiting]:
                seq.finish = seq.finish or FinishReason.ABORT
            self._resolve()
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.runner.release()
        self.cache.clear()
        self._slot_tokens.clear()

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> Any:
        """The scheduler's lock for a control call; while it waits, the worker stops after its current step."""
        assert self._lock is not None
        self._contenders += 1
        try:
            await self._lock.acquire()
        finally:
            self._contenders -= 1
        try:
            yield
        finally:
            self._lock.release()

    # -- request checks --------------------------------------------------------------------------------
    def _check_request(self, input_ids: list[int], sampling: SamplingParams, routed: bool) -> list[int]:
        if self._stopped:
            raise RuntimeError("EmbeddedEngine is shut down; create a new engine")
        if self._dead is not None:
            raise RuntimeError(f"EmbeddedEngine scheduler died: {self._dead!r}") from self._dead
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("input_ids is empty; the engine needs at least one prompt token")
        bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(f"input_ids holds {bad[0]}, outside the vocabulary [0, {self.runner.vocab_size})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"input of {len(ids)} tokens leaves no room in the context of {self.max_seq_len} "
                             "tokens (max_seq_len); shorten the prompt")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass tokenizer= to EmbeddedEngine or use stop_token_ids")
        if routed and not self.runner.is_moe:
            raise ValueError(f"return_routed_experts=True needs a MoE model; {type(self.model).__name__} "
                             "is dense and routes no experts")
        return ids

    def _check_images(self, ids: list[int], images: tuple) -> tuple:
        from miles_agent.models.vision import vision_token_ids

        vision = vision_token_ids(self.model)
        pad = vision[0] if vision else None
        if images and vision is None:
            raise ValueError(f"the request has {len(images)} images but {type(self.model).__name__} is a text-only "
                             "model; serve a vision-language model (model.arch=tiny-qwen3-vl) or send no images")
        covered = 0
        for im in images:
            if not 0 <= im.start < im.end <= len(ids) or any(t != pad for t in ids[im.start:im.end]):
                raise ValueError(f"image span [{im.start}, {im.end}) is not a run of image placeholder ids "
                                 f"({pad}) inside the {len(ids)} prompt ids")
            covered += im.end - im.start
        if pad is not None and ids.count(pad) != covered:
            raise ValueError(f"the prompt holds {ids.count(pad)} image placeholder ids but its images cover "
                             f"{covered}; pass every image of the prompt (Trajectory.images)")
        return images

    # -- scheduler -------------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        """Start the scheduler in the running loop; on a new loop, drop state that belonged to the old one."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not loop:
            for seq in [*self._running, *self._waiting]:  # their futures belong to a loop that is gone
                self._release(seq)
            self._running, self._waiting = [], deque()
            self._loop, self._lock, self._wake = loop, asyncio.Lock(), asyncio.Event()
        if not self._stopped and self._dead is None:
            self._task = loop.create_task(self._run(), name="miles-agent-embedded-engine")

    async def _run(self) -> None:
        assert self._lock is not None and self._wake is not None
        try:
            while not self._stopped:
                if self._paused or not (self._waiting or self._running):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                async with self._lock:
                    if self._paused or self._stopped:
                        continue
                    self._drop_cancelled()
                    admitted = self._admit()
                    await asyncio.to_thread(self._steps, admitted)
                    self._resolve()
                await asyncio.sleep(0)  # let new requests and control calls in between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug in the scheduler itself: fail everything, never hang
            self._dead = e
            for seq in [*self._running, *self._waiting]:
                seq.error = seq.error or RuntimeError(f"EmbeddedEngine scheduler died: {e!r}")
            self._resolve()
            raise

    def _admit(self) -> list[tuple[Sequence, list]]:
        """Move waiting requests into free slots, FIFO, within the padded prefill budget, each with its
        cached prefix (the tree path). A request whose whole prompt another one is about to prefill is
        held back a step, so it copies that KV instead of computing it (a group's shared prompt)."""
        admitted: list[tuple[Sequence, list]] = []
        held: list[Sequence] = []
        pending = {tuple(s.tokens) for s in self._running if not s.prefilled} if self.cache.max_tokens else set()
        longest = 0
        while self._waiting and self._free_slots:
            seq = self._waiting.popleft()
            tokens = seq.tokens
            # The cache is keyed by tokens alone: KV computed under a LoRA adapter is not the base model's.
            shared = not getattr(seq.sampling, "lora_path", None) and not seq.images
            hit, path = self.cache.match(tokens, len(tokens) - 1, seq.want_routing) if shared else (0, [])
            key = tuple(tokens) if shared else None
            if hit < len(tokens) - 1 and key in pending:
                held.append(seq)
                continue
            longest = max(longest, min(len(tokens) - hit, self.prefill_chunk_tokens))
            if admitted and longest * (len(admitted) + 1) > self.prefill_token_budget:
                self._waiting.appendleft(seq)
                break
            if self.cache.max_tokens and key is not None:
                pending.add(key)
            warm = self._warm_slot(tokens) if shared and self.cache.max_tokens and not seq.want_routing else None
            if warm is not None and warm[1] >= hit:  # the slot already holds the prefix: nothing to copy
                (seq.slot, seq.cache_len), path, hit = warm, [], warm[1]
                self._free_slots.remove(seq.slot)
                heapq.heapify(self._free_slots)
                self.stats["warm_slot_tokens"] += hit
            else:
                seq.slot = heapq.heappop(self._free_slots)
            self._slot_tokens.pop(seq.slot, None)
            seq.kv_epoch = self._epoch
            self.stats["prompt_tokens"] += len(tokens)
            self.stats["cached_tokens"] += hit
            admitted.append((seq, path))
            self._running.append(seq)
        self._waiting.extendleft(reversed(held))
        return admitted

    def _steps(self, admitted: list[tuple[Sequence, list]]) -> None:
        """Worker-thread body: `_step`, then more steps in the same thread hop while nothing needs the
        event loop between them -- one hop per run of decode steps instead of one per token, and the
        same step boundaries as before: a new request, a cancelled or finished one, a pause, a stop or
        any control call (weight update, score) ends the run after the step in flight."""
        self._step(admitted)
        for _ in range(self.max_steps_per_hop - 1):
            if (self._waiting or self._paused or self._stopped or self._contenders or not self._running
                    or any(s.finish or s.error or s.cancelled for s in self._running)):
                return
            self._step([])

    def _step(self, admitted: list[tuple[Sequence, list]]) -> None:
        """Worker-thread body: copy in cached prefixes, prefill (a chunk of) every sequence not yet
        prefilled, one decode step for all prefilled ones, then cache the KV of the finished ones.

        Errors fail only the sequences of the phase that raised; the engine keeps serving.
        """
        for seq, path in admitted:
            if path:
                try:
                    k, v, rows = self.cache.gather(path)
                    self.runner.write_prefix(seq.slot, k, v)
                    seq.cache_len = k.shape[2]
                    if seq.want_routing and rows is not None:
                        seq.set_routing(0, rows)
                except Exception as e:  # noqa: BLE001 - handed to the request's future
                    self._fail([seq], e)
        todo = [s for s in self._running if not s.prefilled and s.finish is None and s.error is None
                and s.slot is not None]
        if todo:
            chunk, longest = [], 0
            for seq in todo:  # FIFO within the padded budget; the rest go on in the next step
                longest = max(longest, min(len(seq.tokens) - seq.cache_len, self.prefill_chunk_tokens))
                if chunk and longest * (len(chunk) + 1) > self.prefill_token_budget:
                    break
                chunk.append(seq)
            try:
                self._prefill(chunk)
            except Exception as e:  # noqa: BLE001 - handed to the requests' futures
                self._fail(chunk, e)
        batch = sorted((s for s in self._running if s.prefilled and s.finish is None and s.error is None
                        and s.slot is not None), key=lambda s: s.slot)
        if batch:
            try:
                self._decode(batch)
            except Exception as e:  # noqa: BLE001 - handed to the requests' futures
                self._fail(batch, e)
        for seq in self._running:
            if seq.finish is not None and seq.error is None and seq.prefilled:
                self._remember(seq)

    def _remember(self, seq: Sequence) -> None:
        """Put a sequence's KV (``tokens[:cache_len]``) and routing rows into the prefix cache, when
        the current weights computed all of it."""
        if (not self.cache.max_tokens or seq.kv_epoch != self._epoch or seq.slot is None
                or getattr(seq.sampling, "lora_path", None) or seq.images):
            return
        n, slot = seq.cache_len, seq.slot
        rows = seq.routing[:n] if seq.want_routing and seq.routing is not None and seq.routing_rows >= n else None
        self.cache.insert(seq.tokens[:n], lambda a, b: self.runner.read_kv(slot, a, b), rows)

    def _fail(self, seqs: list[Sequence], error: Exception) -> None:
        self.stats["failed_steps"] += 1
        for seq in seqs:
            seq.error = seq.error or error

    def _prefill(self, seqs: list[Sequence]) -> None:
        """The next chunk of each sequence's tokens after its cache; those whose prompt is then all
        in sample their first token and leave the prompt's KV in the prefix cache."""
        record = any(s.want_routing for s in seqs)
        starts = [s.cache_len for s in seqs]
        spans = [s.tokens[st: st + self.prefill_chunk_tokens] for s, st in zip(seqs, starts)]
        for s in seqs:
            if s.images and s.vision is None:
                s.vision = self.runner.encode_images(s.prompt, [(im.start, im.end) for im in s.images],
                                                     [im.data for im in s.images])
        vision = [s.vision for s in seqs] if any(s.images for s in seqs) else None
        logits, routing = self.runner.prefill([s.slot for s in seqs], spans, record, starts, vision)
        self.stats["prefill_batches"] += 1
        self.stats["prefill_tokens"] += sum(len(t) for t in spans)
        done = []
        for b, seq in enumerate(seqs):
            if routing is not None and seq.want_routing:
                seq.set_routing(starts[b], routing[b, : len(spans[b])])
            seq.cache_len += len(spans[b])
            if seq.cache_len == len(seq.tokens):
                seq.prefilled = True
                done.append(b)
        self.stats["prefilled_sequences"] += len(done)
        for b in done:
            self._remember(seqs[b])
        if done:
            self._sample_into([seqs[b] for b in done], logits[done])

    def _decode(self, seqs: list[Sequence]) -> None:
        record = any(s.want_routing for s in seqs)
        positions = [s.cache_len for s in seqs]
        deltas = [s.vision.delta if s.vision is not None else 0 for s in seqs]
        logits, routing = self.runner.decode([s.slot for s in seqs], [s.last_token for s in seqs], positions, record,
                                             deltas)
        self.stats["decode_steps"] += 1
        self.stats["decoded_sequences"] += len(seqs)
        for b, seq in enumerate(seqs):
            if routing is not None and seq.want_routing:
                seq.set_routing(seq.cache_len, routing[b : b + 1])
            seq.cache_len += 1
        self._sample_into(seqs, logits)

    def _sample_into(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample the next token of every sequence that may still grow; finished ones are skipped."""
        from miles_agent.engines.embedded.sampling import sample

        live = [b for b, s in enumerate(seqs) if not s.check_length()]
        if not live:
            return
        tokens, logprobs = sample(logits[live], [seqs[b].sampling for b in live],
                                  [seqs[b].draws for b in live], exact=self.runner.exact, kernels=self.runner.kernels)
        for b, tok, lp in zip(live, tokens, logprobs):
            seqs[b].append(tok, lp, self._version)
        self.stats["generated_tokens"] += len(live)

    def _resolve(self) -> None:
        """Hand finished, failed and cancelled sequences back to their callers; free their slots."""
        done = [s for s in [*self._running, *self._waiting] if s.finish or s.error or s.cancelled]
        if not done:
            return
        done_ids = {id(s) for s in done}
        self._running = [s for s in self._running if id(s) not in done_ids]
        self._waiting = deque(s for s in self._waiting if id(s) not in done_ids)
        for seq in done:
            self._release(seq)
            if seq.future.done():
                continue
            if seq.error is not None:
                seq.future.set_exception(seq.error)
            elif seq.finish is not None:
                seq.future.set_result(seq.completion(self._version))

    def _drop_cancelled(self) -> None:
        if any(s.cancelled for s in [*self._running, *self._waiting]):
            self._resolve()

    def _warm_slot(self, tokens: list[int]) -> tuple[int, int] | None:
        """A free slot whose KV is a prefix of ``tokens`` (leaving at least the last one to compute), computed
        by the current weights: (slot, that prefix's length), the longest such; else None."""
        best = None
        for slot, (held, epoch) in self._slot_tokens.items():
            n = len(held)
            if (epoch == self._epoch and n < len(tokens) and (best is None or n > best[1])
                    and held[-1] == tokens[n - 1] and held[0] == tokens[0] and tokens[:n] == held):
                best = (slot, n)
        return best

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            # Its KV stays valid for the tokens it covers unless the sequence failed mid-step or the weights changed.
            if (seq.error is None and seq.prefilled and seq.cache_len and seq.kv_epoch == self._epoch
                    and not getattr(seq.sampling, "lora_path", None) and not seq.images):
                self._slot_tokens[seq.slot] = (seq.tokens[:seq.cache_len], self._epoch)
            heapq.heappush(self._free_slots, seq.slot)
            seq.slot = None
        seq.cache_len, seq.prefilled, seq.vision = 0, False, None  # image features are re-encoded with the weights

    def _retract_running(self) -> None:
        """Drop the running sequences' KV cache and queue them first for re-prefill on resume."""
        retracted = [s for s in self._running if not (s.finish or s.error)]
        self._resolve()
        for seq in retracted:
            self._release(seq)
            seq.retractions += 1
        self.stats["retractions"] += len(retracted)
        self._running = [s for s in self._running if s not in retracted]
        self._waiting.extendleft(reversed(retracted))


def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
    """The model's EOS ids (generation config first), which stop generation as in SGLang."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
