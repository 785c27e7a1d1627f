"""Text <-> token ids: a tokenizer.json or a GGUF's own vocabulary, chat templates, and the
bounded encoding requests use."""
from pagedllm.tokenizer.tokenizer import ChatTemplateError, TokenLimitError, Tokenizer

__all__ = ["ChatTemplateError", "TokenLimitError", "Tokenizer"]
