"""Tool calls: the functions a chat request offers (spec.py, plain data), how they reach the
model's prompt and which syntax the model answers in (syntax.py, prompt.py), and how the
model's text becomes calls again, as it streams (parser.py). Both APIs use it: OpenAI's
`tools`/`tool_choice` and Ollama's `tools`. No torch here."""
