"""The recipe's ETA by hand: the estimates of the stages left × the finished stages' pace, that pace held to
[0.5, 2]; a stage that ran 3× faster than estimated halves the rest's estimate, not thirds it."""

import io

from rich.console import Console

from dflash_trainer.recipe.progress import RecipeProgress


def progress():
    return RecipeProgress(Console(file=io.StringIO(), force_terminal=False), {"mixture": 90.0, "regenerate": 300.0,
                                                                              "train": 100.0})


def test_eta_scales_by_the_finished_pace_within_half_and_double():
    p = progress()
    assert p.eta() == 390 + 100  # nothing finished: the estimates
    p.begin("mixture", "x")
    p.end("mixture", 30.0)  # 3× faster than its 90 s: the pace 1/3 is held to 0.5
    assert p.eta() == (300 + 100) * 0.5
    q = progress()
    q.begin("mixture", "x")
    q.end("mixture", 135.0)  # 1.5× slower: taken as it is
    assert q.eta() == (300 + 100) * 1.5
    r = progress()
    r.begin("mixture", "x")
    r.end("mixture", 900.0)  # 10× slower: held to 2
    assert r.eta() == (300 + 100) * 2.0


def test_a_skipped_stage_leaves_the_estimate_and_lines_keep_their_prefix():
    out = io.StringIO()
    p = RecipeProgress(Console(file=out, force_terminal=False, width=200), {"mixture": 90.0, "train": 100.0})
    p.skip("mixture", "finished with the same inputs, skipped")
    assert p.eta() == 100.0
    assert "[recipe] mixture: finished with the same inputs, skipped" in out.getvalue()
