"""A store's embedding model as the pool holds it (serving/model_pool.py): the embedding
service (embeddings/service.py: its own thread, queued requests batched per pass) with what
the pool asks of any loaded model: is it busy, how large, stop it. It generates nothing:
aborts and key policies have nothing to act on, and it publishes no engine figures (its
counters are the embedding service's)."""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddingInfo:
    """What /api/ps and /v1/models read of a loaded model."""

    max_model_len: int  # the longest input
    kv_memory_bytes: int = 0


class EmbeddingClient:
    kind = "embedding"
    loras = None  # adapters are served over a generating model
    restarting = stalled = None

    def __init__(self, service):
        self.service = service
        self.info = EmbeddingInfo(service.model.max_tokens)
        self.dead: str | None = None
        self._stopped = threading.Event()

    @classmethod
    def load(cls, path: str, name: str, pooling: str | None = None) -> EmbeddingClient:
        """A sentence-transformers folder (its own pooling) or a decoder (GGUF or folder)."""
        from pagedllm.embeddings.service import EmbeddingService
        from pagedllm.serving.model_card import is_sentence_folder

        if is_sentence_folder(path):
            from pagedllm.embeddings.sentence_model import SentenceModel

            model = SentenceModel(path, name)
        else:
            from pagedllm.embeddings.decoder_model import DecoderEmbeddingModel

            model = DecoderEmbeddingModel(path, pooling, name)
        return cls(EmbeddingService(model))

    @property
    def num_in_flight(self) -> int:
        return self.service.num_queued_inputs

    def abort(self, request_id: str) -> None:
        pass

    def abort_all(self) -> None:
        pass

    def figures(self) -> list:
        return []

    def set_user_policies(self, weights: dict, max_running: dict) -> None:
        pass

    def run(self) -> None:
        self._stopped.wait()  # the service runs on its own thread

    def shutdown(self) -> None:
        self.service.shutdown()
        self._stopped.set()
