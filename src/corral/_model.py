"""The base of corral's pydantic models (the wire contract, the schemas of sandboxes,
images, pools, networks and volumes).

Their validators and serializers are built on first use (``defer_build``), not at import:
``import corral`` declares some sixty models, and building them all up front cost a
process about a fifth of its import's CPU, though a reward worker uses a handful. A
model behaves the same either way; only its first validation pays for its build.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Model"]


class Model(BaseModel):
    """A pydantic model whose validator is built the first time it is needed."""

    model_config = ConfigDict(defer_build=True)
