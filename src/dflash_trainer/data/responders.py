"""Who writes the assistant turns during `dflash-train regenerate`: the streaming Responder interface,
an adapter for functions that answer whole waves, and the target itself over continuous batching.

A Responder takes conversations that end with a user turn (`submit(key, conversation)`) and hands
back `(key, Response)` pairs as turns finish (`poll()`); `busy` is true while any is pending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dflash_trainer.data.render import eos_token_ids
from dflash_trainer.data.tokenize import prompt_ids_batch, served_prompt
from dflash_trainer.target_model.load import TargetBundle


@dataclass
class Response:
    """One generated assistant turn: text, whether it ended with an end-of-sequence token, an
    error reason (then the record is counted as failed), and whether the loop guard stopped it
    (`looped`: its last tokens repeated an earlier stretch; `finished` is then False)."""

    text: str
    finished: bool = True
    error: str | None = None
    num_tokens: int = 0  # generated tokens (eos included), for throughput
    looped: bool = False


Conversation = list[dict[str, str]]


class Responder(Protocol):
    """Streaming generation of assistant turns (module docstring)."""

    @property
    def busy(self) -> bool:
        """True while any submitted conversation has not been answered."""

    def submit(self, key: Any, conversation: Conversation) -> None:
        """Queue a conversation ending with a user turn."""

    def poll(self) -> list[tuple[Any, Response]]:
        """Work until some answers are ready; (key, Response) pairs (possibly none)."""


class WaveResponder:
    """A Responder over a function `(conversations, seed) -> responses` that answers whole waves:
    each `poll` answers everything submitted since the last one (seeded by `seed` + wave number)."""

    def __init__(self, fn: Callable[[list[Conversation], int], list[Response]], seed: int = 0):
        self.fn, self.seed, self.waves = fn, seed, 0
        self.pending: list[tuple[Any, Conversation]] = []

    @property
    def busy(self) -> bool:
        """True while a wave is pending."""
        return bool(self.pending)

    def submit(self, key: Any, conversation: Conversation) -> None:
        """Add a conversation to the next wave."""
        self.pending.append((key, conversation))

    def poll(self) -> list[tuple[Any, Response]]:
        """Answer the pending wave."""
        wave, self.pending = self.pending, []
        if not wave:
            return []
        responses = self.fn([c for _, c in wave], self.seed * 1_000_003 + self.waves)
        self.waves += 1
        if len(responses) != len(wave):
            raise RuntimeError(f"responder returned {len(responses)} responses for {len(wave)} prompts")
        return [(k, r) for (k, _), r in zip(wave, responses)]


class TargetResponder:
    """Streaming generation with the target over continuous batching (decoding/continuous.py):
    render each conversation with the chat template and the generation prompt, generate, cut at
    the first end-of-sequence token, decode (special tokens the target emitted are kept).

    slots: rows generated together. temperature 0 = greedy; > 0 = sampling at that temperature
    within the top_p nucleus. loop_ngram: stop a turn whose last loop_ngram tokens repeat an
    earlier stretch of it (None = off; HF fallback: off). shortest_first: start the shortest
    waiting prompts first (continuous batching only). overlap: the generator's polls return while
    its next steps run (ContinuousGenerator; None = on CUDA). row_attention: each decode step attends
    every row's own slots only (ContinuousGenerator; None = where its kernel runs). `decode_modes` says
    which of the two ran (the report's record). A prompt over max_prompt_tokens gets
    Response(error="prompt_too_long"). Calling it with a list of conversations answers them all.
    A target the batched path does not implement (`target.batched.unsupported_reason`) runs HF
    `generate` in waves of `slots` instead (`fallback` holds the reason, else None).
    """

    def __init__(self, target: TargetBundle, chat_template: str, *, max_new_tokens: int, temperature: float = 0.0,
                 enable_thinking: bool | None = None, slots: int = 8, max_prompt_tokens: int = 2048, seed: int = 0,
                 top_p: float = 1.0, loop_ngram: int | None = None, shortest_first: bool = False,
                 overlap: bool | None = None, row_attention: bool | None = None):
        from dflash_trainer.decoding.batched import unsupported_reason
        from dflash_trainer.decoding.continuous import ContinuousGenerator
        from dflash_trainer.decoding.hf_generate import HFGenerator

        if target.tokenizer is None:
            raise ValueError(f"target {target.name_or_path} has no tokenizer; regeneration renders chat prompts")
        self.tokenizer, self.chat_template, self.enable_thinking = target.tokenizer, chat_template, enable_thinking
        self._texts: list[tuple[Any, str]] = []  # (key, rendered prompt) submitted since the last poll
        self.eos = eos_token_ids(target)
        if not self.eos:
            raise ValueError(f"target {target.name_or_path}: no end-of-sequence token id in tokenizer or config")
        limit = int(getattr(target.config, "max_position_embeddings", 0) or 0)
        if limit and max_prompt_tokens + max_new_tokens > limit:
            max_prompt_tokens = max(1, limit - max_new_tokens)  # never run past the model's positions
        self.fallback = unsupported_reason(target)
        if self.fallback and (loop_ngram or shortest_first):
            ignored = ", ".join(n for n, v in (("loop_ngram", loop_ngram), ("shortest_first", shortest_first)) if v)
            self.fallback += f" ({ignored} ignored: HF generate has no such option)"
        if self.fallback:
            self.gen: Any = HFGenerator(target, slots=slots, max_prompt_tokens=max_prompt_tokens,
                                        max_new_tokens=max_new_tokens, eos_ids=self.eos, temperature=temperature,
                                        seed=seed, top_p=top_p)
        else:
            generator = torch.Generator(device=target.embed_tokens.weight.device).manual_seed(seed)
            self.gen = ContinuousGenerator(target, slots=slots, max_prompt_tokens=max_prompt_tokens,
                                           max_new_tokens=max_new_tokens, eos_ids=self.eos, temperature=temperature,
                                           generator=generator, top_p=top_p, loop_ngram=loop_ngram,
                                           shortest_first=shortest_first, overlap=overlap,
                                           row_attention=row_attention)
        self.decode_modes = {"row_attention": bool(getattr(self.gen, "row_attention", False)),
                             "overlap": bool(getattr(self.gen, "overlap", False))}

    @property
    def busy(self) -> bool:
        """Anything submitted and not yet handed back."""
        return bool(self._texts) or self.gen.busy

    @property
    def overlaps(self) -> bool:
        """Whether `poll` returns while the generator's next steps run (then a prompt submitted after a
        `poll` starts one poll later, so callers keep some prompts queued beyond the rows)."""
        return bool(getattr(self.gen, "overlap", False))

    def generation_counts(self) -> dict[str, Any]:
        """The continuous generator's counts so far (decoding/gen_counts.py: occupancy, spans,
        queue waits); {} on the HF `generate` fallback, which keeps none."""
        counts = getattr(self.gen, "counts", None)
        return counts.as_dict() if counts is not None else {}

    def submit(self, key: Any, conversation: Conversation) -> None:
        """Render the conversation with the generation prompt (data/tokenize.py `served_prompt`; a template
        error raises ConversationSkipped here) and queue its text: the texts queued are tokenized together
        at the next `poll` (`prompt_ids_batch`, the ids of data/render.py `render_prompt`) and reach the
        generator in submission order."""
        self._texts.append((key, served_prompt(self.tokenizer, conversation, self.chat_template, self.enable_thinking)))

    def _flush(self) -> None:
        """Tokenize the queued texts in one call and hand them to the generator."""
        if self._texts:
            keys, texts = zip(*self._texts)
            self._texts = []
            for key, ids in zip(keys, prompt_ids_batch(self.tokenizer, texts)):
                self.gen.submit(key, ids)

    def poll(self) -> list[tuple[Any, Response]]:
        """The decoded responses of the turns that finished since the last call (possibly none; with
        `overlap` the generator's next stretch of steps is running when this returns:
        decoding/continuous.py)."""
        self._flush()
        out = []
        for f in self.gen.poll():
            if f.error:
                out.append((f.key, Response(text="", finished=False, error=f.error)))
                continue
            body = f.tokens[:-1] if f.finished else f.tokens  # the end-of-sequence token is the template's
            out.append((f.key, Response(text=self.tokenizer.decode(body, skip_special_tokens=False),
                                        finished=f.finished, num_tokens=len(f.tokens),
                                        looped=getattr(f, "looped", False))))
        return out

    def __call__(self, conversations: list[Conversation], seed: int = 0) -> list[Response]:
        """Answer every conversation (seed unused: the generator was seeded at construction)."""
        for i, c in enumerate(conversations):
            self.submit(i, c)
        got: dict[int, Response] = {}
        while self.busy:
            got.update(self.poll())
        return [got[i] for i in range(len(conversations))]
