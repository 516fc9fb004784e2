"""The one orchestrator: tokens → footprint → admit (or queue, or refuse) → lease.

The HTTP layer asks `admit` for a lease, forwards the request to the lease's engine and
hands the lease back with `release` in `finally`, whatever happened.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from gateway.core.admission import NeverFits, place
from gateway.core.footprint import output_budget
from gateway.core.kvmath import ceil_div
from gateway.core.reservation import (
    AdaptivePolicy,
    AdaptiveQuantile,
    OutputLengths,
    PredictionPolicy,
    blocks_short,
)
from gateway.core.tenants import RateLimitValues
from gateway.core.types import DEFAULT_TENANT, EngineSpec, RequestShape, TenantPolicy
from gateway.engines.pool import EnginePool
from gateway.errors import BadRequest, ContextOverflow, ModelNotFound, UpstreamUnavailable
from gateway.request import Inbound
from gateway.scheduler import Ask, Scheduler
from gateway.state.base import Lease
from gateway.state.errors import StateUnavailable
from gateway.tokens import EngineTokenizeError, TokenCountError
from gateway.tokens.protocol import TokenCounter, prompt_token_counts

Reservation = Literal["worst_case", "predicted", "adaptive"]


@dataclass(frozen=True, slots=True)
class Admitted:
    lease: Lease
    engine: EngineSpec
    shape: RequestShape

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
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.counters = counters
        self.kv_ceiling = kv_ceiling
        self.reservation = reservation
        self.clamp = clamp  # admission.over_length: clamp
        # Output lengths per model, and per (model, tenant): tenants of one model may answer
        # very differently (summaries, classifications). Learned in both modes (the metrics
        # show what `predicted` would reserve); only `predicted` reserves by them.
        self._policy = prediction or PredictionPolicy()
        self.output_lengths = {model: OutputLengths(self._policy) for model in counters}
        self._tenant_lengths: dict[tuple[str, str], OutputLengths] = {}
        # `adaptive`: per model, the quantile steered by its engines' preemptions, and the
        # preemption total last seen on them.
        steer = adaptive or AdaptivePolicy()
        self.adaptive = {
            model: AdaptiveQuantile(steer, self._policy.quantile) for model in counters
        }
        self._preemptions_seen: dict[str, int] = {}

    async def admit(
        self,
        inbound: Inbound,
        tenant: TenantPolicy = DEFAULT_TENANT,
        *,
        exclude: frozenset[str] = frozenset(),
        shape: RequestShape | None = None,
    ) -> Admitted:
        """A lease on an engine for this request (not on `exclude`); raises a `GatewayError`
        otherwise. Pass the `shape` of an earlier admission to skip counting again."""
        serving = self.pool.serving(inbound.model)
        if not serving:
            name = inbound.model if len(inbound.model) <= 200 else inbound.model[:200] + "…"
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        engines = [e.spec for e in serving if e.spec.name not in exclude]
        if not engines:
            raise UpstreamUnavailable(f"no other engine serves `{inbound.model}`")
        if shape is None:
            shape = await self.shape(inbound)
        cap = self.output_cap(inbound.model, tenant.name)
        placement = place(shape, engines, self.kv_ceiling, cap, clamp=self.clamp)
        if isinstance(placement, NeverFits):
            raise ContextOverflow(placement.message, param=placement.param)
        ask = Ask(
            id=uuid.uuid4().hex,
            needs=placement.needs,
            tenant=tenant,
            tokens=max(need.tokens for need in placement.needs.values()),
            tenant_max_blocks=self._share_blocks(tenant),
        )
        lease = await self.scheduler.admit(ask)
        return Admitted(lease, self.spec(lease.engine), shape)

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
            held_blocks=lease.blocks,
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
        configured quantile (`predicted`) or the one its engines' preemptions steer
        (`adaptive`)."""
        if self.reservation == "worst_case":
            return None
        steered = self.adaptive.get(model) if self.reservation == "adaptive" else None
        quantile = steered.quantile if steered is not None else None
        own = self._tenant_lengths.get((model, tenant))
        predicted = own.predicted(quantile) if own is not None else None
        if predicted is None:
            pooled = self.output_lengths.get(model)
            predicted = pooled.predicted(quantile) if pooled is not None else None
        return predicted

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

    def _share_blocks(self, tenant: TenantPolicy) -> int | None:
        """`kv_share` in blocks: a fraction of all engines' admissible blocks."""
        if tenant.kv_share is None:
            return None
        total = sum(e.spec.capacity_blocks(self.kv_ceiling) for e in self.pool)
        return int(total * tenant.kv_share)

    async def shape(self, inbound: Inbound) -> RequestShape:
        counter = self.counters[inbound.model]
        try:
            if inbound.messages is not None:
                prompts = [await counter.count_chat(inbound.messages)]
            else:
                prompts = await prompt_token_counts(counter, inbound.prompt)
        except ValueError as e:  # the request's fault: template refused it, bad prompt type
            raise BadRequest(str(e), param="messages" if inbound.messages else "prompt") from None
        except EngineTokenizeError as e:
            if e.status in (400, 422):  # the engine refused the request itself (its template...)
                param = "messages" if inbound.messages else "prompt"
                raise BadRequest(e.detail or str(e), param=param) from None
            raise UpstreamUnavailable(f"could not count the request's tokens: {e}") from None
        except TokenCountError as e:
            raise UpstreamUnavailable(f"could not count the request's tokens: {e}") from None
        return RequestShape(
            prompt_tokens=tuple(prompts),
            max_output_tokens=inbound.max_output_tokens,
            n=inbound.n,
            default_output_tokens=inbound.default_output_tokens,
        )

    def spec(self, engine: str) -> EngineSpec:
        state = self.pool.get(engine)
        if state is None:  # an engine removed while a lease was held
            raise UpstreamUnavailable(f"engine {engine!r} is no longer configured")
        return state.spec
