"""The engines the gateway fronts: their specs, health, and what they report.

For now specs come from the configuration (and discovery at start-up); scraping and health
checks update the same pool, so routing always reads one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.core.types import EngineLoad, EngineSpec, EngineView


@dataclass
class EngineState:
    spec: EngineSpec
    healthy: bool = True
    external_blocks: int = 0
    external_seqs: int = 0
    sources: dict[str, str] = field(default_factory=dict)


class EnginePool:
    def __init__(self, specs: list[EngineSpec], sources: dict[str, dict[str, str]] | None = None):
        self._engines: dict[str, EngineState] = {
            s.name: EngineState(spec=s, sources=(sources or {}).get(s.name, {})) for s in specs
        }

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._engines.values())

    def get(self, name: str) -> EngineState | None:
        return self._engines.get(name)

    def serving(self, model: str) -> list[EngineState]:
        return [e for e in self._engines.values() if model in e.spec.models]

    def models(self) -> dict[str, int]:
        """Each served model id and the largest max_model_len among its engines."""
        out: dict[str, int] = {}
        for e in self._engines.values():
            for m in e.spec.models:
                out[m] = max(out.get(m, 0), e.spec.max_model_len)
        return out

    def view(self, name: str, load: EngineLoad) -> EngineView:
        e = self._engines[name]
        return EngineView(
            spec=e.spec,
            load=load,
            healthy=e.healthy,
            external_blocks=e.external_blocks,
            external_seqs=e.external_seqs,
        )
