"""The one orchestrator: tokens → footprint → admit (or queue, or refuse) → lease.

The HTTP layer asks `admit` for a lease, forwards the request to the lease's engine and
hands the lease back with `release` in `finally`, whatever happened.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.core.admission import NeverFits, place
from gateway.core.deadline import Outlook, Verdict, decide
from gateway.core.footprint import output_budget
from gateway.core.kvmath import ceil_div
from gateway.core.latency import BatchSnapshot, predict_tpot, predict_ttft, request_prefill
from gateway.core.reservation import (
    AdaptivePolicy,
    AdaptiveReservation,
    OutputLengths,
    PredictionPolicy,
    blocks_short,
)
from gateway.core.tenants import RateLimitValues
from gateway.core.types import (
    DEFAULT_TENANT,
    EngineSpec,
    Footprint,
    RequestShape,
    ServiceClass,
    TenantPolicy,
)
from gateway.engines.pool import EnginePool
from gateway.errors import BadRequest, ContextOverflow, ModelNotFound, UpstreamUnavailable
from gateway.latency import LatencyBook
from gateway.media import MediaCounter
from gateway.prefixes import PrefixCache, Prompted
from gateway.request import Inbound
from gateway.scheduler import Ask, Scheduler
from gateway.state.base import Lease
from gateway.state.errors import StateUnavailable
from gateway.stored_responses import ResponseLog
from gateway.tokens import EngineTokenizeError, TokenCountError
from gateway.tokens.chat import ChatInput
from gateway.tokens.count import TokenCount
from gateway.tokens.errors import InvalidChatRequest
from gateway.tokens.protocol import TokenCounter, prompt_token_counts

Reservation = Literal["worst_case", "predicted", "adaptive"]
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


IDLE = BatchSnapshot(decoding=0)
"""An engine with nothing running nor waiting: the least TTFT a request can have there."""


@dataclass(frozen=True, slots=True)
class ChatFlags:
    """An engine's flags that change a chat's prompt (`engines[]` settings: the gateway
    cannot read them from the engine)."""

    exclude_tools_when_tool_choice_none: bool = False
    trust_request_chat_template: bool = False


@dataclass(frozen=True, slots=True)
class ModelRules:
    """What the service needs to know of a model besides its counter."""

    uses_kv_cache: bool = True
    media: MediaCounter | None = None


@dataclass(frozen=True, slots=True)
class Counted:
    """A request's counted prompts: the shape admission decides on, and per prompt its
    `TokenCount` (with the prompt's token ids where the counter gives them, for the
    prefix-cache credit; materialised only when read)."""

    shape: RequestShape
    prompts: tuple[TokenCount, ...] = ()


@dataclass(frozen=True, slots=True)
class Admitted:
    lease: Lease
    engine: EngineSpec
    counted: Counted
    cached: int = 0
    """Prompt blocks the engine is expected to have in its prefix cache (its footprint's
    `cached` there, at least the lease's credit): blocks it need not compute."""

    @property
    def shape(self) -> RequestShape:
        return self.counted.shape

    @property
    def prompt_tokens(self) -> int:
        """The request's prompt tokens as vLLM's `usage` counts them: each prompt once,
        whatever `n`."""
        return sum(self.shape.prompt_tokens)


class Service:
    def __init__(
        self,
        *,
        pool: EnginePool,
        scheduler: Scheduler,
        counters: Mapping[str, TokenCounter],
        kv_ceiling: float,
        reservation: Reservation = "worst_case",
        prediction: PredictionPolicy | None = None,
        adaptive: AdaptivePolicy | None = None,
        clamp: bool = True,
        models: Mapping[str, ModelRules] | None = None,
        engine_flags: Mapping[str, ChatFlags] | None = None,
        responses: ResponseLog | None = None,
        prefixes: PrefixCache | None = None,
        setup: Callable[[str], tuple[TokenCounter, ModelRules]] | None = None,
        latency: LatencyBook | None = None,
    ) -> None:
        self.pool = pool
        # Each engine's batch, step costs and running TPOT targets (gateway/latency.py);
        # None when no service class has targets.
        self.latency = latency
        self._setup = setup
        self.prefixes = prefixes
        self.models = dict(models or {})
        self.engine_flags = dict(engine_flags or {})
        self.responses = responses if responses is not None else ResponseLog()
        self.scheduler = scheduler
        self.counters = dict(counters)
        self.kv_ceiling = kv_ceiling
        self.reservation = reservation
        self.clamp = clamp  # admission.over_length: clamp
        # Output lengths per model, and per (model, tenant): tenants of one model may answer
        # very differently (summaries, classifications). Learned in both modes (the metrics
        # show what `predicted` would reserve); only `predicted` reserves by them.
        self._policy = prediction or PredictionPolicy()
        self.output_lengths = {model: OutputLengths(self._policy) for model in counters}
        self._tenant_lengths: dict[tuple[str, str], OutputLengths] = {}
        # `adaptive`: per model, the reservation steered by its engines' preemptions, and the
        # preemption total last seen on them.
        self._steer = steer = adaptive or AdaptivePolicy()
        self.adaptive = {
            model: AdaptiveReservation(steer, self._policy.quantile) for model in counters
        }
        self._preemptions_seen: dict[str, int] = {}

    async def admit(
        self,
        inbound: Inbound,
        tenant: TenantPolicy = DEFAULT_TENANT,
        *,
        exclude: frozenset[str] = frozenset(),
        counted: Counted | None = None,
        since_s: float = 0.0,
    ) -> Admitted:
        """A lease on an engine for this request (not on `exclude`); raises a `GatewayError`
        otherwise. Pass the `counted` of an earlier admission to skip counting again;
        `since_s`: how long ago the request reached the gateway (its TTFT target counts from
        then)."""
        serving = self.pool.serving(inbound.model)
        if not serving:
            name = inbound.model if len(inbound.model) <= 200 else inbound.model[:200] + "…"
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        engines = self._eligible(inbound, [e.spec for e in serving])
        engines = [e for e in engines if e.name not in exclude]
        if not engines:
            raise UpstreamUnavailable(f"no other engine serves `{inbound.model}`")
        if counted is None:
            counted = await self.count(inbound, engines)
        shape = counted.shape
        cap = self.output_cap(inbound.model, tenant.name)
        placement = place(shape, engines, self.kv_ceiling, cap, clamp=self.clamp)
        if isinstance(placement, NeverFits):
            raise ContextOverflow(placement.message, param=placement.param)
        prompted = self._prompted(inbound, counted, placement.needs)
        cls = inbound.service_class
        gate = turn = None
        if self.latency is not None and inbound.generates:
            gate = self._deadline_gate(self.latency, cls, shape, prompted.needs)
            if cls is not None and cls.ttft_s is not None:
                turn = _turn(self.latency, tuple(prompted.needs))
        ask = Ask(
            id=uuid.uuid4().hex,
            needs=prompted.needs,
            tenant=tenant,
            tokens=max(need.tokens for need in placement.needs.values()),
            tenant_max_blocks=self._share_blocks(tenant),
            gate=gate,
            targeted=cls is not None and cls.has_targets,
            since_s=since_s,
            turn=turn,
        )
        lease = await self.scheduler.admit(ask)
        if self.prefixes is not None:
            self.prefixes.sent(lease.engine, prompted.blocks.get(lease.engine, ()))
        need = prompted.needs.get(lease.engine)
        cached = max(lease.credit, need.cached if need is not None else 0)
        return Admitted(lease, self.spec(lease.engine), counted, cached)

    def _deadline_gate(
        self,
        book: LatencyBook,
        cls: ServiceClass | None,
        shape: RequestShape,
        needs: Mapping[str, Footprint],
    ) -> Callable[[float], Verdict]:
        """The request's deadline gate (core/deadline.py), asked before each decision: on
        each engine, its TTFT predicted from the engine's batch and the prefills ahead of it
        (its own prefill less the blocks expected cached there) times how far the engine's
        TTFT predictions have run short (`LatencyBook.ttft_factor`), the step time with it
        added, and the running requests' tightest TPOT target. A request without targets
        (best effort) is still kept off engines where it would break that target."""
        ttft_s = cls.ttft_s if cls is not None else None
        tpot_s = cls.tpot_s if cls is not None else None
        own: dict[str, int] = {}
        for name, need in needs.items():
            state = self.pool.get(name)
            if state is not None:
                spec = state.spec
                own[name] = request_prefill(
                    shape.prompt_tokens, shape.n, need.cached, spec.block_size, spec.prefix_caching
                )

        def gate(waited_s: float) -> Verdict:
            outlooks = []
            for name, prefill in own.items():
                costs = book.costs(name)
                batch = book.snapshot(name)
                factor = book.ttft_factor(name)
                outlooks.append(
                    Outlook(
                        name,
                        ttft_s=predict_ttft(costs, batch, prefill) * factor,
                        step_s=predict_tpot(costs, batch),
                        idle_ttft_s=predict_ttft(costs, IDLE, prefill) * factor,
                        tightest_tpot_s=book.tightest_tpot(name),
                    )
                )
            return decide(outlooks, ttft_s=ttft_s, tpot_s=tpot_s, waited_s=waited_s)

        return gate

    def _prompted(
        self, inbound: Inbound, counted: Counted, needs: Mapping[str, Footprint]
    ) -> Prompted:
        """The footprints with their prefix hashes (gateway/prefixes.py): a generation with
        one prompt whose token ids the counter knows."""
        if self.prefixes is None or not inbound.generates or len(counted.prompts) != 1:
            return Prompted(dict(needs), {})
        return self.prefixes.footprints(
            needs, counted.prompts[0].ids(), model=inbound.model, salt=inbound.prefix_salt
        )

    def _eligible(self, inbound: Inbound, engines: list[EngineSpec]) -> list[EngineSpec]:
        """The engines that may take this request: those that trust a per-request chat
        template when it carries one; the one holding `previous_response_id` when the
        gateway knows it."""
        chat = inbound.chat
        if chat is not None and chat.chat_template is not None:
            engines = [e for e in engines if self._flags(e.name).trust_request_chat_template]
            if not engines:
                raise BadRequest(UNTRUSTED_TEMPLATE, param="chat_template")
        if inbound.previous_response_id is not None:
            stored = self.responses.get(inbound.previous_response_id)
            if stored is not None:
                holding = [e for e in engines if e.name == stored.engine]
                if not holding:
                    raise UpstreamUnavailable(
                        f"the engine that stored response `{inbound.previous_response_id}` "
                        "no longer serves this model"
                    )
                return holding
        return engines

    def _flags(self, engine: str) -> ChatFlags:
        return self.engine_flags.get(engine, ChatFlags())

    async def rate_limits(self, tenant: TenantPolicy) -> RateLimitValues | None:
        """The tenant's rate limits as they stand; None when the store cannot say."""
        try:
            return await self.scheduler.store.rate_limits(tenant)
        except StateUnavailable:
            return None

    async def release(self, lease: Lease, used_tokens: int | None = None) -> None:
        await self.scheduler.release(lease, used_tokens)

    async def extend(self, lease: Lease, blocks: int) -> Lease:
        return await self.scheduler.extend(lease, blocks)

    def top_up(self, admitted: Admitted, lease: Lease, generated: int) -> int:
        """Blocks to add to a streaming request's lease that its `generated` tokens (all
        choices) outgrew; 0 in `worst_case` mode or while the lease suffices."""
        shape = admitted.shape
        if self.reservation == "worst_case" or len(shape.prompt_tokens) != 1:
            return 0
        prompt, spec = shape.prompt_tokens[0], admitted.engine
        return blocks_short(
            held_blocks=lease.blocks + lease.credit,  # its shared prefix is its own too
            seqs=lease.seqs,
            prompt_tokens=prompt,
            generated=generated // lease.seqs,
            budget=output_budget(
                prompt,
                shape.max_output_tokens,
                spec.max_model_len,
                shape.default_output_tokens,
                clamp=self.clamp,
            ),
            block_size=spec.block_size,
        )

    def output_cap(self, model: str, tenant: str = DEFAULT_TENANT.name) -> int | None:
        """Output tokens per sequence to reserve at most; None = the whole budget. The
        tenant's own prediction once it has enough samples, else the model's; at the
        configured quantile (`predicted`) or as its engines' preemptions steer it
        (`adaptive`: a quantile and a margin for the tail)."""
        if self.reservation == "worst_case":
            return None
        steered = self.adaptive.get(model) if self.reservation == "adaptive" else None
        for lengths in (self._tenant_lengths.get((model, tenant)), self.output_lengths.get(model)):
            if lengths is None:
                continue
            predicted = lengths.predicted() if steered is None else steered.reserve(lengths)
            if predicted is not None:
                return predicted
        return None

    def observe_output(
        self,
        model: str,
        shape: RequestShape,
        completion_tokens: int,
        tenant: str = DEFAULT_TENANT.name,
    ) -> None:
        """Learn from a request that completed: its output tokens per sequence (rounded up),
        as the engine counted them (the gateway's prompt count may differ from the engine's)."""
        pooled = self.output_lengths.get(model)
        seqs = shape.n * len(shape.prompt_tokens)
        if pooled is None or seqs <= 0:
            return
        per_seq = ceil_div(completion_tokens, seqs)
        pooled.observe(per_seq)
        # Tenants come from the config (or are the default one): a bounded set of keys.
        own = self._tenant_lengths.setdefault((model, tenant), OutputLengths(self._policy))
        own.observe(per_seq)
        steered = self.adaptive.get(model)
        if steered is not None:
            steered.observe(completed=1, preemptions=self._new_preemptions(model))

    def _new_preemptions(self, model: str) -> int:
        """Preemptions on the model's engines since the last call (their counters as last
        scraped; a counter that went back — a restarted engine — counts from zero)."""
        total = sum(e.preemptions or 0 for e in self.pool.serving(model))
        seen = self._preemptions_seen.get(model)
        self._preemptions_seen[model] = total
        if seen is None:
            return 0
        return max(0, total - seen)

    def _counter(self, model: str) -> TokenCounter:
        """`model`'s counter; one set up now for a model an engine was first seen serving
        after start-up (rediscovered), with its output lengths learned from nothing."""
        counter = self.counters.get(model)
        if counter is not None:
            return counter
        if self._setup is None:
            raise UpstreamUnavailable(f"no token counter for `{model}`")
        try:
            counter, rules = self._setup(model)
        except ValueError as e:  # its tokenizer cannot be loaded (a ConfigError)
            raise UpstreamUnavailable(f"could not count the request's tokens: {e}") from None
        self.counters[model] = counter
        self.models[model] = rules
        self.output_lengths.setdefault(model, OutputLengths(self._policy))
        self.adaptive.setdefault(model, AdaptiveReservation(self._steer, self._policy.quantile))
        return counter

    def _share_blocks(self, tenant: TenantPolicy) -> int | None:
        """`kv_share` in blocks: a fraction of all engines' admissible blocks."""
        if tenant.kv_share is None:
            return None
        total = sum(e.spec.capacity_blocks(self.kv_ceiling) for e in self.pool)
        return int(total * tenant.kv_share)

    async def count(self, inbound: Inbound, engines: Sequence[EngineSpec] = ()) -> Counted:
        """Count the request's prompts (as `engines`, the candidates, will render them);
        raises `BadRequest` for what the request got wrong, `UpstreamUnavailable` when no
        count can be had."""
        if not inbound.counted:  # tokenize/detokenize: a lease for the limits, no KV
            return Counted(RequestShape((), 0, generates=False))
        counter = self._counter(inbound.model)
        rules = self.models.get(inbound.model, ModelRules())
        param = "messages" if inbound.chat is not None else "prompt"
        try:
            prompts = await self._count(counter, inbound, engines, rules)
        except InvalidChatRequest as e:
            raise BadRequest(str(e), param=e.param or param) from None
        except ValueError as e:  # the request's fault: template refused it, bad prompt type
            raise BadRequest(str(e), param=param) from None
        except EngineTokenizeError as e:
            if e.status in (400, 422):  # the engine refused the request itself (its template...)
                raise BadRequest(e.detail or str(e), param=param) from None
            raise UpstreamUnavailable(f"could not count the request's tokens: {e}") from None
        except TokenCountError as e:
            raise UpstreamUnavailable(f"could not count the request's tokens: {e}") from None
        if inbound.previous_response_id is not None:
            stored = self.responses.get(inbound.previous_response_id)
            if stored is not None:  # the conversation the engine prepends
                prompts[0] = TokenCount(prompts[0].count + stored.total_tokens)
        shape = RequestShape(
            prompt_tokens=tuple(c.count for c in prompts),
            max_output_tokens=inbound.max_output_tokens,
            n=inbound.n,
            default_output_tokens=inbound.default_output_tokens,
            generates=inbound.generates,
            holds_kv=rules.uses_kv_cache,
        )
        return Counted(shape, tuple(prompts))

    async def _count(
        self,
        counter: TokenCounter,
        inbound: Inbound,
        engines: Sequence[EngineSpec],
        rules: ModelRules,
    ) -> list[TokenCount]:
        if inbound.chat is not None:
            chat = self._as_rendered(inbound.chat, engines)
            if chat.media_parts:
                if rules.media is None:
                    raise InvalidChatRequest(
                        f"the model `{inbound.model}` is not configured for media input "
                        "(models[].media); the gateway cannot count its image, video or "
                        "audio parts",
                        param="messages",
                    )
                media = await rules.media.count(chat.messages, chat.mm_processor_kwargs)
                chat = chat.with_media(media)
            return [await counter.count_chat(chat)]
        if inbound.pairs:
            return await self._count_pairs(counter, inbound)
        return await prompt_token_counts(counter, inbound.prompt)

    def _as_rendered(self, chat: ChatInput, engines: Sequence[EngineSpec]) -> ChatInput:
        """`tool_choice: "none"` renders no tools on engines started with
        `--exclude-tools-when-tool-choice-none`: dropped only when every candidate engine
        does, else counted (the larger count is the safe one)."""
        if (
            chat.tools
            and chat.tool_choice_none
            and engines
            and all(self._flags(e.name).exclude_tools_when_tool_choice_none for e in engines)
        ):
            return chat.without_tools()
        return chat

    async def _count_pairs(self, counter: TokenCounter, inbound: Inbound) -> list[TokenCount]:
        """Score/rerank: one sequence per (query, document) pair, counted as both texts with
        their special tokens (a cross-encoder's pair, or more); plus each query alone (a
        bi-encoder embeds it as a sequence of its own)."""
        texts = sorted({t for pair in inbound.pairs for t in pair} | set(inbound.queries))
        counts = await asyncio.gather(*(counter.count_prompt(t) for t in texts))
        of = dict(zip(texts, (c.count for c in counts), strict=True))
        pairs = [TokenCount(of[q] + of[d]) for q, d in inbound.pairs]
        return [*pairs, *(TokenCount(of[q]) for q in inbound.queries)]

    def spec(self, engine: str) -> EngineSpec:
        state = self.pool.get(engine)
        if state is None:  # an engine removed while a lease was held
            raise UpstreamUnavailable(f"engine {engine!r} is no longer configured")
        return state.spec


def _turn(book: LatencyBook, engines: Iterable[str]) -> Callable[[int], float | None]:
    """A request's predicted turn on `engines` (`Ask.turn`): the `k + 1`-th soonest predicted
    end of a request running there, when `k` requests with targets wait ahead of it (each
    end frees the room one of them takes). None when fewer ends are predicted."""

    def turn(ahead: int) -> float | None:
        ends = sorted(end for name in engines for end in book.releases(name))
        return ends[ahead] if 0 <= ahead < len(ends) else None

    return turn
