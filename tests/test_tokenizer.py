"""Tokenizer: GGUF and tokenizer.json, chat templates, streaming detokenization."""
import os

import gguf
import pytest

from pagedllm.tokenizer import ChatTemplateError, Tokenizer
from pagedllm.weights import default_model_path

TEXTS = [
    "Hello world! 12345 héllo",
    "你好，世界。こんにちは 🎉🚀 👩‍👩‍👧",
    "  leading spaces\n\n\ttabs and\r\nnewlines  ",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def smollm():
    return Tokenizer.from_model_path(None)


@pytest.fixture(scope="module")
def hf_smollm_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_exact(smollm, text):
    assert smollm.decode(smollm.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TEXTS[:4])
def test_encoding_matches_transformers(smollm, hf_smollm_tokenizer, text):
    assert smollm.encode(text) == hf_smollm_tokenizer(text)["input_ids"]


def test_smollm_adds_no_bos_and_knows_eos(smollm):
    assert smollm.encode("Hi")[0] != smollm.bos_token_id
    assert smollm.eos_token_ids == (2,)
    assert smollm.encode("<|im_end|>") == [2]  # special tokens are never split


def test_chat_template_renders_chatml(smollm):
    text = smollm.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    with_system = smollm.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False)
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_is_sandboxed():
    from tokenizers import Tokenizer as HFTok, models
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(HFTok(models.BPE({"a": 0}, [])), bos_token_id=None, add_bos=False,
                    eos_token_ids=(), chat_template=evil)
    with pytest.raises(Exception) as info:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert "unsafe" in str(info.value).lower() or isinstance(info.value, ChatTemplateError)


def test_template_raise_exception_is_a_clear_error():
    from tokenizers import Tokenizer as HFTok, models
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    tok = Tokenizer(HFTok(models.BPE({"a": 0}, [])), bos_token_id=None, add_bos=False,
                    eos_token_ids=(), chat_template=template)
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_no_template_is_a_clear_error():
    from tokenizers import Tokenizer as HFTok, models
    tok = Tokenizer(HFTok(models.BPE({"a": 0}, [])), bos_token_id=None, add_bos=False,
                    eos_token_ids=(), chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", TEXTS[:4])
def test_streaming_detokenization_equals_one_shot(smollm, text):
    ids = smollm.encode(text)
    detok = smollm.new_detokenizer()
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == smollm.decode(ids)
    for piece in pieces:  # never half a character
        assert "\ufffd" not in piece


def test_streaming_after_a_prompt(smollm):
    prompt = smollm.encode("The answer is")
    out = smollm.encode(" 42, said 你好 🎉 the machine")
    detok = smollm.new_detokenizer(prompt)
    assert "".join(detok.step(i) for i in out) == smollm.decode(prompt + out)[len("The answer is"):]


def test_tokenizer_json_folder(tiny_llama_folder):
    tok = Tokenizer.from_folder(tiny_llama_folder)
    text = "héllo 🎉 <|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids == (256,)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _write_spm_gguf(path):
    """A llama-style SentencePiece BPE vocabulary: ▁-prefixed pieces, scores, byte fallback."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "llo", "▁he", "▁hello",
             "▁w", "or", "▁wor", "ld", "▁world", "!"]
    tokens = pieces + words
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}, tokens


def test_sentencepiece_gguf_tokenizer(tmp_path):
    meta, tokens = _write_spm_gguf(tmp_path / "spm.gguf")
    tok = Tokenizer.from_gguf_metadata(str(tmp_path / "spm.gguf"), meta)
    ids = tok.encode("hello world!")
    assert ids[0] == 1  # llama-style models add BOS by default
    assert [tokens[i] for i in ids[1:]] == ["▁hello", "▁world", "!"]
    assert tok.decode(ids) == "hello world!"
    # Characters outside the vocabulary fall back to bytes and come back intact.
    ids = tok.encode("hello 你")
    assert tok.decode(ids) == "hello 你"
    assert any(tokens[i].startswith("<0x") for i in ids)


def test_unknown_tokenizer_model_is_reported(tmp_path):
    from pagedllm.weights import ModelLoadError
    with pytest.raises(ModelLoadError, match="x.gguf.*unknown tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata(str(tmp_path / "x.gguf"),
                                     {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_encode_within_refuses_long_texts_early_and_leaves_short_ones_alone():
    from pagedllm.tokenizer import TokenLimitError, Tokenizer

    tok = Tokenizer.from_model_path(None)
    text = " ".join(f"word{i % 97}" for i in range(20_000))  # ~40,000 tokens, 170k characters
    assert tok.encode_within(text, 100_000) == tok.encode(text)
    whole = tok.encode(text * 4)
    with pytest.raises(TokenLimitError) as info:
        tok.encode_within(text * 4, 1_000)
    assert 1_000 < info.value.num_tokens <= len(whole)  # a lower bound past the limit
    with pytest.raises(TokenLimitError) as far:
        tok.encode_within("x" * 10_000_000, 8192)  # refused from its length alone
    assert far.value.num_tokens == 10_000_000 // tok.max_token_chars
    short = "The capital of France is"
    assert tok.encode_within(short, 10) == tok.encode(short)


# -- GGUF pre-tokenizers against transformers' own definitions --------------------------------

MIXED = ("Prices: 1234567 and 3.14159; café and cafe\u0301 (decomposed), 你好世界，こんにちは "
         "🎉🚀 👩‍👩‍👧\n\n\tdef f(x):\n        return x ** 2  # it's fine, we'll see\r\n   end   ")


@pytest.fixture(scope="module")
def smollm_meta():
    from pagedllm.weights.gguf import read_gguf_header

    return read_gguf_header(default_model_path())[1]


def _reference(pre, meta):
    """The family's tokenizer as transformers defines it, on the default model's vocabulary:
    Qwen2's converter (NFC, its split regex), or the tiktoken converter's default pattern,
    Llama 3's (digits in threes)."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import Qwen2Converter, TikTokenConverter

    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    if pre == "qwen2":
        return Qwen2Converter(None).converted(vocab, merges)
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TikTokenConverter().pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_gguf_pre_tokenizer_equals_the_familys(smollm_meta, pre):
    ours = Tokenizer.from_gguf_metadata(default_model_path(),
                                        {**smollm_meta, "tokenizer.ggml.pre": pre})
    reference = _reference(pre, smollm_meta)
    for text in [MIXED, *TEXTS[:4]]:
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text).ids, text


def test_the_pre_tokenizer_name_changes_the_split(smollm_meta):
    """Guards the test above: the names are not read past (digits in threes, one by one,
    and NFC for Qwen2 only)."""
    encode = {pre: Tokenizer.from_gguf_metadata(default_model_path(),
                                                {**smollm_meta, "tokenizer.ggml.pre": pre})
              for pre in ("llama-bpe", "qwen2", "smollm")}
    pieces = {pre: [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("1234567")]
              for pre, tok in encode.items()}
    assert pieces["llama-bpe"] == ["123", "456", "7"]
    assert pieces["qwen2"] == pieces["smollm"] == list("1234567")
    nfc = {pre: tok.encode("cafe\u0301", add_special_tokens=False) for pre, tok in encode.items()}
    assert nfc["qwen2"] == encode["qwen2"].encode("caf\u00e9", add_special_tokens=False)
    assert nfc["qwen2"] != nfc["llama-bpe"]


def test_an_unknown_pre_tokenizer_is_refused_by_name(smollm_meta):
    from pagedllm.weights import ModelLoadError

    with pytest.raises(ModelLoadError, match="tokenizer.ggml.pre 'tekken'.*qwen2"):
        Tokenizer.from_gguf_metadata(default_model_path(),
                                     {**smollm_meta, "tokenizer.ggml.pre": "tekken"})
