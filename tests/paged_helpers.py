"""Drive a model directly over a paged KV cache, without scheduler or engine."""
from __future__ import annotations

import random

import torch

from pagedllm.attention import AttentionMetadata, allocate_layer_caches


def reference_logits(model, seq: list[int]) -> torch.Tensor:
    """A transformers model's logits of every position of one sequence, [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


def make_kv_caches(config, num_blocks: int, block_size: int, dtype=torch.float32,
                   kv_cache_dtype: str = "auto", device: str = "cpu"):
    caches = allocate_layer_caches(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                                   config.head_dim, dtype, kv_cache_dtype, device)
    for cache in caches:
        for tensor in cache:
            if tensor is not None:
                tensor.zero_()
    return caches


def run_paged(model, seqs: list[list[int]], *, block_size: int = 4, chunk: int | None = None,
              seed: int = 0, num_blocks: int = 256, kv_cache_dtype: str = "auto",
              device: str = "cpu") -> list[torch.Tensor]:
    """Run sequences together through the model, each prefilled in chunks of `chunk` tokens
    (all in one batch per round), with block tables scattered at random over the cache.
    Returns per sequence the float32 logits of every position (on the host). device: where
    the model (the generic backend's) and the cache live."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
    kv = make_kv_caches(model.config, num_blocks, block_size, model.dtype, kv_cache_dtype, device)
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        ids, pos, slots, qsl, lens, tbls, owners = [], [], [], [0], [], [], []
        for i, s in enumerate(seqs):
            if done[i] >= len(s):
                continue
            n = len(s) - done[i] if chunk is None else min(chunk, len(s) - done[i])
            r = range(done[i], done[i] + n)
            ids += s[done[i]:done[i] + n]
            pos += list(r)
            slots += [tables[i][p // block_size] * block_size + p % block_size for p in r]
            qsl.append(qsl[-1] + n)
            lens.append(done[i] + n)
            tbls.append(tables[i])
            owners.append(i)
            done[i] += n
        meta = AttentionMetadata.build(slots, qsl, lens, tbls, block_size, device)
        hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), kv,
                       meta)
        out = model.compute_logits(hidden).cpu()
        for j, i in enumerate(owners):
            logits[i].append(out[qsl[j]:qsl[j + 1]])
    return [torch.cat(parts) for parts in logits]


def assert_greedy_equals_transformers(reference_model, folder, prompts, max_tokens: int = 32,
                                      **settings):
    """Greedy tokens of pagedllm's offline LLM on `folder` (EngineConfig `settings`) equal
    transformers' generate()."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(folder, **{"kv_cache_memory": 4 << 20, **settings})
    ours = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        assert out.token_ids == transformers_greedy(reference_model, prompt, max_tokens), prompt


def transformers_greedy(reference_model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, exactly max_tokens long (no EOS stop)."""
    with torch.no_grad():
        out = reference_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def bfloat16_argmax_agreement(reference_model, model, seq, chunk: int = 7) -> float:
    """Share of positions where a bfloat16 model's argmax equals transformers' float32 one."""
    logits = run_paged(model, [seq], chunk=chunk)[0]
    with torch.no_grad():
        reference = reference_model(torch.tensor([seq])).logits[0]
    return (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()


def run_aborting(engine, prompts, params, abort: tuple[int, ...] = (1, 4), at_step: int = 6):
    """Every prompt added to `engine` at once and stepped to the end, the requests at the
    `abort` indices aborted at step `at_step`. Returns (request ids, aborted ids, finished
    outputs by request id)."""
    ids = [engine.add_request(None, p, params).request_id for p in prompts]
    aborted, done, step = {ids[i] for i in abort}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        if step == at_step:
            for rid in aborted:
                engine.abort_request(rid)
    return ids, aborted, done


class LoopRowLimits:
    """A DecodeLoop over stand-in kernels that record the row limits each step is given:
    step(requests, rows_each) -> (exact_max_rows, amx_min_rows, int16_max_rows). rows_each > 1
    makes the step a verification of proposals (more rows than requests)."""

    class _KV:
        quantized, key, value = False, None, None

    def __init__(self, exact_max_rows: list[int], amx_min_rows: int, int16_max_rows: int = 0):
        from pagedllm.models.decode_loop import DecodeLoop

        self.calls = []
        self.loop = DecodeLoop(self, [], torch.zeros(1), torch.zeros(1), 1, 1e-5, 1.0, 1 << 62,
                               exact_max_rows, amx_min_rows, int16_max_rows)

    def decode_layers(self, hidden, *args):  # the kernels' entry DecodeLoop calls
        self.calls.append((args[-7], args[-6], args[-5]))  # before the 4 LoRA arguments
        return hidden, hidden

    def step(self, requests: int, rows_each: int) -> tuple:
        rows = requests * rows_each  # one single-token sequence per verified position
        meta = AttentionMetadata.build(list(range(rows)), list(range(rows + 1)), [1] * rows,
                                       [[i] for i in range(rows)], 16)
        if rows_each > 1:
            meta.num_requests = requests
        self.loop(torch.zeros(rows, 4), torch.zeros(rows, dtype=torch.long), [self._KV()], meta)
        return self.calls[-1]
