"""A tokenizer rebuilt from a GGUF that splits words its vocabulary holds whole is refused
(target_model/tokenizer_check.py); real tokenizers pass."""

from __future__ import annotations

import string

import pytest
import torch
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import Unigram
from transformers import PreTrainedTokenizerFast

from dflash_trainer.target_model import load as load_mod
from dflash_trainer.target_model.tokenizer_check import PROBE_WORDS, check_gguf_tokenizer, word_segmentation


def _unigram(whole_word_score: float) -> PreTrainedTokenizerFast:
    """A SentencePiece-style Unigram tokenizer: single characters (score -1 each, with and without '▁')
    and every probe word as one '▁word' entry scored `whole_word_score`. Scored -2 the whole words win
    (a correct vocabulary); scored -50, every word splits into characters (the failure of a wrong
    rebuild, which ranks pieces above the words that contain them)."""
    chars = list(string.ascii_lowercase)
    vocab = [("<unk>", 0.0), ("▁", -1.0)] + [(c, -1.0) for c in chars] + [("▁" + c, -1.0) for c in chars]
    vocab += [("▁" + w, whole_word_score) for w in PROBE_WORDS]
    tok = Tokenizer(Unigram(vocab, unk_id=0))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_whole_words_pass_and_split_words_are_refused():
    good, bad = _unigram(-2.0), _unigram(-50.0)
    assert good.convert_ids_to_tokens(good("a world", add_special_tokens=False)["input_ids"]) == ["▁a", "▁world"]
    assert bad.convert_ids_to_tokens(bad("a world", add_special_tokens=False)["input_ids"]) == [
        "▁a", "▁w", "o", "r", "l", "d"]
    seg = word_segmentation(good)
    assert seg.whole == PROBE_WORDS and seg.split == () and not seg.broken
    check_gguf_tokenizer(good, "good.gguf")
    seg = word_segmentation(bad)
    assert len(seg.split) == len(PROBE_WORDS) and seg.broken
    world_id = bad.get_vocab()["▁world"]
    assert seg.split[0] == ("world", "▁world", world_id, ("▁w", "o", "r", "l", "d"))
    with pytest.raises(ValueError, match=r"bad\.gguf: the tokenizer transformers .* splits 25 of 25 common words"
                                         rf".*' world' → ▁w o r l d \(the vocabulary has '▁world', id {world_id}\)"
                                         r".*5\.18 or later"):
        check_gguf_tokenizer(bad, "bad.gguf")


def test_a_few_split_words_or_a_small_vocabulary_pass():
    """A correct tokenizer may split a word now and then (≤ 25 %), and a vocabulary holding fewer than
    8 probe words whole says too little to judge: neither is refused."""
    seg = word_segmentation(_unigram(-2.0))
    def split(words):
        return tuple((w, "▁" + w, 0, ("x",)) for w in words)

    assert not type(seg)(seg.whole, split(seg.whole[:6])).broken  # 6 of 25
    assert type(seg)(seg.whole, split(seg.whole[:7])).broken  # 7 of 25
    assert not type(seg)(seg.whole[:7], split(seg.whole[:7])).broken  # 7 whole words: too few to judge


def test_real_tokenizers_keep_the_probe_words_whole(qwen3_tok):
    """The embedded SmolLM2 GGUF (byte-level BPE rebuilt by transformers) and the real Qwen3 tokenizer
    hold every probe word whole and encode each as its one entry."""
    smol = load_mod.load_tokenizer(None)
    for tok in (smol, qwen3_tok):
        seg = word_segmentation(tok)
        assert seg.whole == PROBE_WORDS and seg.split == ()


def test_loading_a_gguf_runs_the_check(monkeypatch):
    """load_tokenizer refuses a GGUF whose rebuilt tokenizer splits words, naming the file."""
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _unigram(-50.0))
    monkeypatch.setattr(load_mod.gguf_cache, "dense_copy", lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf: the tokenizer .* splits"):
        load_mod.load_tokenizer(None)


def test_a_dense_copy_is_checked_before_the_weights_load(monkeypatch, tmp_path):
    """A tokenizer read from the GGUF's dense copy is checked too, and load_target refuses it before
    any weights load; the message names the copy."""
    import transformers

    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **k: calls.append(path)
                        or _unigram(-50.0))
    monkeypatch.setattr(load_mod.gguf_cache, "dense_copy", lambda *a, **k: tmp_path)

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the tokenizer check")

    monkeypatch.setattr(load_mod, "_from_pretrained", no_weights)
    with pytest.raises(ValueError, match=rf"Q4_1\.gguf \(its dense copy {tmp_path}\): the tokenizer .* splits"):
        load_mod.load_target(None, device="cpu", dtype=torch.float32)
    assert calls == [str(tmp_path)]  # read from the copy, not rebuilt from the GGUF
