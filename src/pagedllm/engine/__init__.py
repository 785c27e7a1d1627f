"""The torch owners: the engine (step = schedule, execute, update), the model runner, the
sampler, the loop thread, and the factory that builds an engine from a config. Only the
serving layer (serving/) and the tools import from here; the HTTP server knows the
EngineClient protocol alone."""
