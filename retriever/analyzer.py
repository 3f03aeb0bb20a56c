"""BM25's text analysis: the terms of a passage at build time and of a query at search time.

It follows Lucene's EnglishAnalyzer, which Search-R1's BM25 baseline (pyserini) indexes and searches with,
step by step:

  StandardTokenizer        words at Unicode word boundaries (UAX #29), approximated: runs of letters,
                           digits and underscores (combining marks and format characters stay inside),
                           joined across ' . : between letters ("don't", "U.S.A") and across ' . , ;
                           between digits ("3.14", "1,000"), a letter run and a digit run joined ("1990s");
                           digits and one-letter words are terms; each CJK ideograph or hiragana is a term
                           of its own; a run longer than 255 characters is cut into 255-character pieces
  EnglishPossessiveFilter  a trailing 's (or ’s, ＇s) removed
  LowerCaseFilter          character by character, as Java lowercases ("İ" -> "i", every "Σ" -> "σ")
  StopFilter               Lucene's 33 English stop words (ENGLISH_STOP_WORDS)
  PorterStemFilter         Porter's stemmer as Lucene ships it (`stem`)

ANALYZER names this analysis in an index's manifest: a change to the terms any text gets must change it,
so that an index built with other terms is refused (manifest.py) instead of being searched with terms
it does not hold.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import unicodedata

ANALYZER = "lucene-english-1"
MAX_TOKEN_LENGTH = 255  # StandardTokenizer's default; longer runs are cut, as Lucene cuts them

# EnglishAnalyzer.ENGLISH_STOP_WORDS_SET.
ENGLISH_STOP_WORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no",
    "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to",
    "was", "will", "with",
})  # fmt: skip

# UAX #29's MidLetter, MidNumLet and Single_Quote join letters; MidNum, MidNumLet and Single_Quote join
# digits. Apostrophes and the period are in both.
_MID_NUM_LET = ".'\u2018\u2019\u2024\ufe52\uff07\uff0e"
_LETTER_JOINERS = frozenset(_MID_NUM_LET + ":\u00b7\u0387\u05f4\u2027\ufe13\ufe55\uff1a")
_DIGIT_JOINERS = frozenset(
    _MID_NUM_LET + ",;\u037e\u0589\u060c\u060d\u066c\u07f8\u2044\ufe10\ufe14\ufe50\ufe54\uff0c\uff1b"
)
_JOINERS = _LETTER_JOINERS | _DIGIT_JOINERS
_POSSESSIVE_APOSTROPHES = ("'", "\u2019", "\uff07")

# Script Han and Hiragana: StandardTokenizer makes each such character a token of its own.
_IDEOGRAPHIC = ((0x2E80, 0x2FDF), (0x3005, 0x3007), (0x3021, 0x3029), (0x3038, 0x303B), (0x3041, 0x309F),
                (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x1B001, 0x1B11F), (0x1F200, 0x1F200),
                (0x20000, 0x3134F))  # fmt: skip


@functools.cache
def _token_pattern() -> re.Pattern:
    """Candidate tokens: word-character runs chained by joiners. `_words` then keeps a joiner only between
    the kinds of character it joins. Built at first use: listing the marks reads the Unicode database.

    Only the Basic Multilingual Plane's marks are word characters here: re matches a class of BMP
    characters against a bitmap, but walks a list of ranges for one reaching past it, for every character
    of the text; a mark beyond it (Brahmi, musical notation) ends a word instead."""
    marks = []  # combining marks, and format characters but ZERO WIDTH SPACE, which UAX #29 breaks at
    for cp in range(0x10000):
        if cp != 0x200B and unicodedata.category(chr(cp)) in ("Mn", "Mc", "Me", "Cf"):
            if marks and marks[-1][1] == cp - 1:
                marks[-1][1] = cp
            else:
                marks.append([cp, cp])
    word = "[\\w" + "".join(f"\\u{a:04x}-\\u{b:04x}" for a, b in marks) + "]"
    joiner = "[" + "".join(f"\\u{ord(c):04x}" for c in sorted(_JOINERS)) + "]"
    return re.compile(f"{word}+(?:{joiner}{word}+)*")


def _is_ideographic(ch: str) -> bool:
    cp = ord(ch)
    return cp >= 0x2E80 and any(lo <= cp <= hi for lo, hi in _IDEOGRAPHIC)


def _kind(token: str, i: int, step: int) -> str:
    """What the character next to position i is (step -1: the one before, +1: the one after), looking
    past combining marks and format characters as UAX #29 does: "L" a letter, "D" a digit, "" neither."""
    i += step
    while 0 <= i < len(token):
        ch = token[i]
        if unicodedata.category(ch)[0] not in "MC":
            if ch.isdecimal():
                return "D"
            return "L" if ch.isalpha() and not _is_ideographic(ch) else ""
        i += step
    return ""


def _words(token: str) -> list[str]:
    """A candidate token split where UAX #29 breaks it: at a joiner that does not join, around each
    ideograph; words of underscores alone dropped, and each word cut to MAX_TOKEN_LENGTH."""
    pieces, start = [], 0
    for i, ch in enumerate(token):
        if ch in _JOINERS:
            before = _kind(token, i, -1)
            joined = before == _kind(token, i, +1) and ch in (
                _LETTER_JOINERS if before == "L" else _DIGIT_JOINERS if before == "D" else ()
            )
            if not joined:
                pieces.append(token[start:i])
                start = i + 1
        elif _is_ideographic(ch):
            pieces += [token[start:i], ch]
            start = i + 1
    pieces.append(token[start:])
    return [piece[i : i + MAX_TOKEN_LENGTH] for piece in pieces if piece.strip("_")
            for i in range(0, len(piece), MAX_TOKEN_LENGTH)]  # fmt: skip


_local = threading.local()  # PyStemmer's stemmers are not thread-safe: one per thread


def _porter(word: str) -> str:
    stemmer = getattr(_local, "porter", None)
    if stemmer is None:
        import Stemmer

        stemmer = _local.porter = Stemmer.Stemmer("porter")
    return stemmer.stemWord(word)


def _vowels(word: str) -> list[bool]:
    """Porter's vowels of `word`: a, e, i, o, u, and y after a consonant."""
    flags, after_vowel = [], False
    for i, ch in enumerate(word):
        after_vowel = ch in "aeiou" or (ch == "y" and i > 0 and not after_vowel)
        flags.append(after_vowel)
    return flags


def _measure(stem: str) -> int:
    """Porter's m: how many vowel-consonant sequences `stem` holds."""
    flags = _vowels(stem)
    return sum(v and not c for v, c in zip(flags, flags[1:], strict=False))


# Step 1b undoubles these itself (Snowball); Porter keeps l, s and z double.
_UNDOUBLED_BY_SNOWBALL_OR_KEPT = frozenset("bdfgmnprt" + "lsz")
# What step 1 turns into a final i: "...y", "...ies", "...ying", ... ("...bly" -> "...bli").
_STEP1_TAILS_TO_I = frozenset(
    {"i", "is", "y", "ys", "ies", "ied", "ieds", "iing", "iings", "yed", "yeds", "ying", "yings"}
)


def _undoubled_stem(word: str) -> str | None:
    """Step 1b's stem of `word` where Porter undoubles a final double consonant that Snowball keeps
    ("trekking" -> "trek"); None elsewhere."""
    if word.endswith("s") and not word.endswith("ss"):
        word = word[:-1]
    for suffix in ("ed", "ing"):
        if word.endswith(suffix) and not word.endswith("eed"):
            head = word[: -len(suffix)]
            if (
                len(head) >= 2
                and head[-1] == head[-2]
                and head[-1] not in _UNDOUBLED_BY_SNOWBALL_OR_KEPT
                and any(flags := _vowels(head))
                and not flags[-1]
            ):
                return head[:-1]
    return None


def stem(word: str) -> str:
    """Porter's stem of a lowercase word, as Lucene's PorterStemFilter makes it.

    PyStemmer runs Snowball's "porter". Lucene's stemmer follows Porter's own code, which differs from it in
    four places, restored here:
      - words of one or two letters are left alone;
      - step 1b undoubles any final double consonant but l, s and z that -ed or -ing leave ("trekking" ->
        "trek"), where Snowball undoubles only bb dd ff gg mm nn pp rr tt: the undoubled stem is what the
        later steps (Snowball's, run on it) see;
      - step 2 turns -bli into -ble (Snowball: -abli only), after which steps 4 and 5 run on the -ble word,
        and -logi into -log (not in Snowball).
    The last two apply where step 1 left the word ending in -bli or -logi, which the word's own ending
    shows (-bly, -blies, -logy, -logies, ...): Snowball changes such a word no further, so its result
    still ends so, while a result ending so after a later step cut a suffix is left as it is."""
    if len(word) <= 2:
        return word
    source = _undoubled_stem(word) or word
    result = _porter(source)
    head = result[:-1]
    if result.endswith("i") and source.startswith(head) and source[len(head) :] in _STEP1_TAILS_TO_I:
        if result.endswith("bli") and _measure(result[:-3]) > 0:
            result = _porter(head + "e")
        elif result.endswith("logi") and _measure(result[:-4]) > 0:
            result = head
    return result


def _lowercase(text: str) -> str:
    """Java's per-character lowercasing: Python's maps "İ" to two characters and a final "Σ" to "ς"."""
    if "\u0130" in text or "\u03a3" in text:
        text = text.replace("\u0130", "i").replace("\u03a3", "\u03c3")
    return text.lower()


@functools.lru_cache(maxsize=1 << 18)
def _terms_of(token: str) -> tuple[str, ...]:
    """The terms of one candidate token (lowercase already); a corpus repeats its tokens, so each is
    analyzed once while it stays in the cache."""
    terms = []
    for word in _words(token):
        if len(word) >= 2 and word[-1] == "s" and word[-2] in _POSSESSIVE_APOSTROPHES:
            word = word[:-2]
        if word and word not in ENGLISH_STOP_WORDS:
            terms.append(stem(word))
    return tuple(terms)


def analyze(text: str) -> list[str]:
    """The terms of `text`, in order: what BM25 indexes for a passage and looks up for a query."""
    return list(itertools.chain.from_iterable(map(_terms_of, _token_pattern().findall(_lowercase(text)))))
