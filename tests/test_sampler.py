"""Sampler: masks, penalties, seeds and logprobs tested directly on made-up logits."""
import math

import pytest
import torch

from pagedllm.core.request import SamplingParams, SamplingParamsError
from pagedllm.engine.sampler import Sampler, SamplingRow, apply_penalties, truncation_mask

V = 8


def row(**kw):
    seed = kw.pop("seed", None)
    params = SamplingParams(seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, kw.pop("prompt", [0]), [], gen)


def sample_many(logits, make_row, n=2000):
    sampler = Sampler()
    counts = torch.zeros(V)
    for _ in range(n // 50):
        rows = [make_row() for _ in range(50)]
        tokens, _ = sampler(logits.repeat(50, 1), rows)
        counts += torch.bincount(torch.tensor(tokens), minlength=V)
    return counts / counts.sum()


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 6.0]])
    tokens, logprobs = Sampler()(logits[0:1], [row(temperature=0)])
    assert tokens == [1] and logprobs == [None]
    tokens, _ = Sampler()(logits, [row(temperature=0), row(temperature=0)])
    assert tokens == [1, 7]


def test_top_k_mask_keeps_k_best():
    logits = torch.tensor([[1.0, 5, 3, 4, 2, 0, -1, -2]])
    keep = truncation_mask(logits, torch.tensor([3]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert keep[0].tolist() == [False, True, True, True, False, False, False, False]


def test_top_p_mask_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]]) + 1e-9
    keep = truncation_mask(probs.log(), torch.tensor([0]), torch.tensor([0.75]), torch.tensor([0.0]))
    assert keep[0].tolist()[:5] == [True, True, False, False, False]
    keep = truncation_mask(probs.log(), torch.tensor([0]), torch.tensor([0.85]), torch.tensor([0.0]))
    assert keep[0].tolist()[:5] == [True, True, True, False, False]
    # Top token alone exceeds p: it is still kept.
    keep = truncation_mask(probs.log(), torch.tensor([0]), torch.tensor([0.1]), torch.tensor([0.0]))
    assert keep[0].sum() == 1 and keep[0, 0]


def test_min_p_mask_relative_to_top():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.04, 0.03, 0.03, 0, 0]]) + 1e-9
    keep = truncation_mask(probs.log(), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.15]))
    assert keep[0].tolist()[:4] == [True, True, True, False]


def test_masks_are_per_row():
    logits = torch.tensor([[1.0, 5, 3, 4, 2, 0, -1, -2]]).repeat(2, 1)
    keep = truncation_mask(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert keep[0].sum() == 1 and keep[1].sum() == V


def test_temperature_one_matches_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1, -1, -2, -3]])
    freq = sample_many(logits, lambda: row(temperature=1.0), n=6000)
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.03)


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3]])
    freq = sample_many(logits, lambda: row(temperature=1.0, top_k=2), n=1000)
    assert freq[2:].sum() == 0 and freq[0] > 0.3 and freq[1] > 0.3


def test_low_temperature_concentrates():
    logits = torch.tensor([[2.0, 1.5, 0, 0, 0, 0, 0, 0]])
    hot = sample_many(logits, lambda: row(temperature=2.0), n=2000)
    cold = sample_many(logits, lambda: row(temperature=0.2), n=2000)
    assert cold[0] > 0.85 > hot[0]


def test_seed_reproduces_whatever_the_batch():
    logits = torch.randn(1, V)
    alone = [Sampler()(logits, [row(temperature=1.0, seed=7)])[0][0] for _ in range(3)]

    def in_batch(position):
        rows = [row(temperature=1.0) for _ in range(4)]
        rows[position] = row(temperature=1.0, seed=7)
        batch = torch.cat([torch.randn(position, V), logits, torch.randn(3 - position, V)])
        return Sampler()(batch, rows)[0][position]

    assert len(set(alone)) == 1
    assert {in_batch(p) for p in range(4)} == {alone[0]}
    # A seeded stream continues deterministically across steps.
    r1, r2 = row(temperature=1.0, seed=3), row(temperature=1.0, seed=3)
    seq1 = [Sampler()(logits, [r1])[0][0] for _ in range(20)]
    seq2 = [Sampler()(torch.cat([torch.randn(1, V), logits]), [row(temperature=1.0), r2])[0][1]
            for _ in range(20)]
    assert seq1 == seq2
    assert len(set(seq1)) > 1  # it is sampling, not argmax


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0, 0, 0, 0, 0]])
    r = SamplingRow(SamplingParams(repetition_penalty=2.0), [0, 1], [], None)
    out = apply_penalties(logits.clone(), [r])
    assert out[0, :3].tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties_count_output_tokens():
    logits = torch.zeros(1, V)
    r = SamplingRow(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3, 3, 3],
                    [1, 1, 1, 2], None)
    out = apply_penalties(logits.clone(), [r])
    assert out[0].tolist() == pytest.approx([0, -(0.5 + 0.75), -(0.5 + 0.25), 0, 0, 0, 0, 0])


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0, 0, 0, 0, 0, 0]])
    r = SamplingRow(SamplingParams(temperature=0, frequency_penalty=1.0), [], [0], None)
    assert Sampler()(logits, [r])[0] == [1]


def test_logprobs_of_chosen_and_top_alternatives():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0, 0, 0, 0, 0]])
    tokens, logprobs = Sampler()(logits, [row(temperature=0, logprobs=2)])
    lp = logprobs[0]
    expected = logits.log_softmax(-1)[0]
    assert lp.token_id == 0 and lp.logprob == pytest.approx(expected[0].item())
    assert [t for t, _ in lp.top] == [0, 1]
    assert lp.top[1][1] == pytest.approx(expected[1].item())
    assert math.exp(lp.logprob) < 1


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("max_tokens", 0), ("n", 0), ("logprobs", 50),
])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_inverse_cdf_never_picks_zero_probability_tokens():
    from pagedllm.engine.sampler import sample_from_probs

    # Zero mass at the ends and in the middle, including where the draw would be 0 or 1.
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(400, 1)
    tokens = sample_from_probs(probs, [row(temperature=1.0, seed=i) for i in range(400)])
    assert set(tokens.tolist()) == {1, 3}
    one_hot = torch.zeros(3, V)
    one_hot[:, V - 1] = 1.0
    assert sample_from_probs(one_hot, [row(temperature=1.0) for _ in range(3)]).tolist() == [V - 1] * 3


def test_candidate_mask_equals_full_sort_on_a_large_vocabulary():
    """Top-p / top-k / min-p look at the best 1,024 logits first and sort the whole vocabulary
    only when the kept set may run past them: same answer as sorting everything."""
    from pagedllm.engine.sampler import TRUNCATION_CANDIDATES, _full_sort_mask

    torch.manual_seed(5)
    vocab = 5000
    assert vocab > TRUNCATION_CANDIDATES
    peaked = torch.randn(4, vocab) * 6  # kept sets of a few tokens
    flat = torch.randn(4, vocab) * 0.05  # top-p 0.9 needs ~4,500 tokens: falls back
    logits = torch.cat([peaked, flat, peaked[:2], flat[:2]])
    top_k = torch.tensor([0, 0, 50, 2000, 0, 0, 3000, 10, 0, 1500, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.9, 1.0, 0.8, 1.0, 0.99, 0.7, 1.0, 0.3])
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.01, 0.0, 0.0, 0.0])
    fast = truncation_mask(logits, top_k, top_p, min_p)
    k = torch.where(top_k > 0, top_k, vocab)
    assert torch.equal(fast, _full_sort_mask(logits, k, top_p, min_p))
    assert fast[4].sum() > TRUNCATION_CANDIDATES  # a flat row really went past the candidates


def test_the_sync_free_candidate_mask_is_the_full_sorts_too():
    """On a GPU no row's need of the full sort is read: every row gets it and the rows that
    need it take it. The same mask as the host's choice."""
    from pagedllm.engine.sampler import _full_sort_mask

    torch.manual_seed(6)
    vocab = 3000
    logits = torch.cat([torch.randn(3, vocab) * 6, torch.randn(3, vocab) * 0.05])
    top_k = torch.tensor([0, 40, 1500, 0, 2500, 5])
    top_p = torch.tensor([0.9, 1.0, 0.9, 0.95, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0, 0.0])
    host = truncation_mask(logits, top_k, top_p, min_p)
    assert torch.equal(truncation_mask(logits, top_k, top_p, min_p, sync_free=True), host)
    k = torch.where(top_k > 0, top_k, vocab)
    assert torch.equal(host, _full_sort_mask(logits, k, top_p, min_p))


def _sync_free_batch(vocab):
    """Rows of every kind the sampler treats apart, seeded where they draw."""
    return [
        dict(temperature=0),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, seed=2, top_k=5),
        dict(temperature=1.2, seed=3, top_p=0.9),  # flat logits: past the candidates
        dict(temperature=0.7, seed=4, min_p=0.2),
        dict(temperature=0.9, seed=5, repetition_penalty=1.3, presence_penalty=0.5,
             frequency_penalty=0.4, prompt=[1, 2, 3]),
        dict(temperature=0, logit_bias={7: 100.0}),
        dict(temperature=1.0, seed=6, logit_bias={3: -100.0}, top_p=0.5),
    ]


def _rows(specs, vocab):
    rows = []
    for spec in specs:
        spec = dict(spec)
        prompt = spec.pop("prompt", [0])
        r = row(**spec)
        r.prompt_token_ids = prompt
        r.output_token_ids.extend([4, 4, 9 % vocab])
        rows.append(r)
    return rows


def test_a_sync_free_draw_gives_the_tokens_of_the_hosts_and_never_reads_the_device(
        monkeypatch):
    """Sampler(sync_free=True), the GPU's path, run on the CPU: the same tokens as the
    host's path for greedy, seeded, top-k/top-p/min-p (one past the candidates), penalties
    and logit_bias rows, and not one value read back to the host while it draws."""
    torch.manual_seed(7)
    vocab = 2000
    logits = torch.randn(8, vocab) * 3
    logits[3] = torch.randn(vocab) * 0.05
    specs = _sync_free_batch(vocab)
    want = Sampler(sync_free=False).draw(logits, _rows(specs, vocab))

    def read(*args, **kwargs):
        raise AssertionError("a device value read on the host while drawing")

    rows = _rows(specs, vocab)
    sampler = Sampler(sync_free=True)
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                     "nonzero", "numpy"):
            patch.setattr(torch.Tensor, name, read)
        got = sampler.draw(logits, rows)
    assert torch.equal(got, want)
    assert Sampler().sync_free is None  # by the logits' device unless a test says


def test_logit_bias_bans_and_forces_per_row_before_sampling():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1, 0, 0, 0, 0]] * 3)
    rows = [row(temperature=0, logit_bias={1: -100.0}), row(temperature=0),
            row(temperature=0.8, seed=5, logit_bias={6: 100.0})]
    tokens, logprobs = Sampler()(logits, rows)
    assert tokens == [2, 1, 6]  # banned, untouched, forced; each row its own bias
    bias_only = sample_many(torch.tensor([[0.0] * V]), lambda: row(logit_bias={3: -100.0}))
    assert bias_only[3] == 0.0 and bias_only.sum() == pytest.approx(1.0)


def test_logit_bias_logprobs_are_of_the_model():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1, 0, 0, 0, 0]])
    _, (plain,) = Sampler()(logits, [row(temperature=0, logprobs=1)])
    _, (biased,) = Sampler()(logits, [row(temperature=0, logprobs=1, logit_bias={2: 1.0})])
    assert biased.token_id == 2
    assert biased.logprob == pytest.approx(float(logits[0].log_softmax(-1)[2]))
    assert plain.token_id == 1


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101}, {-1: 1.0}, {True: 1.0},
                                  {i: 1.0 for i in range(301)}])
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(logit_bias=bias)
    assert caught.value.param == "logit_bias"
