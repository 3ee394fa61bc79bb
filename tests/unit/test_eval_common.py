"""Shared builders for the evaluation tests (no tests here): tiny random targets, drafters over
them with every weight random, the slow greedy reference, oracle / always-wrong drafter stubs, a
word-level tokenizer, and the eager twin of the engine's captured CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target_model.head_transforms import target_head
from dflash_trainer.target_model.load import TargetBundle
from tests.tiny_targets import tiny_bundle

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")



def target_and_drafter(kind: str = "llama", *, vocab_size: int = 128, block_size: int = 4, layer_ids=(0, 2),
                       layer_types=("full_attention", "full_attention"), sliding_window: int | None = None,
                       seed: int = 0, random_weights: bool = True, **target_kw) -> tuple[TargetBundle, DFlashDrafter]:
    """A tiny random target and a drafter over its embedding / LM head (fp32, eval).

    random_weights: every drafter weight ~ N(0, 0.25) and norms ≈ 1 ± 0.3 (unit norms would hide a
    norm applied to the wrong stream); False keeps the default init (an untrained drafter).
    """
    bundle = tiny_bundle(kind, vocab_size=vocab_size, **target_kw)
    cfg = bundle.config
    dc = DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=len(layer_types), num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                       vocab_size=vocab_size, block_size=block_size, mask_token_id=vocab_size - 1,
                       target_layer_ids=list(layer_ids), num_target_layers=bundle.num_layers,
                       layer_types=list(layer_types), sliding_window=sliding_window, rms_norm_eps=1e-6,
                       **target_head(bundle.model).fields())  # the target's embedding / logits functions
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DFlashDrafter(dc, bundle.embed_tokens, bundle.lm_head, compile_flex=False)
        if random_weights:
            g = torch.Generator().manual_seed(seed + 1)
            with torch.no_grad():
                for name, p in drafter.named_parameters():
                    if name.endswith("norm.weight") or "layernorm" in name:
                        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
                    else:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    return bundle, drafter.eval().requires_grad_(False)


def greedy_reference(bundle: TargetBundle, prompt: list[int], max_new_tokens: int,
                     eos_ids: set[int]) -> tuple[list[int], str]:
    """Plain greedy decoding the slow, obvious way: the whole sequence through the HF forward at
    every step (no cache). Returns (new tokens, eos kept when hit; "eos" | "length")."""
    seq, out = list(prompt), []
    device = bundle.embed_tokens.weight.device
    with torch.no_grad():
        while True:
            tok = int(bundle.model(input_ids=torch.tensor([seq], device=device)).logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok in eos_ids:
                return out, "eos"
            if len(out) >= max_new_tokens:
                return out, "length"


class ScriptedRows:
    """A stand-in for decoding/draft.py's DraftSession that knows each row's greedy continuation
    `sequences[r]` (prompt + output): slot k proposes sequences[r][anchor+k] when correct[r] (an
    oracle), else always a different token. Call it like the DraftSession class (the engine builds
    it); it keeps the features written to each row's context (NaN where nothing was written) and,
    per propose call, every row's (anchor token, anchor position, context before the anchor)."""

    def __init__(self, sequences: list[list[int]], vocab_size: int, correct: list[bool]):
        self.sequences, self.vocab_size, self.correct = sequences, vocab_size, correct

    def __call__(self, _drafter, *, rows: int, max_len: int, zero_features: bool = False) -> "ScriptedRows":
        self.rows, self.max_len = rows, max_len
        self.ctx: torch.Tensor | None = None
        self.calls: list[list[tuple[int, int, torch.Tensor]]] = []
        return self

    def refresh(self) -> None:
        pass  # no weights

    def extend(self, features: torch.Tensor, start: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        m, n, width = features.shape
        if self.ctx is None:
            self.ctx = torch.full((self.rows, self.max_len, width), float("nan"))
        rows = torch.arange(m) if rows is None else rows
        for i, (r, s) in enumerate(zip(rows.tolist(), start.tolist())):
            self.ctx[r, s:s + n] = features[i].float().cpu()

    def propose(self, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, span: int,
                block_size: int | None = None, greedy: bool = False) -> torch.Tensor:
        tokens, positions = anchor_tokens.tolist(), anchor_pos.tolist()
        self.calls.append([(t, a, self.ctx[r, :a].clone()) for r, (t, a) in enumerate(zip(tokens, positions))])
        logits = torch.zeros(self.rows, block_size - 1, self.vocab_size)
        for r, a in enumerate(positions):
            seq = self.sequences[r % len(self.sequences)]
            for k in range(1, block_size):
                tok = seq[a + k] if a + k < len(seq) else 0
                logits[r, k - 1, tok if self.correct[r % len(self.correct)] else (tok + 1) % self.vocab_size] = 10.0
        return logits.to(anchor_tokens.device)


def word_tokenizer(vocab_size: int = 128, chat_template: str = CHATML) -> PreTrainedTokenizerFast:
    """A whitespace word-level fast tokenizer with exactly `vocab_size` ids: ChatML specials
    (eos = <|im_end|> = id 2), then words w3 … w{V−1}; every id decodes to a word."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    words = specials + [f"w{i}" for i in range(len(specials), vocab_size)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = chat_template
    assert len(tok) == vocab_size and tok.eos_token_id == 2
    return tok


class EagerGraph:
    """The CPU twin of a captured CUDA graph: `replay` runs the captured step eagerly at its fixed span."""

    def __init__(self, step):
        self.replay = step


def replay_eagerly(engine) -> None:
    """Give a CPU `DecodeEngine` what capture_graphs would: each of its graph steps run as a capture runs it
    (3 warm-ups and the capture, every row done, the uniform counter reset after each), then `engine.graphs`
    set to their eager twins, so that decoding goes through the fixed-span steps CUDA graphs replay."""
    steps = engine.graph_steps()
    for step in steps.values():
        for _ in range(4):
            step()
            engine.t.zero_()
    engine.graphs = {mode: EagerGraph(step) for mode, step in steps.items()}
