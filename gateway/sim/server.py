"""A simulated vLLM engine behind vLLM's OpenAI HTTP surface.

``create_app(SimConfig(...))`` returns a Starlette app whose lifespan runs the engine's step
loop. Generation endpoints (chat, completions, the Responses API) are raw ASGI so that a client
disconnect, streaming or not, is seen at once and aborts the request in the engine (its blocks
are freed), as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.sim import responses, responses_api
from gateway.sim.engine import Engine, EngineLimits, RequestSpec, StepTiming
from gateway.sim.front_door import QueueLimits
from gateway.sim.generation import OutputPlan, OutputPlanner
from gateway.sim.loop import Ended, EngineLoop, Event, Generated
from gateway.sim.metrics import EngineMetrics
from gateway.sim.protocol import (
    ApiError,
    GenerationRequest,
    bad_request,
    model_not_found,
    output_budget,
    parse_detokenize,
    parse_embeddings,
    parse_generation,
    parse_json,
    parse_tokenize,
    queue_refusal,
    render_prompts,
)
from gateway.sim.request_ids import RequestIdLog
from gateway.sim.response_store import DEFAULT_CAPACITY, ResponseStore, StoredResponse
from gateway.sim.responses_api import ResponsesCall
from gateway.tokens.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer

SIM_VLLM_VERSION = "0.32.0+kvgateway.sim"


@dataclass(frozen=True)
class SimConfig:
    """The flags of ``kv-gateway sim`` (vLLM's names). Times are milliseconds."""

    served_model_name: str = "tiny"
    num_gpu_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    prefill_ms_per_token: float = 0.02
    decode_ms_base: float = 2.0
    decode_ms_per_seq: float = 0.2
    seed: int = 0
    tokenizer: Path = field(default=BUNDLED_TOKENIZER_DIR)
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # vLLM v1's default
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    max_num_queued_reqs: int | None = None  # vLLM's front-door limits (503), off by default
    max_num_queued_tokens: int | None = None
    reject_duplicate_request_ids: bool = False  # older vLLM: a 400 for an id in flight
    # Responses API responses kept for previous_response_id (vLLM keeps them all, unbounded,
    # with VLLM_ENABLE_RESPONSES_API_STORE=1; 0 = store nothing, vLLM's default).
    max_stored_responses: int = DEFAULT_CAPACITY
    hidden_metrics: tuple[str, ...] = ()  # families left out of /metrics (testing aid)
    gpu_memory_utilization: float = 0.92  # only reported in vllm:cache_config_info
    host: str = "127.0.0.1"
    port: int = 8001

    def limits(self) -> EngineLimits:
        """Validated engine limits; raises ``EngineError`` (a ValueError) like vLLM at start."""
        return EngineLimits(
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            chunked_prefill=self.chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def timing(self) -> StepTiming:
        return StepTiming(self.prefill_ms_per_token, self.decode_ms_base, self.decode_ms_per_seq)

    def queue_limits(self) -> QueueLimits:
        return QueueLimits(self.max_num_queued_reqs, self.max_num_queued_tokens)


class SimState:
    """Everything one simulated engine owns; created by ``create_app``."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.created = int(time.time())
        self.tokenizer = HfTokenizer.load(cfg.tokenizer)
        self.planner = OutputPlanner(self.tokenizer, cfg.seed)
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)
        self.engine = Engine(cfg.limits(), cfg.timing())
        self.queue_limits = cfg.queue_limits()
        self.request_ids = RequestIdLog()
        self.responses = ResponseStore(cfg.max_stored_responses)
        self.metrics = EngineMetrics(
            model_name=cfg.served_model_name,
            limits=self.engine.limits,
            snapshot=self.engine.snapshot,
            started_at=time.time(),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            hidden=cfg.hidden_metrics,
        )
        self.loop = EngineLoop(self.engine, self.metrics)
        self.task: asyncio.Task[None] | None = None

    def alive(self) -> bool:
        return self.task is not None and not self.task.done()


def max_chars_per_token(tokenizer: HfTokenizer) -> int:
    """The longest token string of the vocabulary: vLLM's bound on characters per token."""
    return max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))


def create_app(cfg: SimConfig) -> Starlette:
    state = SimState(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.task = asyncio.create_task(state.loop.run(), name="sim-engine-loop")
        try:
            yield
        finally:
            state.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await state.task

    routes = [
        Route("/v1/chat/completions", _GenerationEndpoint(state, "chat"), methods=["POST"]),
        Route("/v1/completions", _GenerationEndpoint(state, "completion"), methods=["POST"]),
        Route("/v1/responses", _ResponsesEndpoint(state), methods=["POST"]),
        Route("/v1/models", _with_state(state, _models), methods=["GET"]),
        # Not a vLLM route (0.32 serves only the list): the OpenAI SDK's models.retrieve.
        Route("/v1/models/{model_id:path}", _with_state(state, _model), methods=["GET"]),
        Route("/health", _with_state(state, _health), methods=["GET"]),
        Route("/tokenize", _with_state(state, _tokenize), methods=["POST"]),
        Route("/detokenize", _with_state(state, _detokenize), methods=["POST"]),
        # vLLM serves it for pooling models (`--runner pooling`); the simulator for any.
        Route("/v1/embeddings", _with_state(state, _embeddings), methods=["POST"]),
        Route("/version", _with_state(state, _version), methods=["GET"]),
        Route("/metrics", _with_state(state, _metrics), methods=["GET"]),
        Route("/sim/state", _with_state(state, _sim_state), methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _fastapi_error}
    )
    app.state.sim = state
    return app


async def _fastapi_error(request: Request, exc: Exception) -> Response:
    """Unknown routes and methods as vLLM's FastAPI answers them: `{"detail": ...}`."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


Handler = Callable[[SimState, Request], Awaitable[Response]]


def _with_state(state: SimState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(state, request)

    return endpoint


# -- simple endpoints -------------------------------------------------------------------------


async def _models(state: SimState, request: Request) -> Response:
    cfg = state.cfg
    return JSONResponse(responses.models(cfg.served_model_name, state.created, cfg.max_model_len))


async def _model(state: SimState, request: Request) -> Response:
    cfg = state.cfg
    model_id = request.path_params["model_id"]
    if model_id != cfg.served_model_name:
        err = model_not_found(model_id)
        return JSONResponse(err.body(), status_code=err.status)
    return JSONResponse(responses.model_card(model_id, state.created, cfg.max_model_len))


async def _health(state: SimState, request: Request) -> Response:
    return Response(status_code=200 if state.alive() else 503)


async def _version(state: SimState, request: Request) -> Response:
    return JSONResponse({"version": SIM_VLLM_VERSION})


async def _metrics(state: SimState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _tokenize(state: SimState, request: Request) -> Response:
    try:
        body = parse_json(await request.body())
        tokens = parse_tokenize(
            body, served_model_name=state.cfg.served_model_name, tokenizer=state.tokenizer
        )
    except ApiError as err:
        return JSONResponse(err.body(), status_code=err.status)
    return JSONResponse(
        {
            "count": len(tokens),
            "max_model_len": state.cfg.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }
    )


async def _detokenize(state: SimState, request: Request) -> Response:
    try:
        body = parse_json(await request.body())
        text = parse_detokenize(
            body, served_model_name=state.cfg.served_model_name, tokenizer=state.tokenizer
        )
    except ApiError as err:
        return JSONResponse(err.body(), status_code=err.status)
    return JSONResponse({"prompt": text})


async def _embeddings(state: SimState, request: Request) -> Response:
    """``/v1/embeddings``: a deterministic unit vector per input (from its token ids), with
    vLLM's usage. Answered at once: the simulator's engine models generation only."""
    try:
        body = parse_json(await request.body())
        model, prompts = parse_embeddings(
            body, served_model_name=state.cfg.served_model_name, tokenizer=state.tokenizer
        )
        for ids in prompts:
            if len(ids) > state.cfg.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {state.cfg.max_model_len} "
                    f"tokens. However, you requested {len(ids)} tokens in the input for "
                    "embedding generation. Please reduce the length of the input.",
                    "input",
                )
    except ApiError as err:
        return JSONResponse(err.body(), status_code=err.status)
    dimensions = body.get("dimensions")
    size = dimensions if isinstance(dimensions, int) and 0 < dimensions <= 64 else 8
    return JSONResponse(
        responses.embeddings(model, state.created, prompts, size, body.get("encoding_format"))
    )


async def _sim_state(state: SimState, request: Request) -> Response:
    """Debug view of the scheduler (not a vLLM endpoint)."""
    engine = state.engine
    snap = engine.snapshot()
    pool = engine.block_pool
    return JSONResponse(
        {
            "num_gpu_blocks": engine.limits.num_gpu_blocks,
            "usable_blocks": engine.limits.usable_blocks,
            "block_size": engine.limits.block_size,
            "enable_prefix_caching": engine.limits.enable_prefix_caching,
            "used_blocks": snap.used_blocks,
            "cached_blocks": pool.num_cached,
            "evictable_blocks": pool.num_evictable,
            "kv_cache_usage": snap.kv_cache_usage,
            "running": snap.running,
            "waiting": snap.waiting,
            "num_preemptions": snap.num_preemptions,
            "peak_running": snap.peak_running,
            "peak_used_blocks": snap.peak_used_blocks,
            "requests": [vars(v) for v in engine.requests()],
            # x-request-id values of generation requests, the last 10,000 in arrival order.
            "x_request_ids": state.request_ids.recent(),
            "x_request_ids_total": state.request_ids.total,
            # Responses API responses kept for previous_response_id, and the bound.
            "stored_responses": len(state.responses),
            "max_stored_responses": state.responses.capacity,
        }
    )


# -- generation -------------------------------------------------------------------------------


@dataclass
class _Choice:
    index: int
    engine_id: str
    plan: OutputPlan
    generated: int = 0
    ended: bool = False
    ended_order: int = 0  # 1 for the first choice to end, 2 for the next...
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class _Decision:
    """A request accepted for generation: everything the endpoint needs to run it."""

    request: GenerationRequest
    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    choices: list[_Choice]
    # The engine request ids vLLM 0.7-0.10 derived from x-request-id (none without it).
    legacy_ids: tuple[str, ...]


class _EngineEndpoint:
    """A generation route as a raw ASGI app: decide (``_decide``), then run the decision's
    engine sequences and answer as they generate (``_job``), freeing them on every way out."""

    def __init__(self, state: SimState) -> None:
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ids = self._state.request_ids
        x_request_id = _header(scope, b"x-request-id")
        if x_request_id is not None:
            ids.received(x_request_id)
        raw = await _read_body(receive)
        if raw is None:
            return  # the client left before we had the request
        try:
            decision = self._decide(raw, x_request_id)
        except ApiError as err:
            await _send_json(send, err.status, err.body())
            return
        request, prompts, choices = decision.request, decision.prompts, decision.choices
        job = self._job(decision, send)
        loop = self._state.loop
        sink: asyncio.Queue[Event] = asyncio.Queue()
        for legacy_id in decision.legacy_ids:
            ids.started(legacy_id)
        try:
            for choice in choices:
                spec = RequestSpec.of_tokens(
                    choice.engine_id,
                    prompts[choice.index // request.n],
                    choice.plan.token_ids,
                    choice.plan.finish_reason,
                    cache_salt=request.cache_salt,
                )
                loop.submit(spec, sink)
            await _until_disconnect(job.run(sink), receive)
        finally:
            # Every path out (done, disconnect, cancellation, send failure) frees the blocks.
            for choice in choices:
                if not choice.ended:
                    loop.abort(choice.engine_id)
            for legacy_id in decision.legacy_ids:
                ids.ended(legacy_id)

    def _decide(self, raw: bytes, x_request_id: str | None) -> _Decision:
        """The accepted request, or raise the ``ApiError`` vLLM would answer."""
        raise NotImplementedError

    def _job(self, decision: _Decision, send: Send) -> _Job:
        d = decision
        return _Job(self._state, d.request, d.request_id, d.prompts, d.choices, send)

    def _check_queue_limits(self, sequences: int) -> None:
        """vLLM's front door, before the prompt is rendered (its ``_preflight``)."""
        state = self._state
        limits, engine = state.queue_limits, state.engine
        reason = limits.refusal(
            unfinished=engine.num_unfinished,
            sequences=sequences,
            prefill_backlog_tokens=engine.prefill_backlog_tokens() if limits.counts_tokens else 0,
        )
        if reason is not None:
            state.metrics.count_admission_rejection(reason)
            raise queue_refusal(reason)


class _GenerationEndpoint(_EngineEndpoint):
    """POST /v1/chat/completions or /v1/completions."""

    def __init__(self, state: SimState, kind: Literal["chat", "completion"]) -> None:
        super().__init__(state)
        self._kind = kind

    def _decide(self, raw: bytes, x_request_id: str | None) -> _Decision:
        """Parse, render and plan a request, or raise the ``ApiError`` vLLM would answer.

        The answer's id is ``chatcmpl-<x-request-id>`` / ``cmpl-<x-request-id>`` when the header
        is present (vLLM's base request id), else a fresh uuid. Engine sequence ids always get a
        unique suffix, as current vLLM's do, so equal header values never collide in the engine.
        """
        state = self._state
        cfg = state.cfg
        request = parse_generation(
            self._kind, parse_json(raw), served_model_name=cfg.served_model_name
        )
        self._check_queue_limits(request.num_sequences)
        prompts = render_prompts(
            request,
            tokenizer=state.tokenizer,
            max_model_len=cfg.max_model_len,
            max_chars_per_token=state.max_chars_per_token,
        )
        prefix = "chatcmpl" if self._kind == "chat" else "cmpl"
        legacy_ids: tuple[str, ...] = ()
        if x_request_id is not None:
            legacy_ids = self._legacy_ids(f"{prefix}-{x_request_id}", len(prompts), request.n)
            if cfg.reject_duplicate_request_ids:
                self._check_duplicate(legacy_ids)
        request_id = f"{prefix}-{x_request_id or uuid.uuid4().hex}"
        unique = "" if x_request_id is None else f"-{uuid.uuid4().hex[:8]}"
        choices: list[_Choice] = []
        for p, prompt in enumerate(prompts):
            budget = output_budget(request, len(prompt), cfg.max_model_len)
            for j in range(request.n):  # vLLM v1 fans n out into n sequences
                plan = state.planner.plan(
                    prompt, budget, ignore_eos=request.ignore_eos, seed=request.seed, index=j
                )
                index = p * request.n + j
                choices.append(_Choice(index, f"{request_id}-{index}{unique}", plan))
        return _Decision(request, request_id, prompts, choices, legacy_ids)

    def _legacy_ids(self, base: str, num_prompts: int, n: int) -> tuple[str, ...]:
        """The engine request ids older vLLM registered: ``<base>`` for chat, ``<base>-<p>``
        per completions prompt, each as ``<j>_<id>`` children when ``n > 1``."""
        parents = [base] if self._kind == "chat" else [f"{base}-{p}" for p in range(num_prompts)]
        if n == 1:
            return tuple(parents)
        return tuple(f"{j}_{parent}" for parent in parents for j in range(n))

    def _check_duplicate(self, legacy_ids: tuple[str, ...]) -> None:
        """Older vLLM (0.7 to about 0.10): an engine request id already in flight is a 400
        from its output processor, naming the first one that collides."""
        log = self._state.request_ids
        for legacy_id in legacy_ids:
            if log.in_flight(legacy_id):
                raise bad_request(f"Request id {legacy_id} already running.")


@dataclass(frozen=True)
class _ResponsesDecision(_Decision):
    call: ResponsesCall
    conversation: tuple[Mapping[str, Any], ...]  # the chat rendered, stored with the answer
    max_output_tokens: int  # the output budget, as the answer reports it


class _ResponsesEndpoint(_EngineEndpoint):
    """POST /v1/responses: one sequence, its prompt the request's conversation as a chat.

    In vLLM's order: the fields (and the model), then ``previous_response_id`` (404 when this
    engine does not hold it), then the rendered prompt's length. ``x-request-id`` is recorded
    but does not name the answer (vLLM's id is the ``request_id`` field or a fresh one).
    """

    def _decide(self, raw: bytes, x_request_id: str | None) -> _ResponsesDecision:
        state = self._state
        cfg = state.cfg
        call = responses_api.parse_responses(
            parse_json(raw), served_model_name=cfg.served_model_name
        )
        self._check_queue_limits(1)
        previous = None
        if call.previous_response_id is not None:
            previous = state.responses.get(call.previous_response_id)
            if previous is None:
                raise responses_api.previous_not_found(call.previous_response_id)
        messages = responses_api.conversation(call, previous)
        request = responses_api.generation_request(call, messages)
        (prompt,) = render_prompts(
            request,
            tokenizer=state.tokenizer,
            max_model_len=cfg.max_model_len,
            max_chars_per_token=state.max_chars_per_token,
        )
        if len(prompt) >= cfg.max_model_len:
            raise responses_api.prompt_fills_context(len(prompt), cfg.max_model_len)
        budget = output_budget(request, len(prompt), cfg.max_model_len)
        plan = state.planner.plan(
            prompt, budget, ignore_eos=request.ignore_eos, seed=request.seed, index=0
        )
        # vLLM's engine id is `<id>_0`; a client's own `request_id` may repeat, so make it unique.
        engine_id = f"{call.response_id}_0-{uuid.uuid4().hex[:8]}"
        choices = [_Choice(0, engine_id, plan)]
        return _ResponsesDecision(
            request, call.response_id, (prompt,), choices, (), call, messages, budget
        )

    def _job(self, decision: _Decision, send: Send) -> _Job:
        assert isinstance(decision, _ResponsesDecision)
        return _ResponsesJob(self._state, decision, send)


class _Job:
    """Turns engine events into one HTTP answer (JSON, or SSE chunks as tokens arrive)."""

    def __init__(
        self,
        state: SimState,
        request: GenerationRequest,
        request_id: str,
        prompts: tuple[tuple[int, ...], ...],
        choices: list[_Choice],
        send: Send,
    ) -> None:
        self._planner = state.planner
        self._request = request
        self._choices = {c.engine_id: c for c in choices}
        # vLLM counts each prompt once, however many choices (n) it has.
        self._prompt_tokens = sum(len(p) for p in prompts)
        self._send = send
        self._id = request_id
        self._created = int(time.time())
        self._tokens_details = state.cfg.enable_prompt_tokens_details
        self._num_ended = 0

    async def run(self, sink: asyncio.Queue[Event]) -> None:
        if self._request.stream:
            await self._stream(sink)
        else:
            await self._collect(sink)

    async def _events(self, sink: asyncio.Queue[Event]) -> AsyncIterator[tuple[_Choice, Event]]:
        while not all(c.ended for c in self._choices.values()):
            event = await sink.get()
            choice = self._choices[event.request_id]
            if isinstance(event, Generated):
                choice.generated = event.index + 1
            elif isinstance(event, Ended):
                self._num_ended += 1
                choice.ended = True
                choice.ended_order = self._num_ended
                choice.num_cached_tokens = event.num_cached_tokens
            yield choice, event

    async def _collect(self, sink: asyncio.Queue[Event]) -> None:
        async for _ in self._events(sink):
            pass
        request = self._request
        done = [
            (c.index, self._planner.text(c.plan.token_ids), c.plan.finish_reason)
            for c in sorted(self._choices.values(), key=lambda c: c.index)
        ]
        body = responses.final_response(
            request.kind,
            self._id,
            self._created,
            request.model,
            done,
            self._prompt_tokens,
            self._completion_tokens(),
            self._cached_tokens(),
        )
        await _send_json(self._send, 200, body)

    async def _stream(self, sink: asyncio.Queue[Event]) -> None:
        request = self._request
        await self._send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        if request.kind == "chat":
            for c in sorted(self._choices.values(), key=lambda c: c.index):
                await self._sse(self._chunk(c.index, "", None, role=True))
        async for choice, event in self._events(sink):
            if not isinstance(event, Generated):
                continue
            last = event.index == len(choice.plan) - 1
            text = self._planner.piece(choice.plan.token_ids[event.index])
            await self._sse(
                self._chunk(choice.index, text, choice.plan.finish_reason if last else None)
            )
        if request.include_usage:
            await self._sse(
                responses.usage_chunk(
                    request.kind,
                    self._id,
                    self._created,
                    request.model,
                    self._prompt_tokens,
                    self._completion_tokens(),
                    self._cached_tokens(),
                )
            )
        await self._send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def _chunk(
        self, index: int, text: str, finish_reason: str | None, *, role: bool = False
    ) -> dict[str, Any]:
        request = self._request
        return responses.chunk(
            request.kind,
            self._id,
            self._created,
            request.model,
            index,
            text,
            finish_reason,
            role=role,
        )

    async def _sse(self, body: dict[str, Any]) -> None:
        data = b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    def _completion_tokens(self) -> int:
        return sum(c.generated for c in self._choices.values())

    def _cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` as vLLM reports it, or None.

        vLLM reports the cached tokens of one engine request: the last prompt's (completions
        read the last result), and of its sequences (``n > 1``) the one that ended last.
        """
        if not self._tokens_details:
            return None
        last_prompt = max(c.index for c in self._choices.values()) // self._request.n
        ended = [
            c
            for c in self._choices.values()
            if c.index // self._request.n == last_prompt and c.ended
        ]
        if not ended:
            return None
        return max(ended, key=lambda c: c.ended_order).num_cached_tokens


class _ResponsesJob(_Job):
    """A Responses API answer: a ``response`` object, or vLLM's named events as tokens arrive
    (``response.created`` first, with the id; ``response.completed`` last, with the usage).
    A ``store``d answer is kept, before it is sent (as vLLM), for a later
    ``previous_response_id``; an answer cut short by a disconnect is not."""

    def __init__(self, state: SimState, decision: _ResponsesDecision, send: Send) -> None:
        super().__init__(
            state,
            decision.request,
            decision.request_id,
            decision.prompts,
            decision.choices,
            send,
        )
        self._call = decision.call
        self._conversation = decision.conversation
        self._max_output_tokens = decision.max_output_tokens
        self._store = state.responses
        self._item_id = f"msg_{uuid.uuid4().hex}"
        self._sequence_number = 0

    async def _collect(self, sink: asyncio.Queue[Event]) -> None:
        async for _ in self._events(sink):
            pass
        await _send_json(self._send, 200, self._finish())

    async def _stream(self, sink: asyncio.Queue[Event]) -> None:
        await self._send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        opening = self._response("in_progress", [], None)
        await self._event("response.created", {"response": opening})
        await self._event("response.in_progress", {"response": opening})
        opened = False
        async for choice, event in self._events(sink):
            if not isinstance(event, Generated):
                continue
            piece = self._planner.piece(choice.plan.token_ids[event.index])
            if not piece:  # EOS: no text, no event
                continue
            if not opened:
                for name, fields in responses_api.text_events_opening(self._item_id):
                    await self._event(name, fields)
                opened = True
            await self._event(*responses_api.text_delta(self._item_id, piece))
        if opened:
            for name, fields in responses_api.text_events_closing(self._item_id, self._text()):
                await self._event(name, fields)
        await self._event("response.completed", {"response": self._finish()}, last=True)

    def _finish(self) -> dict[str, Any]:
        """The whole response (stored now when asked)."""
        (choice,) = self._choices.values()
        text = self._text()
        status = "incomplete" if choice.plan.finish_reason == "length" else "completed"
        usage = responses_api.usage(self._prompt_tokens, choice.generated, choice.num_cached_tokens)
        output = [responses_api.output_message(self._item_id, text)]
        if self._call.store:
            self._store.put(self._call.response_id, StoredResponse(self._conversation, text))
        return self._response(status, output, usage)

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        return responses_api.response(
            self._call,
            created_at=self._created,
            status=status,
            output=output,
            max_output_tokens=self._max_output_tokens,
            usage=usage,
        )

    def _text(self) -> str:
        (choice,) = self._choices.values()
        return self._planner.text(choice.plan.token_ids)

    async def _event(self, name: str, fields: dict[str, Any], *, last: bool = False) -> None:
        data = responses_api.sse_event(name, fields, self._sequence_number)
        self._sequence_number += 1
        await self._send({"type": "http.response.body", "body": data, "more_body": not last})


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (``name`` in lower case), decoded as latin-1."""
    for key, value in scope.get("headers", ()):
        if key == name:
            decoded: str = value.decode("latin-1")
            return decoded
    return None


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(work: Awaitable[None], receive: Receive) -> None:
    """Run ``work`` until it ends or the client disconnects, whichever comes first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            with contextlib.suppress(OSError):  # the client went away while we were sending
                work_task.result()
    finally:
        for task in (work_task, watch_task):
            task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
