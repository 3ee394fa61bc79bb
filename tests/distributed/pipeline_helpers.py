"""Shared pieces of the multi-process tests: a tiny prepared dataset, a tiny random target, a tiny
drafter config, and the single-process reference run the pipeline must reproduce."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from dflash_trainer.config import TrainConfig
from dflash_trainer.data.loader import epoch_order
from dflash_trainer.drafter.config import DrafterConfig, default_gamma
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.training.layout import anchor_seed
from dflash_trainer.training.optim import build_optimizer, build_scheduler
from dflash_trainer.training.target_source import RandomTarget
from dflash_trainer.training.step import StepSettings, drafter_step

T = 128
VOCAB = 128


def packed_rows(num_rows: int, seq_len: int = T, vocab: int = VOCAB, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """Rows shaped like data/pack.py output: 3 documents per row, the first 4 tokens of each unsupervised."""
    g = np.random.default_rng(seed)
    out: dict[str, list[np.ndarray]] = {"input_ids": [], "loss_mask": [], "position_ids": []}
    for _ in range(num_rows):
        cuts = sorted(g.choice(np.arange(16, seq_len - 16), 2, replace=False).tolist())
        bounds = [0, *cuts, seq_len]
        pos = np.concatenate([np.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
        out["input_ids"].append(g.integers(3, vocab, seq_len).astype(np.int32))
        out["loss_mask"].append((pos >= 4).astype(np.int8))
        out["position_ids"].append(pos.astype(np.int32))
    return out


def write_prepared(folder: Path, num_rows: int, seed: int = 0) -> Path:
    """A prepared folder (train/ and validation/ Arrow splits) as `dflash-train prepare` writes it."""
    from datasets import Dataset

    Dataset.from_dict(packed_rows(num_rows, seed=seed)).save_to_disk(str(folder / "train"))
    Dataset.from_dict(packed_rows(2, seed=seed + 1)).save_to_disk(str(folder / "validation"))
    return folder


def tiny_source() -> RandomTarget:
    """A 4-layer random Llama (H 64, vocab 128), the same weights on every rank and in the reference."""
    return RandomTarget("llama", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2), seed=0)


def write_cli_target(folder: Path) -> Path:
    """tiny_source() saved as an HF folder with the word-level tokenizer of the run-level tests, for
    runs that load the target from files (the CLI, torchrun)."""
    import shutil

    from tests.integration.tiny_run import make_target

    target = tiny_source().load_full(torch.device("cpu"), torch.float32)
    target.model.save_pretrained(folder)
    make_target(folder.parent / f"{folder.name}-tokenizer")
    for pattern in ("*token*", "chat_template*"):
        for f in (folder.parent / f"{folder.name}-tokenizer").glob(pattern):
            shutil.copy(f, folder / f.name)
    return folder


def tiny_drafter_config(path: Path) -> DrafterConfig:
    dc = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, block_size=4, mask_token_id=VOCAB - 1,
                       target_layer_ids=[0, 2], num_target_layers=4)
    path.write_text(dc.model_dump_json())
    return dc


def tiny_config(tmp: Path, *, num_rows: int = 8, **fields) -> TrainConfig:
    """TrainConfig for the tiny run in `tmp` (prepared data and drafter config written there)."""
    prepared = write_prepared(tmp / "data", num_rows)
    tiny_drafter_config(tmp / "drafter.json")
    base = dict(out=str(tmp / "run"), prepared=str(prepared), drafter_config=str(tmp / "drafter.json"), seq_len=T,
                num_anchors=8, block_size=4, log_every=2, comm_timeout_s=60.0, lr=1e-3, warmup_ratio=0.0)
    base.update(fields)
    return TrainConfig(**base)


def reference_weights(cfg: TrainConfig, num_drafters: int, steps: int) -> dict[str, torch.Tensor]:
    """The single-process co-located run over the same rows in the same order: per step the rows
    order_e[b·G, (b+1)·G) split into micro-batches of G/M rows, anchors seeded by (seed, epoch, first
    row), target features computed in the same process, loss = Σ w·loss / Σ w over the whole step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank: a fixed summation order whatever the machine's load
    try:
        return _reference_weights(cfg, num_drafters, steps)
    finally:
        torch.set_num_threads(threads)


def _reference_weights(cfg: TrainConfig, num_drafters: int, steps: int) -> dict[str, torch.Tensor]:
    from datasets import load_from_disk

    ds = load_from_disk(str(Path(cfg.prepared) / "train")).with_format("torch")
    dc = DrafterConfig.model_validate_json(Path(cfg.drafter_config).read_text())
    target = tiny_source().load_full(torch.device("cpu"), torch.float32)
    extractor = TargetFeatureExtractor(target, dc.target_layer_ids)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dc, target.embed_tokens, target.lm_head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    G, R = cfg.rows_per_step, cfg.rows_per_step // num_drafters
    steps_per_epoch = math.ceil(len(ds) / G)
    opt = build_optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = build_scheduler(opt, total_steps=cfg.max_steps, warmup_ratio=cfg.warmup_ratio, min_lr_ratio=cfg.min_lr_ratio)
    settings = StepSettings(num_anchors=cfg.num_anchors, gamma=default_gamma(dc.block_size), mask_kind="dense")
    draws = cfg.anchor_draws_per_row
    for step in range(steps):
        batch_step, draw = divmod(step, draws)  # feature reuse: `draws` steps per batch, fresh anchors each
        epoch, b = divmod(batch_step, steps_per_epoch)
        order = epoch_order(len(ds), cfg.seed, epoch)[b * G:(b + 1) * G]
        loss_sum, weight_sum = 0.0, 0.0
        for lo in range(0, len(order), R):
            idx = order[lo:lo + R].tolist()
            got = ds[idx]
            rows = {"input_ids": got["input_ids"].long(), "position_ids": got["position_ids"].long(),
                    "loss_mask": got["loss_mask"].bool()}
            out = extractor(rows["input_ids"], rows["position_ids"])
            gen = torch.Generator().manual_seed(anchor_seed(cfg.seed, epoch, idx[0], draw))
            sums = drafter_step(drafter, rows, out.features, out.argmax, settings, gen)
            loss_sum = loss_sum + sums.loss_sum
            weight_sum = weight_sum + sums.weight_sum.detach()
        (loss_sum / weight_sum.clamp_min(1.0)).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in drafter.trainable_state_dict().items()}
