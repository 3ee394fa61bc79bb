"""Overfit a tiny drafter on a few memorized prompts of a tiny target, in this process (no files).

Shapes: R = 1 packed row of T tokens (the memorized conversations, one document each, then padding),
B = block size, k·H = target feature width.

The steps are training's own: the target's features and greedy labels from TargetFeatureExtractor,
the drafter built as training builds it (`frozen_modules` around the target's weights, init-config's
config from `drafter_config_from_target`), `drafter_step` with every valid anchor of the row, AdamW. The
answers are the target's own greedy continuations (on-policy), `max_new_tokens = 1 + rounds·B` long,
so a drafter that learned them is accepted in full in every round of eval: τ = B. Stateful targets
(which eval refuses) answer by full forwards without a cache; their drafter is checked offline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.data.render import eos_token_ids, render_prompt
from dflash_trainer.decoding.engine import DecodeEngine
from dflash_trainer.data.suites import EvalPrompt
from dflash_trainer.config.sections import DrafterSection
from dflash_trainer.drafter.shape import drafter_config_from_target
from dflash_trainer.target_model.families import target_support
from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.target_model.load import TargetBundle
from dflash_trainer.drafter.build import frozen_modules
from dflash_trainer.training.step import StepSettings, drafter_step


@dataclass
class Overfit:
    """prompts: the memorized ones; drafter: trained (eval mode, built around the target's own modules,
    as eval builds it); steps: optimizer steps taken; max_new_tokens: the length memorized."""

    prompts: list[EvalPrompt]
    drafter: DFlashDrafter
    steps: int
    max_new_tokens: int
    sequences: list[tuple[list[int], list[int]]]  # (prompt ids, answer ids) of each memorized prompt


@torch.no_grad()
def greedy_without_cache(target: TargetBundle, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy answer by one full forward per token (targets whose state a KV cache cannot hold)."""
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new_tokens and not (len(seq) > len(prompt) and seq[-1] in eos):
        seq.append(int(target.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt):]


def memorable_prompts(target: TargetBundle, template: str, candidates: list[EvalPrompt], n: int,
                      max_new_tokens: int) -> list[tuple[EvalPrompt, list[int], list[int]]]:
    """The first `n` candidates whose greedy answer runs the full `max_new_tokens` (no end-of-sequence
    token, which would end eval's last round early): (prompt, prompt ids, answer ids)."""
    eos = eos_token_ids(target)
    stateful = target_support(target.model).stateful
    out = []
    for p in candidates:
        ids = render_prompt(target.tokenizer, template, p.messages([]), None)
        if stateful:
            answer = greedy_without_cache(target, ids, max_new_tokens, eos)
        else:  # eval's own engine, plain greedy decoding
            engine = DecodeEngine(target, None, rows=1, max_prompt_tokens=len(ids), max_new_tokens=max_new_tokens,
                                  eos_ids=eos, cuda_graph=False)
            answer = engine.decode([ids], speculative=False).tokens[0]
        if len(answer) == max_new_tokens and not eos & set(answer):
            out.append((p, ids, answer))
        if len(out) == n:
            return out
    raise AssertionError(f"only {len(out)} of {len(candidates)} candidate prompts run {max_new_tokens} tokens")


def overfit(target: TargetBundle, template: str, candidates: list[EvalPrompt], *, block_size: int = 4,
            rounds: int = 4, num_prompts: int = 2, max_steps: int = 400, lr: float = 3e-3, seed: int = 0) -> Overfit:
    """Train a 1-layer drafter (init-config's config for `target`) until every slot of every valid block of
    the memorized answers is right (checked on the training step's own sums), at most max_steps."""
    B = block_size
    max_new = 1 + rounds * B
    memo = memorable_prompts(target, template, candidates, num_prompts, max_new)
    dc, _ = drafter_config_from_target(target.config, target.tokenizer,
                                       DrafterSection(num_layers=1, block_size=B, target_layer_ids=[0, target.num_layers - 1]))
    docs = [ids + answer for _, ids, answer in memo]
    T = sum(map(len, docs)) + 1  # a one-token padding document closes the row
    input_ids = torch.tensor([sum(docs, []) + [0]])  # [1,T]
    position_ids = torch.tensor([[i for d in docs for i in range(len(d))] + [0]])  # restarts per document
    loss_mask = torch.tensor([[i >= len(ids) for (_, ids, _), d in zip(memo, docs) for i in range(len(d))] + [False]])
    rows = {"input_ids": input_ids, "position_ids": position_ids, "loss_mask": loss_mask}
    with torch.no_grad():
        tgt = TargetFeatureExtractor(target, dc.target_layer_ids)(input_ids, position_ids)  # fixed: the target is frozen
    torch.manual_seed(seed)
    trained = DFlashDrafter(dc, *frozen_modules(target.embed_tokens.weight, target.lm_head.weight,
                                                torch.device("cpu")), compile_flex=False).train()
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    settings = StepSettings(num_anchors=T, gamma=dc.gamma, mask_kind="dense",  # every valid anchor, every step
                            position_weights="decay")  # γ = dc.gamma: the weights its step limits were set with
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, max_steps + 1):
        sums = drafter_step(trained, rows, tgt.features, tgt.argmax, settings, gen, train=True)
        if bool((sums.correct == sums.count).all()):  # host sync: the stopping test
            break
        opt.zero_grad()
        (sums.loss_sum / sums.weight_sum).backward()
        opt.step()
    drafter = DFlashDrafter(dc, target.embed_tokens, target.lm_head, compile_flex=False)  # as eval builds it
    drafter.load_trainable_state_dict(trained.trainable_state_dict())
    return Overfit([p for p, _, _ in memo], drafter.eval().requires_grad_(False), step - 1, max_new,
                   [(ids, answer) for _, ids, answer in memo])
