"""What a request is: its sampling parameters, its state inside the engine, and its outputs."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from pagedllm.config import COMPLETIONS_DEFAULT_MAX_TOKENS, SPECULATIVE_METHODS
from pagedllm.errors import FieldError
from pagedllm.core.thinking import ThinkingControl
from pagedllm.structured.spec import GrammarSpec


class SamplingParamsError(FieldError):
    """A sampling parameter is out of range; `param` names the field."""


# Bounds that keep every value something the sampler can compute with (a top_k or seed past
# int64 overflows torch; a vanishing repetition penalty turns logits into infinities) and
# that bound the work one request can ask for (stop strings are searched every step).
MAX_INT32 = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1 - 16)  # torch's generator range, room for n samples' +j
MIN_REPETITION_PENALTY = 0.01
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 1000, 64
# OpenAI's bounds on logit_bias: at most 300 tokens, each biased by -100..100.
MAX_LOGIT_BIAS_TOKENS, LOGIT_BIAS_RANGE = 300, (-100.0, 100.0)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS  # None: up to the context
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's logprob plus top-k
    skip_special_tokens: bool = True
    # Special tokens written as text all the same: a chat model family's tool-call and
    # thinking markers where they are special tokens, for the answer's parsers.
    kept_special_token_ids: tuple[int, ...] = ()
    guided: GrammarSpec | None = None  # structured output: the grammar the tokens must follow
    # Added to these tokens' logits before anything else (-100 bans a token, +100 forces it).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Speculative decoding for this request ("off", "ngram"); None: the server's default.
    # The output is the same either way (core/speculation.py): only the speed differs.
    speculative: str | None = None
    # The LoRA adapter this request runs with (its name; None: the base model) and the
    # weight of its products (llama.cpp's per-request scale). Not sampling proper, but it
    # travels with every request's knobs to wherever the engine runs.
    lora: str | None = None
    lora_scale: float = 1.0
    # A reasoning model's thinking: its markers, its budget, the grammar kept for the answer
    # after it (core/thinking.py); None: the answer is not read for thinking.
    thinking: ThinkingControl | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str):
            if not ok:
                raise SamplingParamsError(param, message)

        check(isinstance(self.n, int) and 1 <= self.n <= 16, "n", f"must be 1-16, got {self.n}")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              f"must be at least 1, got {self.max_tokens}")
        check(math.isfinite(self.lora_scale) and -10.0 <= self.lora_scale <= 10.0, "lora",
              f"an adapter's scale must be in [-10, 10], got {self.lora_scale}")
        check(0.0 <= self.temperature <= 100.0, "temperature", f"must be 0-100, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0 <= self.top_k <= MAX_INT32, "top_k",
              f"must be -1, 0 (off) or 1-{MAX_INT32}, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"must be in [-2, 2], got {self.frequency_penalty}")
        check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0, "repetition_penalty",
              f"must be in [{MIN_REPETITION_PENALTY}, 2], got {self.repetition_penalty}")
        check(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed",
              f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
              f"must be 0-20, got {self.logprobs}")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        check(all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
              f"each stop string must be text of at most {MAX_STOP_CHARS} characters")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32
            for t in self.stop_token_ids), "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} token ids, each in [0, {MAX_INT32}]")
        check(len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS, "logit_bias",
              f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        low, high = LOGIT_BIAS_RANGE
        check(all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32
                  and isinstance(b, (int, float)) and not isinstance(b, bool)
                  and low <= b <= high for t, b in self.logit_bias.items()), "logit_bias",
              f"maps token ids to biases in [{low:g}, {high:g}]")
        check(self.speculative is None or self.speculative in SPECULATIVE_METHODS, "speculative",
              f"must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}")
        check(self.guided is None or isinstance(self.guided, GrammarSpec), "guided",
              "must be a GrammarSpec (pagedllm.structured.spec)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # this request failed in the engine; the others in its step went on


class Request:
    """One sequence inside the engine. Scheduling is by counters, not modes: a step gives it
    some of its (num_tokens - num_computed_tokens) uncomputed tokens."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, eos_token_ids: tuple[int, ...] = (), max_model_len: int,
                 max_tokens: int | None = None, user: str | None = None,
                 cache_salt: str | None = None, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.max_model_len = max_model_len
        # Output budget: resolved by the engine (resolve_max_tokens); params' value otherwise.
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        self.user = user
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.logprobs: list = []  # one entry per output token when params.logprobs is set
        self.grammar = None  # its GrammarMatcher when params.guided is set (made by the engine)
        # Its LoRA adapter's key (name + digest; core/lora_slot_table.py), set by the engine that
        # runs it: the slot it takes and its prefix cache's key.
        self.lora_key: str | None = None
        # Tokens proposed to follow it (core/speculation.py), verified in its next step.
        self.draft_token_ids: list[int] = []
        # Sampled in a step still running when the next was planned (overlapped steps): 0 or
        # 1; the scheduler plans with it, the token itself arrives with that step's results.
        self.num_pending_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefix_cache_key(self) -> str | None:
        """What its cached blocks are keyed by besides tokens: the user's salt and the
        adapter (KV computed under one adapter is never another's)."""
        if self.lora_key is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora_key}"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob) of the most likely alternatives


@dataclass
class RequestOutput:
    """The state of a request after a step: cumulative fields plus this step's delta."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # all generated text so far (stop strings removed)
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduling
    error: str | None = None  # why it failed, with finish_reason "error"
    stop_string: str | None = None  # the stop string that ended it, when one did

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class QueuePosition:
    """Sent to streams that asked for it while their request waits: 1 = admitted next."""

    position: int
    queue_length: int
