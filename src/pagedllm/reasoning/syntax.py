"""How a model family marks its thinking, chosen by `serve --reasoning-parser` (vLLM's option
and names) or, with `auto`, from the chat template and the vocabulary."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    start: str  # the text that opens the thinking
    end: str  # the text that closes it (a budget writes it into the sequence)

    def opened_by(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves the thinking open, so the answer starts inside
        it (DeepSeek-R1's and Qwen3-2507's templates end the generation prompt with the
        start marker; Qwen3's with thinking off closes an empty block)."""
        tail = prompt.rstrip()
        opened = tail.rfind(self.start)
        return opened >= 0 and tail.find(self.end, opened) < 0 and tail.endswith(self.start)


THINK_TAGS = ("<think>", "</think>")
SYNTAXES = {
    "deepseek_r1": ReasoningSyntax("deepseek_r1", *THINK_TAGS),
    "qwen3": ReasoningSyntax("qwen3", *THINK_TAGS),
    "granite": ReasoningSyntax("granite", "Here is my thought process:",
                               "Here is my response:"),
    "mistral": ReasoningSyntax("mistral", "[THINK]", "[/THINK]"),  # Magistral
}
CHOICES = ("auto", *SYNTAXES, "none")


def choose_syntax(option: str, chat_template: str | None,
                  vocabulary: set[str] | frozenset[str] = frozenset()) -> ReasoningSyntax | None:
    """The syntax `option` names; `auto`: the one the chat template writes (or, where the
    template says nothing, the vocabulary's own thinking tokens); None: no thinking parsed."""
    if option not in CHOICES:
        raise ValueError(f"unknown reasoning parser {option!r}: choose one of "
                         f"{', '.join(CHOICES)}")
    if option == "none":
        return None
    if option != "auto":
        return SYNTAXES[option]
    template = chat_template or ""
    if "[THINK]" in template or "[THINK]" in vocabulary:
        return SYNTAXES["mistral"]
    if "<think>" in template:
        return SYNTAXES["qwen3" if "enable_thinking" in template else "deepseek_r1"]
    if "<think>" in vocabulary and "</think>" in vocabulary:
        return SYNTAXES["deepseek_r1"]
    return None
