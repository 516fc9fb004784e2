"""Where could a request ever run? Per-engine footprints, or the reason it fits nowhere.

A request that can never fit — longer than `max_model_len`, more blocks than an engine's
ceiling, more sequences than `max_num_seqs` — is refused with 400 before anything is
reserved or queued; one that fits somewhere only waits for room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.footprint import context_overflow, footprint
from gateway.core.types import EngineSpec, Footprint, RequestShape


@dataclass(frozen=True, slots=True)
class Placement:
    """Engines where the request could run once they have room, with its footprint on each."""

    needs: dict[str, Footprint]


@dataclass(frozen=True, slots=True)
class NeverFits:
    """Why no engine can ever take the request; the message carries the numbers."""

    message: str
    param: str | None = None


def place(
    shape: RequestShape,
    engines: Sequence[EngineSpec],
    kv_ceiling: float,
    output_cap: int | None = None,
    *,
    clamp: bool = False,
) -> Placement | NeverFits:
    """Footprints on the engines where `shape` could run. Whether it could ever run is
    judged on its worst case; the blocks it reserves there are capped by `output_cap`.
    `clamp`: output beyond an engine's context is cut to fit (`admission.over_length`), per
    engine, as engines may differ in `max_model_len`."""
    needs: dict[str, Footprint] = {}
    reasons: list[NeverFits] = []
    for spec in engines:
        overflow = context_overflow(shape, spec.max_model_len, clamp=clamp)
        if overflow is not None:
            reasons.append(NeverFits(overflow, param="max_tokens"))
            continue
        need = footprint(shape, spec.block_size, spec.max_model_len, clamp=clamp)
        # vLLM runs a request on one data-parallel rank: it must fit one rank's pool.
        capacity = spec.rank_capacity_blocks(kv_ceiling)
        if need.blocks > capacity:
            where = f"its {spec.rank_usable_blocks} usable blocks"
            if spec.dp_size > 1:
                where = (
                    f"the {spec.rank_usable_blocks} usable blocks of one of its "
                    f"{spec.dp_size} data-parallel ranks"
                )
            reasons.append(
                NeverFits(
                    f"This request needs {need.blocks} KV blocks ({need.tokens} tokens at "
                    f"block size {spec.block_size}: prompt plus max output, over {need.seqs} "
                    f"sequence(s)), but engine {spec.name!r} admits at most {capacity} blocks "
                    f"({kv_ceiling:g} of {where}). Reduce the prompt, max_tokens or n."
                )
            )
            continue
        if need.seqs > spec.rank_max_num_seqs:
            per_rank = "" if spec.dp_size == 1 else " per data-parallel rank"
            reasons.append(
                NeverFits(
                    f"This request runs {need.seqs} sequences (n × prompts), but engine "
                    f"{spec.name!r} runs at most max_num_seqs={spec.rank_max_num_seqs}"
                    f"{per_rank}.",
                    param="n",
                )
            )
            continue
        if output_cap is not None:
            need = footprint(shape, spec.block_size, spec.max_model_len, output_cap, clamp=clamp)
        needs[spec.name] = need
    if needs:
        return Placement(needs)
    if not reasons:
        return NeverFits("no engine serves this model")
    # The engine that came closest speaks for all: the largest context, then capacity.
    return reasons[_closest(engines, kv_ceiling)]


def _closest(engines: Sequence[EngineSpec], kv_ceiling: float) -> int:
    best = max(
        range(len(engines)),
        key=lambda i: (engines[i].max_model_len, engines[i].capacity_blocks(kv_ceiling)),
    )
    return best
