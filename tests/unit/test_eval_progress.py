"""Progress of eval: a line per finished turn at batch 1 (the CPU default) and per batch above it,
heartbeats during a long turn, and the CPU default of `--max-prompts`. No wall-clock assertions:
heartbeats use a fake clock."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console
from test_eval_common import CHATML, target_and_drafter, word_tokenizer

from dflash_trainer.evaluation import progress as progress_mod
from dflash_trainer.evaluation.progress import (CPU_DEFAULT_MAX_NEW_TOKENS, CPU_DEFAULT_MAX_PROMPTS,
                                                DEFAULT_MAX_NEW_TOKENS, TurnProgress, cpu_defaults)
from dflash_trainer.evaluation.run import EvalSettings, evaluate, run_eval
from dflash_trainer.data.suites import EvalPrompt
from dflash_trainer.interop.checkpoint_files import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [EvalPrompt(id="one", user_turns=["w10 w11 w12"]),
           EvalPrompt(id="two", user_turns=["w20 w21", "w30 w31 w32 w33"], system="w5 w6")]
TURN_LINE = re.compile(r"prompt (\d+)/(\d+) turn (\d+)/(\d+) \((\w+)\): (\d+) tokens, speculative [\d.]+ tok/s "
                       r"\(plain [\d.]+\), τ [\d.]+, τ so far [\d.]+ · (\d+)/(\d+) turns, elapsed \d+:\d\d, "
                       r"ETA \d+:\d\d")


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=400, color_system=None), buf


def _bundle_with_tokenizer():
    bundle, drafter = target_and_drafter(block_size=4)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    return bundle, drafter


def test_a_line_per_finished_turn():
    """Prevents a CPU eval that prints nothing until the last prompt is done (minutes of silence)."""
    bundle, drafter = _bundle_with_tokenizer()
    console, buf = _console()
    evaluate(bundle, drafter, PROMPTS, chat_template=CHATML, max_new_tokens=12, console=console)
    lines = buf.getvalue().splitlines()
    turns = [m.groups() for m in map(TURN_LINE.search, lines) if m]
    assert [(g[0], g[2], g[3], g[4], g[6]) for g in turns] == [("1", "1", "1", "one", "1"), ("2", "1", "2", "two", "2"),
                                                               ("2", "2", "2", "two", "3")]
    assert all(g[1] == "2" and g[7] == "3" for g in turns)
    first = next(i for i, line in enumerate(lines) if "decoding prompt 1/2 turn 1/1" in line)
    assert first < next(i for i, line in enumerate(lines) if TURN_LINE.search(line))  # announced before it ends


def test_a_line_per_batch():
    """Above batch 1 a line per batch names the turn and the prompts it holds (a batch of one names its
    prompt), and counts their turns."""
    bundle, drafter = _bundle_with_tokenizer()
    console, buf = _console()
    evaluate(bundle, drafter, PROMPTS, chat_template=CHATML, max_new_tokens=12, console=console, batch_size=2,
             offline=False)
    lines = [line for line in buf.getvalue().splitlines() if "tokens, speculative" in line]
    assert [line.split(":")[0].strip() for line in lines] == ["turn 1 prompts 1-2/2", "prompt 2/2 turn 2/2 (two)"]
    assert "· 2/3 turns" in lines[0] and "· 3/3 turns" in lines[1]


def test_heartbeats_inside_a_long_turn(monkeypatch):
    """Prevents silence during one long turn: with a 0 s heartbeat every committed token (plain)
    or round (speculative) prints a line naming the phase and the tokens so far."""
    monkeypatch.setattr(progress_mod, "HEARTBEAT_S", 0.0)
    bundle, drafter = _bundle_with_tokenizer()
    console, buf = _console()
    evaluate(bundle, drafter, PROMPTS[:1], chat_template=CHATML, max_new_tokens=6, console=console, offline=False)
    beats = [line for line in buf.getvalue().splitlines() if line.strip().startswith("…")]
    assert any("plain decoding, 1 tokens so far" in b for b in beats)
    assert any("speculative decoding" in b for b in beats)


def test_heartbeat_every_ten_seconds_of_a_fake_clock():
    """Prevents heartbeats flooding the log (one per token) or never coming."""
    now = [0.0]
    console, buf = _console()
    p = TurnProgress(console, num_turns=6, clock=lambda: now[0])
    p.begin("prompt 1/3 turn 1/2", "a")
    p.phase("plain decoding")
    for t in range(1, 60):  # 0.5 s per token: 29.5 s
        now[0] += 0.5
        p.tick(t)
    beats = [line for line in buf.getvalue().splitlines() if "tokens so far" in line]
    assert [b.split("decoding, ")[1].split(" tokens")[0] for b in beats] == ["20", "40"]
    assert "prompt 1/3 turn 1/2: plain decoding" in beats[0]
    now[0] += 0.5  # 30 s in: 1 of 6 turns done, 5 left at 30 s each
    # 8 tokens: the prefill's and 7 committed by 3 rounds (offered 2 + 3 + 4: the cap cut the last): τ = 7/3
    p.end(1, 8, 6, [1, 2, 3], 7, 10.0, 5.0)
    line = buf.getvalue().splitlines()[-1]
    assert "8 tokens, speculative 1.6 tok/s (plain 0.6), τ 2.33, τ so far 2.33 · 1/6 turns, elapsed 0:30, ETA 2:30" in line
    p.end(1, 4, 4, [2], 3, 1.0, 1.0)  # so far: (7 + 3) committed over (3 + 1) rounds
    assert "τ 3.00, τ so far 2.50 · 2/6 turns" in buf.getvalue().splitlines()[-1]


@pytest.mark.parametrize("given,device,expect", [
    ((None, None), "cpu", (CPU_DEFAULT_MAX_PROMPTS, CPU_DEFAULT_MAX_NEW_TOKENS)),
    ((None, None), "cuda", (None, DEFAULT_MAX_NEW_TOKENS)),
    ((7, None), "cpu", (7, CPU_DEFAULT_MAX_NEW_TOKENS)), ((None, 300), "cpu", (CPU_DEFAULT_MAX_PROMPTS, 300)),
    ((0, 64), "cpu", (0, 64)), ((3, 32), "cuda", (3, 32)),
])
def test_cpu_defaults(given, device, expect):
    """Prevents an unbounded CPU eval by default (all 80 MT-Bench prompts at 256 tokens: hours),
    a given value being replaced, and changed GPU defaults."""
    n, tokens, note = cpu_defaults(*given, device)
    assert (n, tokens) == expect
    assert (note is not None) == (device == "cpu" and None in given)


def test_run_eval_applies_the_cpu_default(tmp_path):
    """The defaults reach the run: a chat file longer than the default, no max_prompts and no
    max_new_tokens, device cpu → the CPU defaults, recorded in the result's settings."""
    bundle, drafter = _bundle_with_tokenizer()
    bundle.model.save_pretrained(tmp_path / "target")
    bundle.tokenizer.save_pretrained(tmp_path / "target")
    save_checkpoint(tmp_path / "ck", drafter.trainable_state_dict(), drafter.config, {"chat_template": CHATML})
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"w{i} w{i + 1}"},
                                                         {"role": "assistant", "content": "w9"}]})
                               for i in range(10, 10 + CPU_DEFAULT_MAX_PROMPTS + 3)) + "\n")
    console, buf = _console()
    r = run_eval(EvalSettings(drafter=str(tmp_path / "ck"), target=str(tmp_path / "target"), dataset=str(chats),
                              device="cpu", offline=False), console)
    assert r["num_prompts"] == CPU_DEFAULT_MAX_PROMPTS == r["settings"]["max_prompts"]
    assert r["max_new_tokens"] == CPU_DEFAULT_MAX_NEW_TOKENS == r["settings"]["max_new_tokens"]
    out = buf.getvalue()
    assert f"the first {CPU_DEFAULT_MAX_PROMPTS} prompts" in out and "--max-prompts N for more" in out
    assert out.index("loading target") < out.index("warming up") < out.index("decoding prompt 1/")
