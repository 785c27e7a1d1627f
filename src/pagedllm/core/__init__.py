"""The core loop: requests, KV-block bookkeeping, scheduler, fair queue, output processing
(all plain Python, no torch), and the engine that drives the model runner with them.
Import direction: config <- request <- kv_cache <- scheduler <- engine <- async_engine."""
