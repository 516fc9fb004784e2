"""Tenant limits: concurrency, KV share, and requests / tokens per minute as token buckets.

A bucket holds at most `limit` units and refills at `limit / 60` units per second. A request
takes 1 unit from the requests bucket and its up-front token estimate from the tokens bucket
*when it is admitted*; a refused request takes nothing. At release the tokens bucket gets
back `charged − used` (never above its capacity; a request that used more than it was
charged leaves the bucket in debt, at most one capacity deep).

Buckets are stored as (level, stamp) and refilled lazily: a missing bucket is a full one, so
a store may forget a bucket once it is full again (`Bucket.full_at`).

Pure: time is passed in. The Redis adapter implements the same arithmetic in Lua.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

TenantRefusalCode = Literal["tenant_concurrency", "tenant_rpm", "tenant_tpm", "tenant_kv_share"]


@dataclass(frozen=True, slots=True)
class Bucket:
    """`level` units at time `stamp` (may be negative: debt)."""

    level: float
    stamp: float

    def level_at(self, limit: int, now: float) -> float:
        refill = limit / 60.0 * max(0.0, now - self.stamp)
        return min(float(limit), self.level + refill)

    def seconds_until(self, units: float, limit: int, now: float) -> float:
        """Seconds until the bucket holds `units` (0 when it already does)."""
        missing = units - self.level_at(limit, now)
        if missing <= 0:
            return 0.0
        return missing / (limit / 60.0) if limit > 0 else math.inf


def full(limit: int, now: float) -> Bucket:
    return Bucket(float(limit), now)


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What one tenant holds now. A None bucket is full."""

    in_flight: int = 0
    blocks: int = 0
    requests: Bucket | None = None
    tokens: Bucket | None = None


@dataclass(frozen=True, slots=True)
class TenantRefusal:
    code: TenantRefusalCode
    retry_after_s: float | None = None
    """When the bucket will have room for this request; None when unknown (concurrency, KV
    share: it depends on releases) or never (more tokens than the whole TPM bucket)."""


@dataclass(frozen=True, slots=True)
class RateLimitValues:
    """The `x-ratelimit-*` figures; None where the tenant has no such limit."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None


def _bucket(bucket: Bucket | None, limit: int, now: float) -> Bucket:
    return bucket if bucket is not None else full(limit, now)


def check_rates(
    usage: TenantUsage,
    *,
    max_concurrency: int | None,
    rpm: int | None,
    tpm: int | None,
    tokens: int,
    now: float,
) -> TenantRefusal | None:
    """Concurrency, then requests per minute, then tokens per minute; None when all allow."""
    if max_concurrency is not None and usage.in_flight + 1 > max_concurrency:
        return TenantRefusal("tenant_concurrency")
    if rpm is not None:
        bucket = _bucket(usage.requests, rpm, now)
        if bucket.level_at(rpm, now) < 1:
            wait = bucket.seconds_until(1, rpm, now) if rpm >= 1 else None
            return TenantRefusal("tenant_rpm", wait)
    if tpm is not None:
        bucket = _bucket(usage.tokens, tpm, now)
        if bucket.level_at(tpm, now) < tokens:
            wait = bucket.seconds_until(tokens, tpm, now) if tpm >= 1 and tokens <= tpm else None
            return TenantRefusal("tenant_tpm", wait)
    return None


def share_allows(usage: TenantUsage, blocks: int, max_blocks: int | None) -> bool:
    """Whether holding `blocks` more stays within the tenant's KV share."""
    return max_blocks is None or usage.blocks + blocks <= max_blocks


def charge(
    usage: TenantUsage,
    *,
    rpm: int | None,
    tpm: int | None,
    blocks: int,
    tokens: int,
    now: float,
) -> TenantUsage:
    """The usage after admitting a request (checks are the caller's: `check_rates`)."""
    requests, token_bucket = usage.requests, usage.tokens
    if rpm is not None:
        requests = Bucket(_bucket(requests, rpm, now).level_at(rpm, now) - 1, now)
    if tpm is not None:
        level = _bucket(token_bucket, tpm, now).level_at(tpm, now)
        token_bucket = Bucket(level - tokens, now)
    return TenantUsage(usage.in_flight + 1, usage.blocks + blocks, requests, token_bucket)


def release(
    usage: TenantUsage,
    *,
    tpm: int | None,
    blocks: int,
    charged: int,
    used: int | None,
    now: float,
) -> TenantUsage:
    """The usage after a request ends; `used=None` (unknown) refunds nothing."""
    token_bucket = usage.tokens
    if tpm is not None and used is not None and used != charged:
        level = _bucket(token_bucket, tpm, now).level_at(tpm, now) + (charged - used)
        token_bucket = Bucket(max(-float(tpm), min(float(tpm), level)), now)
    return replace(
        usage,
        in_flight=max(0, usage.in_flight - 1),
        blocks=max(0, usage.blocks - blocks),
        tokens=token_bucket,
    )


def forget_full(usage: TenantUsage, *, rpm: int | None, tpm: int | None, now: float) -> TenantUsage:
    """Drop buckets that are full again (a missing bucket is a full one)."""
    requests, tokens = usage.requests, usage.tokens
    if requests is not None and (rpm is None or requests.level_at(rpm, now) >= rpm):
        requests = None
    if tokens is not None and (tpm is None or tokens.level_at(tpm, now) >= tpm):
        tokens = None
    return replace(usage, requests=requests, tokens=tokens)


def rate_limit_values(
    usage: TenantUsage, *, rpm: int | None, tpm: int | None, now: float
) -> RateLimitValues:
    values = RateLimitValues()
    if rpm is not None:
        bucket = _bucket(usage.requests, rpm, now)
        values = replace(
            values,
            limit_requests=rpm,
            remaining_requests=max(0, math.floor(bucket.level_at(rpm, now))),
            reset_requests_s=bucket.seconds_until(rpm, rpm, now),
        )
    if tpm is not None:
        bucket = _bucket(usage.tokens, tpm, now)
        values = replace(
            values,
            limit_tokens=tpm,
            remaining_tokens=max(0, math.floor(bucket.level_at(tpm, now))),
            reset_tokens_s=bucket.seconds_until(tpm, tpm, now),
        )
    return values
