"""Progress lines of one-sequence eval (the CPU path): one line per finished turn, and a heartbeat
while a long turn decodes, so a person watching a CPU eval sees it move within seconds.

    prompt 3/8 turn 1/2 (mt-bench-83): 256 tokens, speculative 41.3 tok/s (plain 38.0), τ 1.52,
        τ so far 1.48 · 5/16 turns, elapsed 1:53, ETA 4:10
    … prompt 3/8 turn 2/2: speculative decoding, 120 tokens so far (12 s into the turn)

τ so far is over every round of the finished turns (as the final τ); the ETA is the mean wall of
the finished turns times the turns left (the offline τ pass after the last turn is not in it).
Also the CPU defaults of `--max-prompts` and `--max-new-tokens` and what they cost (`cpu_defaults`).
"""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console

from dflash_trainer.evaluation.acceptance import summarize_rounds

HEARTBEAT_S = 10.0
DEFAULT_MAX_NEW_TOKENS = 256  # `eval --max-new-tokens` default (GPU and CPU alike when given)
# CPU defaults of `eval` when --max-prompts / --max-new-tokens are not given (GPU: all prompts,
# DEFAULT_MAX_NEW_TOKENS). Measured 2026-12-02 on the shared 2-core CPU machine, embedded
# SmolLM2-135M, a 3-layer B=8 drafter barely trained (τ 1.0: the slow case; a trained drafter
# decodes faster), MT-Bench (2 turns per prompt), plain + speculative decoding of every turn:
#   128 new tokens, load 1-2 from other jobs: 55 s per prompt (plain 13.2 tok/s, speculative
#       5.9 tok/s); the whole default command took 2 min 29 s (27 s target load, 7 s offline τ);
#   256 new tokens, load 3-6: 3 min 28 s per prompt (plain 12.4 tok/s, speculative 3.1 tok/s).
CPU_DEFAULT_MAX_PROMPTS = 2
CPU_DEFAULT_MAX_NEW_TOKENS = 128
PER_PROMPT_CPU_S = (55, 105)  # at CPU_DEFAULT_MAX_NEW_TOKENS: light and heavy load (estimated from 256 tokens)


def cpu_defaults(max_prompts: int | None, max_new_tokens: int | None,
                 device_type: str) -> tuple[int | None, int, str | None]:
    """(prompts, new tokens per turn, a note or None) of an eval on `device_type`: on the CPU the
    values not given become CPU_DEFAULT_MAX_PROMPTS / CPU_DEFAULT_MAX_NEW_TOKENS (the note says
    so and what it costs); elsewhere all prompts and DEFAULT_MAX_NEW_TOKENS. max_prompts 0 = all."""
    if device_type != "cpu" or (max_prompts is not None and max_new_tokens is not None):
        return max_prompts, max_new_tokens or DEFAULT_MAX_NEW_TOKENS, None
    chosen = []
    if max_prompts is None:
        max_prompts = CPU_DEFAULT_MAX_PROMPTS
        chosen.append(f"the first {max_prompts} prompts (--max-prompts N for more, 0 for all)")
    if max_new_tokens is None:
        max_new_tokens = CPU_DEFAULT_MAX_NEW_TOKENS
        chosen.append(f"at most {max_new_tokens} new tokens per turn (--max-new-tokens; GPU default "
                      f"{DEFAULT_MAX_NEW_TOKENS})")
    low, high = PER_PROMPT_CPU_S
    return max_prompts, max_new_tokens, (f"CPU eval defaults: {' and '.join(chosen)}; with SmolLM2-135M on 2 "
                                         f"shared cores a 2-turn prompt costs {low}-{high} s at "
                                         f"{CPU_DEFAULT_MAX_NEW_TOKENS} tokens")


def _clock_text(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class TurnProgress:
    """Prints the progress of one-sequence eval on `console`.

    Call `begin(prompt_index, prompt_id, turn, turns_in_prompt)` before a turn, `phase(name)` when
    it switches between plain and speculative decoding, `tick(tokens)` after each committed token
    (prints a heartbeat when `heartbeat_s` passed since the last line) and `end(...)` when the turn
    is done. `clock` is injectable for tests.
    """

    def __init__(self, console: Console, *, num_prompts: int, num_turns: int, block_size: int,
                 heartbeat_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.console, self.num_prompts, self.num_turns, self.B = console, num_prompts, num_turns, block_size
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s  # None: the module's (patchable)
        self.clock = clock
        self.start = self.last_line = self.turn_start = clock()
        self.done = 0
        self.accepted: list[int] = []  # n per round over the finished turns
        self.where = ""
        self.phase_name = ""

    def _print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)
        self.last_line = self.clock()

    def begin(self, prompt_index: int, prompt_id: str, turn: int, turns_in_prompt: int) -> None:
        """A turn starts (prompt_index and turn 0-based)."""
        self.where = f"prompt {prompt_index + 1}/{self.num_prompts} turn {turn + 1}/{turns_in_prompt}"
        self.prompt_id = prompt_id
        self.turn_start = self.clock()
        if self.done == 0 and prompt_index == 0 and turn == 0:
            self._print(f"  decoding {self.where} ({prompt_id}): plain, then speculative; a line per finished turn")

    def phase(self, name: str) -> None:
        """The turn moves to `name` ("plain decoding", "speculative decoding")."""
        self.phase_name = name

    def tick(self, tokens: int) -> None:
        """`tokens` committed so far in the current phase; a heartbeat line every `heartbeat_s`."""
        now = self.clock()
        if now - self.last_line >= self.heartbeat_s:
            self._print(f"  … {self.where}: {self.phase_name}, {tokens} tokens so far "
                        f"({now - self.turn_start:.0f} s into the turn)")

    def end(self, tokens: int, plain_tokens: int, accepted: list[int], plain_wall_s: float,
            spec_wall_s: float) -> None:
        """The turn is done: its speculative and plain token counts, accepted drafts per round and
        both walls."""
        self.done += 1
        self.accepted += accepted
        tau = summarize_rounds({"turn": accepted}, self.B)["tau"]
        tau_all = summarize_rounds({"all": self.accepted}, self.B)["tau"]
        elapsed = self.clock() - self.start
        eta = elapsed / self.done * (self.num_turns - self.done)
        fmt = (lambda x: "-" if x is None else f"{x:.2f}")
        self._print(f"  {self.where} ({self.prompt_id}): {tokens} tokens, speculative "
                    f"{tokens / max(spec_wall_s, 1e-9):.1f} tok/s (plain {tokens / max(plain_wall_s, 1e-9):.1f}), "
                    f"τ {fmt(tau)}, τ so far {fmt(tau_all)} · {self.done}/{self.num_turns} turns, "
                    f"elapsed {_clock_text(elapsed)}, ETA {_clock_text(eta)}")
