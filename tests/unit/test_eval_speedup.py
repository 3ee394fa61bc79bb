"""The speedup table of `eval --batch-sizes` (evaluation/speedup.py): its rows, its consistency with
the engine, the honest sentence for slow-downs, the PNG curve, and the flag's parsing."""

from __future__ import annotations

import pytest
from test_eval_common import target_and_drafter, word_tokenizer

from dflash_trainer.evaluation.plots import plot_speedup
from dflash_trainer.evaluation.settings import EvalSettings, check_eval_settings, parse_batch_sizes
from dflash_trainer.evaluation.speedup import choice_sentence, speed_sentence, speedup_table

pytestmark = pytest.mark.usefixtures("one_thread")


def test_speed_sentence_says_slower_below_one():
    """Prevents the old wording "makes decoding 0.77× slower" (which reads as a 23 % or 77 % loss
    depending on the reader): below 1× the sentence says slower and gives the fraction of plain speed."""
    assert speed_sentence(0.77) == "slower: 0.77× the plain speed"
    assert speed_sentence(2.1) == "faster: 2.10× the plain speed"
    assert speed_sentence(1.0).startswith("faster")
    rec = {"chosen_draft_length": 1, "full_draft_length": 3, "chosen_predicted_speedup": 1.5, "chosen_speedup": 1.42}
    assert choice_sentence(rec) == "draft length 1 of 3 (predicted 1.50×): faster: 1.42× the plain speed"
    assert choice_sentence({**rec, "chosen_draft_length": 0}) == "draft length 0 of 3: plain decoding"


def test_table_rows_are_whole_cycles_streamed_and_agree_across_batch_sizes(tmp_path):
    """Each batch size decodes the prompts in whole cycles, at least 4 · b rows (3 prompts: 6 rows at
    b = 1, 9 at b = 2, 18 at b = 4), as a continuous batch; every prompt is equally often in the rows, so τ
    and tokens are the same at every batch size (a row decodes as it would alone); speeds are the
    steady ones, parts of the whole streams; lossless at T = 0; the curve is a PNG."""
    from dflash_trainer.evaluation.speedup import table_rows

    assert table_rows([[1], [2], [3]], 2) == [[1], [2], [3]] * 3  # the docstring's example: 9 rows
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    prompts = [[5, 6, 7], [8, 3], [4, 9, 10, 5, 6]]
    table = speedup_table(bundle, drafter, prompts, [1, 2, 4], max_new_tokens=12, cuda_graph=False)
    assert [(r["batch_size"], r["rows"]) for r in table] == [(1, 6), (2, 9), (4, 18)]
    assert all(r["lossless"] is True and 1.0 <= r["tau"] <= 4.0 for r in table)
    assert table[0]["tau"] == table[1]["tau"] == pytest.approx(table[2]["tau"])
    assert table[0]["tokens"] / 2 == table[1]["tokens"] / 3 == table[2]["tokens"] / 6  # tokens per cycle
    for r in table:
        assert 0 < r["speculative_steady_tokens"] < r["tokens"]
        assert 0 < r["speculative_steady_s"] < r["speculative_wall_s"]
        assert r["speculative_tokens_per_s"] == pytest.approx(r["speculative_steady_tokens"] / r["speculative_steady_s"])
        assert r["plain_tokens_per_s"] == pytest.approx(r["plain_steady_tokens"] / r["plain_steady_s"])
        assert r["speedup"] == pytest.approx(r["speculative_tokens_per_s"] / r["plain_tokens_per_s"])
    png = plot_speedup(table, tmp_path / "curve.png", title="tiny")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sampled = speedup_table(bundle, drafter, prompts, [2], max_new_tokens=6, temperature=0.8, cuda_graph=False)
    assert sampled[0]["lossless"] is None and sampled[0]["rows"] == 9


def test_batch_sizes_flag_and_dtype_are_checked():
    """Bad --batch-sizes / --dtype values fail before any model loads, naming the flag and an example."""
    assert parse_batch_sizes("1,4,16") == [1, 4, 16] and parse_batch_sizes(None) is None
    for bad in ("1,x", "0,4", ","):
        with pytest.raises(ValueError, match="--batch-sizes"):
            parse_batch_sizes(bad)
    with pytest.raises(ValueError, match="--dtype 'fp8': pass one of auto, float32, bfloat16"):
        check_eval_settings(EvalSettings(drafter="x", dtype="fp8"))


def test_the_measurement_decides_the_recommended_draft_length():
    """The prediction picks which k to measure; the fastest measured of plain (k 0, 1.0×), that k and all
    drafts is served; a k that was not lossless is never served; the smaller k wins a tie."""
    from dflash_trainer.evaluation.speedup import recommend

    rec = {"full_draft_length": 7, "speedup": 1.30, "lossless": True, "chosen_draft_length": 3,
           "chosen_speedup": 1.25, "chosen_lossless": True}
    assert recommend(rec) == (7, 1.30)  # the predicted k = 3 measured slower than all drafts
    assert recommend({**rec, "chosen_speedup": 1.4}) == (3, 1.4)
    assert recommend({**rec, "speedup": 0.8, "chosen_speedup": 0.9}) == (0, 1.0)  # both slower than plain
    assert recommend({**rec, "chosen_speedup": 1.4, "chosen_lossless": False}) == (7, 1.30)
    assert recommend({**rec, "chosen_speedup": 1.30}) == (3, 1.30)  # a tie: the smaller k
