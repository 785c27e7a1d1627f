"""The base of every request body the server reads."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    """Request bodies are read strictly, as the published schema says: 0 is not false, "1"
    is not 1, true is not a token id. A field the model does not declare is refused (a 400
    naming it); a model that takes others says so."""

    model_config = ConfigDict(strict=True, extra="forbid")
