"""Shared pieces of the multi-process tests: a tiny prepared dataset, a tiny random target, a tiny
drafter config, and the co-located run (the 1 × 1 layout) every process layout must reproduce."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.pipeline.target_source import RandomTarget

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
        out["input_ids"].append(g.integers(3, vocab - 1, seq_len).astype(np.int32))  # vocab − 1: the mask token
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


def colocated_run(cfg: TrainConfig, steps: int) -> tuple[dict[str, torch.Tensor], list[tuple[int, float]]]:
    """(final weights, [(step, loss)] of metrics.jsonl) of the co-located run (`training.run.train`, the
    1 × 1 layout) of `cfg` with max_steps=steps, in its own folder beside cfg.out, one thread (each
    pipeline rank runs one thread too: the same summation order whatever the machine's load)."""
    import json

    from dflash_trainer.interop.checkpoint_files import load_checkpoint
    from dflash_trainer.training.run import train

    out = Path(cfg.out).parent / f"colocated-{steps}"
    run_cfg = cfg.updated({"out": str(out), "max_steps": steps, "target_procs": None, "drafter_procs": None,
                                     "procs": None, "device": "cpu", "validation_max_rows": 1})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(run_cfg, target=tiny_source().load_full(torch.device("cpu"), torch.float32))
    finally:
        torch.set_num_threads(threads)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return load_checkpoint(out / "checkpoint-final")[1], [(r["step"], r["loss"]) for r in records]


def initial_weights(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The drafter's weights before the first step (what every layout starts from: seeded by cfg.runtime.seed)."""
    dc = DrafterConfig.model_validate_json(Path(cfg.drafter.drafter_config).read_text())
    target = tiny_source().load_full(torch.device("cpu"), torch.float32)
    torch.manual_seed(cfg.runtime.seed)
    drafter = DFlashDrafter(dc, target.embed_tokens, target.lm_head)
    return {k: v.detach().clone() for k, v in drafter.trainable_state_dict().items()}
