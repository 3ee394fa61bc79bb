"""The out-of-memory exit of `train`, `regenerate` and `eval`: the command's settings and its target's shape
handed to recipe/oom.py, which names the setting to lower and by how much."""

from __future__ import annotations

import sys
from typing import Optional


def is_oom(error: BaseException) -> bool:
    """True for torch's device out-of-memory error (False while torch is not imported: then it cannot be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def _shape(target: Optional[str], k: int = 5):
    """The target's shape for the arithmetic, or None when it cannot be read (the message then names the settings only)."""
    from dflash_trainer.recipe.inputs import target_shape

    try:
        return target_shape(target, k)
    except Exception:  # noqa: BLE001 - an error path: the original OOM matters more than this one
        return None


def train_oom(cfg, error: BaseException) -> str:
    """The message for a train run (its resolved TrainConfig) that ran out of device memory."""
    from dflash_trainer.recipe.oom import free_bytes_now, train_oom_message

    shape = _shape(cfg.target.path, cfg.drafter.num_target_features)
    if shape is None:
        return (f"out of GPU memory in train: lower target.feature_cache_gib, optim.rows_per_step or data.seq_len "
                f"(--set ...). {error}")
    return train_oom_message(str(error), shape, seq_len=cfg.data.seq_len, rows_per_step=cfg.optim.rows_per_step,
                             feature_cache_gib=cfg.target.feature_cache_gib, free_fallback=free_bytes_now(),
                             block_tokens=cfg.drafter.block_size * cfg.loss.num_anchors)


def regenerate_oom(target: Optional[str], batch_size: int, prompt_tokens: int, new_tokens: int,
                   error: BaseException) -> str:
    """The message for a regeneration of `batch_size` rows that ran out of device memory."""
    from dflash_trainer.recipe.oom import free_bytes_now, regenerate_oom_message

    shape = _shape(target)
    if shape is None:
        return f"out of GPU memory in regenerate: lower --batch-size (now {batch_size}). {error}"
    return regenerate_oom_message(str(error), shape, batch_size=batch_size, prompt_tokens=prompt_tokens,
                                  new_tokens=new_tokens, free_fallback=free_bytes_now())


def eval_oom(settings, error: BaseException) -> str:
    """The message for an eval (its EvalSettings; CUDA defaults: 256 turns, 256 new tokens, B = --block-size
    or the drafter's trained block size, as the eval runs it; 16 only when the folder cannot be read) that
    ran out of device memory."""
    from dflash_trainer.interop.formats import trained_block_size
    from dflash_trainer.recipe.oom import eval_oom_message, free_bytes_now

    batch = settings.batch_size or 256
    shape = _shape(settings.target)
    if shape is None:
        return f"out of GPU memory in eval: lower --batch-size (now {batch}). {error}"
    block = settings.block_size or trained_block_size(settings.drafter) or 16
    return eval_oom_message(str(error), shape, batch_size=batch, new_tokens=settings.max_new_tokens or 256,
                            block_size=block, float32=settings.dtype == "float32",
                            prompt_tokens=settings.max_prompt_tokens, free_fallback=free_bytes_now())
