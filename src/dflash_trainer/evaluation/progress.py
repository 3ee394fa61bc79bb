"""Progress lines of eval: one line per decoded batch (per turn at batch 1, the CPU default), and a
heartbeat while a long batch decodes, so a person watching a CPU eval sees it move within seconds.

    prompt 3/8 turn 1/2 (mt-bench-83): 256 tokens, speculative 41.3 tok/s (plain 38.0), τ 1.52,
        τ so far 1.48 · 5/16 turns, elapsed 1:53, ETA 4:10
    … prompt 3/8 turn 2/2: speculative decoding, 120 tokens so far (12 s into the batch)
    turn 1/2 prompts 1-64/80: 16384 tokens, speculative … · 64/160 turns, …

τ so far is over every round of the finished turns (as the final τ); the ETA is the mean wall of
the finished turns times the turns left (the offline τ pass after the last turn is not in it).
Also the CPU defaults of `--max-prompts` and `--max-new-tokens` and what they cost (`cpu_defaults`).
"""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console

from dflash_trainer.decoding.acceptance import tau

HEARTBEAT_S = 10.0
DEFAULT_MAX_NEW_TOKENS = 256  # `eval --max-new-tokens` default (GPU and CPU alike when given)
# CPU defaults of `eval` when --max-prompts / --max-new-tokens are not given (GPU: all prompts,
# DEFAULT_MAX_NEW_TOKENS); their cost as measured 2026-12-02 on the shared 2-core CPU machine with the
# embedded SmolLM2-135M and a barely trained drafter (τ 1.0, the slow case): docs/eval.md "CPU defaults".
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
    """Prints the progress of eval on `console`, a line per decoded batch (a turn at batch 1).

    Call `begin(where, label)` before a batch ("prompt 3/8 turn 1/2", "(mt-bench/83)"), `phase(name)`
    when it switches between plain and speculative decoding, `tick(tokens)` at every host look of
    the engine (prints a heartbeat when HEARTBEAT_S passed since the last line) and `end(...)`
    when the batch is done. `clock` is injectable for tests.
    """

    def __init__(self, console: Console, *, num_turns: int, clock: Callable[[], float] = time.monotonic):
        self.console, self.num_turns, self.clock = console, num_turns, clock
        self.start = self.last_line = self.turn_start = clock()
        self.done = 0
        self.rounds = self.committed = 0  # verify rounds and the tokens they committed, over the finished turns
        self.where = self.label = self.phase_name = ""

    def _print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)
        self.last_line = self.clock()

    def begin(self, where: str, label: str = "") -> None:
        """A batch starts: `where` names it, `label` (e.g. the prompt id) follows in parentheses."""
        self.where, self.label = where, f" ({label})" if label else ""
        self.turn_start = self.clock()
        if self.done == 0:
            self._print(f"  decoding {where}{self.label}: plain, then speculative; a line per finished batch")

    def phase(self, name: str) -> None:
        """The batch moves to `name` ("plain decoding", "speculative decoding")."""
        self.phase_name = name

    def tick(self, tokens: int) -> None:
        """`tokens` committed so far in the current phase; a heartbeat line every HEARTBEAT_S."""
        now = self.clock()
        if now - self.last_line >= HEARTBEAT_S:
            self._print(f"  … {self.where}: {self.phase_name}, {tokens} tokens so far "
                        f"({now - self.turn_start:.0f} s into the batch)")

    def end(self, turns: int, tokens: int, plain_tokens: int, accepted: list[int], committed: int,
            plain_wall_s: float, spec_wall_s: float) -> None:
        """The batch is done: its turns, speculative and plain token counts, accepted drafts per
        round, the tokens its rounds committed (τ = committed / rounds, decoding/acceptance.py) and
        both walls."""
        self.done += turns
        self.rounds += len(accepted)
        self.committed += committed
        elapsed = self.clock() - self.start
        eta = elapsed / self.done * (self.num_turns - self.done)
        fmt = (lambda x: "-" if x is None else f"{x:.2f}")
        spec_tps, plain_tps = tokens / max(spec_wall_s, 1e-9), plain_tokens / max(plain_wall_s, 1e-9)
        self._print(f"  {self.where}{self.label}: {tokens} tokens, speculative {spec_tps:.1f} tok/s (plain "
                    f"{plain_tps:.1f}), τ {fmt(tau(committed, len(accepted)))}, τ so far {fmt(tau(self.committed, self.rounds))} · {self.done}/"
                    f"{self.num_turns} turns, elapsed {_clock_text(elapsed)}, ETA {_clock_text(eta)}")
