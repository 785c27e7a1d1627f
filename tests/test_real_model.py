"""The real default model (SmolLM2-135M Q4_1 GGUF) in float32 against Hugging Face transformers."""
import torch

from paged_helpers import transformers_greedy
from pagedllm import SamplingParams
from pagedllm.tools.text_prompts import make_prompt_token_ids

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]


def test_greedy_continuations_match_transformers(real_llm, hf_reference):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = real_llm.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        expected = transformers_greedy(hf_reference, output.prompt_token_ids, 32)
        assert output.token_ids == expected, prompt
        assert output.finish_reason == "length"


def test_prompt_logits_match_transformers(real_llm, hf_reference):
    from paged_helpers import run_paged

    ids = real_llm.tokenizer.encode(PROMPTS[3])
    ours = run_paged(real_llm.engine.runner.model, [ids], block_size=16)[0]
    with torch.no_grad():
        reference = hf_reference(torch.tensor([ids])).logits[0]
    # float32 throughout; what differs is summation order only.
    assert (ours - reference).abs().max().item() < 1e-3


def test_chat_generation_is_sensible(real_llm):
    tok = real_llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    (out,) = real_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_eight_prompts_together_equal_alone(real_llm):
    lengths = [30, 600, 75, 250, 140, 410, 45, 330]
    prompts = make_prompt_token_ids(real_llm.tokenizer, lengths, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    together = real_llm.generate(prompts, params)
    alone = [real_llm.generate([p], params)[0] for p in prompts]
    for t, a in zip(together, alone):
        assert t.token_ids == a.token_ids
        assert t.text == a.text


def assert_close_to_float32(real_llm, model, label: str, max_mean_error: float,
                            kv_cache_dtype: str = "auto") -> None:
    """The fast model's logits at every position of a short and a 300-token prompt, against
    the float32 model's (exact cache): whole-prompt prefill, and one token a step (the C++
    decode loop). Greedy agreement >= 95 %, mean |logit difference| < max_mean_error; pytest
    -s prints the figures that BENCHMARKS.md quotes."""
    from paged_helpers import run_paged

    short = real_llm.tokenizer.encode(PROMPTS[3] + " The fisherman's daughter walked to the harbour.")
    long = make_prompt_token_ids(real_llm.tokenizer, [300], seed=3)[0]
    for ids in (short, long):
        exact = run_paged(real_llm.engine.runner.model, [ids], block_size=16)[0]
        for chunk in (None, 1):
            approx = run_paged(model, [ids], block_size=16, chunk=chunk, kv_cache_dtype=kv_cache_dtype)[0]
            agree = (approx.argmax(-1) == exact.argmax(-1)).float().mean().item()
            mean_error = (approx - exact).abs().mean().item()
            print(f"{label} vs float32, {len(ids)} tokens, chunk {chunk}: greedy agreement "
                  f"{agree:.3f}, mean |logit difference| {mean_error:.3f}")
            assert agree >= 0.95, (len(ids), chunk, agree)
            assert mean_error < max_mean_error, (len(ids), chunk, mean_error)


def test_bfloat16_fast_path_stays_close_to_float32(real_llm):
    from pagedllm import LLM

    fast = LLM(dtype="bfloat16", kv_cache_memory=64 << 20)
    model = fast.engine.runner.model
    assert any(type(m).__name__ == "QuantLinear" for m in model.modules())  # 4-bit in use
    assert model.embedding.q8 is not None and model.embedding.weight is None  # 8-bit embedding
    # Whole prompt / one token a step: agreement 1.0 / 1.0 (short), 0.97 / 0.98 (long); mean
    # |difference| 0.22 / 0.15 (short), 0.16 / 0.11 (long). Int8-rounded activations (middle
    # layers, above 8 rows) and the tiled prefill attention raised the whole-prompt errors
    # from 0.15 and 0.11 (benchmarks/int8_activations.py). Those are avx512's figures; below
    # it the same algorithms with float32 FMAs and another summation order gave 0.255 (avx2)
    # and 0.233 (portable) on the short prompt (0.16 / 0.15 on the long one), so the stated
    # tolerance is 0.25 on avx512 and 0.3 below it.
    level = model.head.ops.isa()
    assert_close_to_float32(real_llm, model, f"bf16 ({level})", 0.25 if level == "avx512" else 0.3)
    out = fast.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert "Paris" in out.text


def test_int8_kv_cache_stays_close_to_float32(real_llm):
    """kv_cache_dtype "int8" on the bfloat16 fast path: the tiled prefill kernel reads
    dequantized rows, decode attention multiplies int8 codes. Stated tolerance: mean |logit
    difference| < 0.3 (0.25 for the bfloat16 cache: the int8 cache adds ~0.03,
    benchmarks/kv_cache_int8.py)."""
    from pagedllm import LLM

    model = LLM(dtype="bfloat16", kv_cache_memory=64 << 20, kv_cache_dtype="int8").engine.runner.model
    assert_close_to_float32(real_llm, model, "bf16 + int8 KV", 0.3, kv_cache_dtype="int8")
