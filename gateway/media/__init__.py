"""Media in prompts: how many tokens an image (video, audio) part becomes in the engine.

`families` holds the per-model-family rules (pure arithmetic), `images` reads an image's
size from its header, `sources` gets an image's bytes (a data URL, or a fetch when enabled),
and `counter` puts them together per model, with the configured worst case for what cannot be
counted. See docs/tokens.md ("Media").
"""

from gateway.media.counter import MediaCounter, MediaPolicy
from gateway.media.families import FAMILIES, Family

__all__ = ["FAMILIES", "Family", "MediaCounter", "MediaPolicy"]
