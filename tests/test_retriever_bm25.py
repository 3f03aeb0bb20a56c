"""BM25's text analysis (retriever/analyzer.py) against Lucene's EnglishAnalyzer, the analyzer Search-R1's
pyserini index uses: what it keeps (digits, one-letter words, decimal numbers, words with inner
apostrophes), what it drops (Lucene's 33 English stop words, possessive 's), Porter stems as Lucene's
stemmer makes them; then the same analysis end to end, an index built with the project's builder and
queried over loopback HTTP, and an index built with the earlier tokenizer refused at start-up."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from retriever.analyzer import ANALYZER, ENGLISH_STOP_WORDS, analyze
from retriever.errors import RetrieverError
from retriever.searcher import open_index
from tests.test_retriever_support import THREADS, build_index, serve_index, write_jsonl

# EnglishAnalyzer.ENGLISH_STOP_WORDS_SET, as Lucene lists it.
LUCENE_STOP_WORDS = {
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no",
    "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to",
    "was", "will", "with",
}  # fmt: skip


def test_digits_and_one_letter_words_are_terms():
    assert analyze("Apollo 7 and vitamin C") == ["apollo", "7", "vitamin", "c"]
    assert analyze("Apollo 1 caught fire") == ["apollo", "1", "caught", "fire"]
    assert analyze("x y z 0") == ["x", "y", "z", "0"]


def test_lucene_s_english_stop_words_and_no_others_are_dropped():
    assert set(ENGLISH_STOP_WORDS) == LUCENE_STOP_WORDS
    assert analyze(" ".join(sorted(LUCENE_STOP_WORDS)).upper()) == []
    assert analyze("The Who is a band") == ["who", "band"]  # "who" is no Lucene stop word


def test_possessive_s_is_removed_after_any_apostrophe():
    assert analyze("Shakespeare's plays") == ["shakespear", "plai"]
    assert analyze("JOHN’S boss's") == ["john", "boss"]  # U+2019 and upper case too
    assert analyze("don't o'neill") == ["don't", "o'neil"]  # an inner apostrophe stays inside the word
    assert analyze("it's") == []  # "it", then a stop word


def test_porter_stems_as_lucene_s_stemmer():
    words = {"running": "run", "flights": "flight", "caresses": "caress", "ponies": "poni", "crewed": "crew",
             "generalization": "gener", "hopping": "hop", "agreed": "agre",
             # Lucene's stemmer (Porter's own code) maps -bli to -ble and -logi to -log ...
             "possibly": "possibl", "possible": "possibl", "humbly": "humbl", "archaeology": "archaeolog",
             "technological": "technolog", "biology": "biologi",  # -logi -> -log only where m > 0
             # ... undoubles any double consonant but l, s, z after -ed / -ing ...
             "trekking": "trek", "revved": "rev", "falling": "fall",
             # ... and leaves words of one or two letters alone
             "us": "us", "os": "os"}  # fmt: skip
    assert {word: analyze(word) for word in words} == {word: [stem] for word, stem in words.items()}


def test_tokens_follow_unicode_word_boundaries():
    assert analyze("pi is 3.14, about 1,000 of them") == ["pi", "3.14", "about", "1,000", "them"]
    assert analyze("the U.S.A. in 1990s") == ["u.s.a", "1990"]
    assert analyze("rock-and-roll e-mail") == ["rock", "roll", "e", "mail"]
    assert analyze("v1.2 b.1 1.b") == ["v1.2", "b", "1", "1", "b"]  # digits join digits, letters letters
    assert analyze("cafe\u0301 naïve") == ["cafe\u0301", "naïv"]  # a combining accent stays in its word
    assert analyze("毛泽东 Mao") == ["毛", "泽", "东", "mao"]  # CJK ideographs are one term each
    assert analyze("İSTANBUL ΟΔΟΣ") == ["istanbul", "οδοσ"]  # lowercased character by character, as Java
    assert analyze("snake_case __") == ["snake_cas"]
    assert analyze("x" * 300) == ["x" * 255, "x" * 45]  # StandardTokenizer's longest token
    assert analyze("") == [] and analyze(" ,.!? ") == []


PASSAGES = [
    {"id": "apollo1", "contents": '"Apollo 1"\nApollo 1 caught fire on the launch pad'},
    {"id": "apollo7", "contents": '"Apollo 7"\nApollo 7 was the first crewed Apollo flight'},
    {"id": "vitc", "contents": '"Vitamin C"\nVitamin C is found in citrus fruit'},
    {"id": "vitd", "contents": '"Vitamin D"\nVitamin D is made in the skin under sunlight'},
    {"id": "pi", "contents": '"Pi"\nPi is about 3.14'},
    {"id": "tau", "contents": '"Tau"\nTau is about 6.28'},
]


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("bm25-analyzer")
    build_index(write_jsonl(root / "c.jsonl", PASSAGES), root / "idx", "bm25")
    return root / "idx"


@pytest.mark.parametrize(("query", "first", "second"), [
    ("Apollo 7", "apollo7", "apollo1"),
    ("Apollo 1", "apollo1", "apollo7"),
    ("vitamin C", "vitc", "vitd"),
    ("vitamin D", "vitd", "vitc"),
    ("about 3.14", "pi", "tau"),
    ("Apollo's crew flights", "apollo7", "apollo1"),  # possessive and stems meet the passage's terms
])  # fmt: skip
def test_a_short_distinguishing_term_ranks_its_passage_first(bm25_index, query, first, second):
    with serve_index(bm25_index) as url:
        body = {"queries": [query], "topk": 3, "return_scores": True}
        hits = httpx.post(f"{url}/retrieve", json=body).json()["result"][0]
    assert [h["document"]["id"] for h in hits[:2]] == [first, second]
    assert hits[0]["score"] > hits[1]["score"]


def test_the_manifest_names_the_analyzer(bm25_index):
    manifest = json.loads((bm25_index / "manifest.json").read_text())
    assert manifest["bm25"]["analyzer"] == ANALYZER


def test_an_index_built_with_the_earlier_tokenizer_is_refused(bm25_index, tmp_path):
    """Its terms are unstemmed words of two letters or more: queried with this analyzer, "flights" would
    look for "flight" and miss, so the server refuses it and says to rebuild."""
    old = shutil.copytree(bm25_index, tmp_path / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["bm25"].pop("analyzer", None)
    manifest["bm25"]["stopwords"] = "en"  # what such a manifest holds instead
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        RetrieverError,
        match=r"manifest\.json: a BM25 index built with an earlier tokenizer.*"
        rf"{re.escape(ANALYZER)}.*rebuild the index",
    ) as refused:
        open_index(old, threads=THREADS)
    assert "\n" not in str(refused.value)
