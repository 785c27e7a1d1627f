"""OpenAI-compatible HTTP server over the async engine."""
