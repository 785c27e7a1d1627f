"""Embedding models: a BERT-family encoder (bert.py) under the pooling its
sentence-transformers folder names (sentence_model.py), the packaged all-MiniLM-L6-v2
(packaged.py), and the thread that serves it in batches (service.py). The HTTP routes
(server/embeddings_api.py) import only this module and packaged.py, neither of which needs
torch: the server stays loadable without the engine's stack."""


class EmbeddingQueueFull(Exception):
    """More inputs wait for the embedding model than its queue holds: try again shortly."""
