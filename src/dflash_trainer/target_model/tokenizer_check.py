"""Refuse a tokenizer rebuilt from a GGUF file that does not segment text as the model's own does.

A GGUF file stores its tokenizer as a vocabulary (and scores or merges); transformers rebuilds a
`tokenizers` model from it at load time. When that rebuild is wrong, nothing fails: every id is a
real vocabulary entry, the chat template renders, training and `eval` agree with each other (τ looks
fine), yet each text becomes other, shorter pieces than the serving stack's tokenizer makes, so the
drafter learns a token stream the served model never sees. transformers 5.17 rebuilds Gemma 3's
SentencePiece vocabulary this way: " world" → "▁w" "or" "ld" although "▁world" is one entry, which
nearly doubles the tokens of a chat corpus (checked on Gemma 3 270M; 5.18 and later segment it as
the model does).

The check: common English words whose space-prefixed form is a single vocabulary entry ("▁world",
"Ġworld", " world") must encode to that entry. A correct BPE or Unigram tokenizer keeps nearly all
of them whole; the broken rebuild splits most.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

# frequent words of prose and code; a vocabulary holds most of them whole
PROBE_WORDS = ("world", "this", "that", "with", "from", "have", "which", "their", "would", "there", "about",
               "people", "because", "between", "example", "language", "function", "return", "number", "should",
               "question", "different", "important", "following", "information")
# what `tokenizer_fingerprint` encodes: prose, code, digits and non-Latin scripts
PROBE_TEXT = ("Hello " + " ".join(PROBE_WORDS) + ".\nThe quick brown fox jumps over the lazy dog, 1234567 times!\n"
              "def area(r):\n    return 3.14159 * r ** 2  # circle\nCafé naïve — 東京タワー, Москва, 😀\n")
# the space markers of SentencePiece, byte-level BPE and plain vocabularies
_SPACE_MARKERS = ("▁", "Ġ", " ")
# a correct tokenizer may split a whole word now and then; the broken rebuild splits most of them
MAX_SPLIT_FRACTION = 0.25
MIN_WHOLE_WORDS = 8


@dataclass(frozen=True)
class WordSegmentation:
    """How a tokenizer encodes the probe words that are one vocabulary entry each.

    whole: probe words with a single-entry space-prefixed form; split: (word, its entry, the entry's
    id, the pieces the tokenizer gives instead) for those of them it encodes as several tokens.
    """

    whole: tuple[str, ...]
    split: tuple[tuple[str, str, int, tuple[str, ...]], ...]

    @property
    def broken(self) -> bool:
        """True when too many whole-entry words are split to be a correct tokenizer (see the module)."""
        return len(self.whole) >= MIN_WHOLE_WORDS and len(self.split) > MAX_SPLIT_FRACTION * len(self.whole)


def word_segmentation(tokenizer: Any) -> WordSegmentation:
    """Encode "a WORD" for each probe word whose space-prefixed form is one vocabulary entry, and
    record the words whose entry is not among the ids. tokenizer: an HF tokenizer (`get_vocab`,
    `__call__`, `convert_ids_to_tokens`)."""
    vocab = tokenizer.get_vocab()
    whole, split = [], []
    for word in PROBE_WORDS:
        entry = next((m + word for m in _SPACE_MARKERS if m + word in vocab), None)
        if entry is None:
            continue
        whole.append(word)
        ids = tokenizer(f"a {word}", add_special_tokens=False)["input_ids"]
        if vocab[entry] not in ids:
            pieces = tuple(tokenizer.convert_ids_to_tokens(ids[1:] if len(ids) > 2 else ids))
            split.append((word, entry, vocab[entry], pieces))
    return WordSegmentation(tuple(whole), tuple(split))


def check_gguf_tokenizer(tokenizer: Any, source: str) -> None:
    """Raise ValueError when the tokenizer rebuilt from the GGUF `source` splits words its vocabulary
    holds whole (module docstring): training on its ids would not match serving. The message names
    the file (and the dense copy it came from), the installed transformers, examples and the ways out."""
    seg = word_segmentation(tokenizer)
    if not seg.broken:
        return
    import transformers

    shown = "; ".join(f"' {w}' → {' '.join(pieces)} (the vocabulary has {entry!r}, id {i})"
                      for w, entry, i, pieces in seg.split[:3])
    raise ValueError(
        f"{source}: the tokenizer transformers {transformers.__version__} builds from this GGUF splits "
        f"{len(seg.split)} of {len(seg.whole)} common words that its vocabulary holds whole: {shown}. Its token "
        f"ids are not the served model's. Use a transformers release that rebuilds this vocabulary correctly "
        f"(for Gemma 3's SentencePiece vocabulary: 5.18 or later; a dense copy is written again for each "
        f"transformers version), or give the target as its Hugging Face folder.")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short digest of how `tokenizer` encodes PROBE_TEXT: 16 hex digits of the sha256 of its ids
    (no special tokens). Two tokenizers with the same fingerprint give the same ids for that text;
    the vocabulary size is left out, so one model's HF tokenizer and its GGUF's (which lists padding
    entries beyond it) agree. `prepare` records it, and training compares it with the target's
    tokenizer (data/loader.check_prepared_tokenizer). tokenizer: an HF tokenizer (`__call__`)."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    text = ",".join(str(int(i)) for i in ids)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
