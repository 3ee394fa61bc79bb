"""A device out-of-memory error turned into the setting to lower and by how much.

The plan's memory rules (recipe/memory.py) read backwards: the failed allocation's shortfall (the bytes
it asked for less the bytes the card had free, both from torch's message) divided by what one unit of
each setting costs gives how many units to drop:

- train: a cached row (`feature_row_bytes`, the cache cut in the plan's 4 GiB steps), a row of the
  step (`step_bytes` of one row), a token of every row of the step (data.seq_len, in multiples of 128);
- regenerate: a row of the continuous batch (`regen_row_bytes` at --max-prompt-tokens + --max-new-tokens);
- eval: a turn of the batch (the same KV rule at --max-prompt-tokens + new tokens + one block, in the
  target's dtype: 4 bytes a value in fp32), a prompt token of every turn (--max-prompt-tokens, when the
  batch's prompts reach it), and an fp32 target (--dtype bfloat16 halves its weights and its KV cache;
  offered when that covers at least a tenth of the shortfall).

At least one unit is dropped when the shortfall is unknown or zero (a fragmented card). Every message
ends with torch's own error text, on one line. Pure arithmetic over numbers; `free_bytes_now` is the one call into torch, for messages that carry no free count.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Optional

from dflash_trainer.recipe.memory import (ACT_BYTES_PER_HIDDEN, CACHE_STEP_GIB, EVAL_SHARE, GIB, REGEN_SHARE,
                                          TargetShape, feature_row_bytes, regen_row_bytes, step_bytes)
from dflash_trainer.recipe.plan import EVAL_PROMPT_TOKENS

_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": GIB, "TiB": 1024**4}
_ASKED = re.compile(r"Tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)")
_FREE = re.compile(r"of which ([\d.]+) ?(B|KiB|MiB|GiB|TiB) is free")
SEQ_MULTIPLE = 128  # data.seq_len's rule (flex tiles)


def failed_allocation(message: str) -> tuple[Optional[int], Optional[int]]:
    """(bytes the failed allocation asked for, bytes free on the card) read from torch's OOM message
    ("Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.25 GiB is free");
    None for a number the message lacks."""
    def read(pattern: re.Pattern[str]) -> Optional[int]:
        m = pattern.search(message)
        return round(float(m.group(1)) * _UNITS[m.group(2)]) if m else None

    return read(_ASKED), read(_FREE)


def free_bytes_now() -> Optional[int]:
    """Free bytes on the current CUDA device (torch.cuda.mem_get_info), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _header(command: str, message: str, free_fallback: Optional[int]) -> tuple[str, int]:
    """(the first sentence, the shortfall in bytes; 0 when unknown)."""
    asked, free = failed_allocation(message)
    free = free if free is not None else free_fallback
    if asked is None:
        return f"out of GPU memory in {command}", 0
    if free is None:
        return f"out of GPU memory in {command}: an allocation of {_gib(asked)} failed", asked
    short = max(0, asked - free)
    return (f"out of GPU memory in {command}: an allocation of {_gib(asked)} found {_gib(free)} free "
            f"({_gib(short)} short)"), short


def _units(short: int, unit: float) -> int:
    """Units of `unit` bytes to drop to cover `short` bytes; at least one."""
    return max(1, math.ceil(short / unit))


def _message(head: str, options: list[str], last_resort: str, original: str) -> str:
    """The whole message: `head`, the settings to lower (or `last_resort`), then torch's own error text
    `original` on one line (what failed, for a search or a bug report)."""
    torch_said = " ".join(original.split())
    tail = f" (torch: {torch_said})" if torch_said else ""
    if not options:
        return f"{head}. {last_resort}{tail}"
    return (f"{head}. Lower one of these (by at least the shortfall; later allocations may need more): "
            + "; ".join(options) + tail)


def train_oom_message(message: str, shape: TargetShape, *, seq_len: int, rows_per_step: int, feature_cache_gib: float,
                      free_fallback: Optional[int] = None, block_tokens: Optional[int] = None) -> str:
    """What a train run that ran out of device memory should lower: target.feature_cache_gib (in 4 GiB
    steps, the cached rows it drops), optim.rows_per_step (one row of seq_len tokens in the step) and
    data.seq_len (a token of every row of the step, in multiples of 128), each with its new value.
    block_tokens: num_anchors · B of a row (the plan's step rule; None = seq_len). While it exceeds seq_len
    the drafter's activations do not shrink with seq_len, so a token of seq_len saves only its logits."""
    head, short = _header("train", message, free_fallback)
    options = []
    if feature_cache_gib > 0:
        cut = min(feature_cache_gib, CACHE_STEP_GIB * _units(short, CACHE_STEP_GIB * GIB))
        row = feature_row_bytes(shape, seq_len)
        new = max(0.0, feature_cache_gib - cut)
        options.append(f"target.feature_cache_gib from {feature_cache_gib:g} to {new:g} (--set target.feature_cache_gib="
                       f"{new:g}): {int(cut * GIB // row):,} fewer cached rows of {_mib(row)}, recomputed each epoch")
    per_row = step_bytes(shape, seq_len, 1, block_tokens) - step_bytes(shape, seq_len, 0, block_tokens)
    rows = rows_per_step - _units(short, per_row)
    if rows >= 1:
        options.append(f"optim.rows_per_step from {rows_per_step} to {rows} (--set optim.rows_per_step={rows}): a row "
                       f"of {seq_len} tokens takes {_gib(per_row)} of the step")
    # a token of seq_len: its logits, and its activations unless the block tokens (fixed by anchors · B) exceed seq_len
    per_token = rows_per_step * (shape.vocab * 2 + (ACT_BYTES_PER_HIDDEN * shape.hidden
                                                    if (block_tokens or seq_len) <= seq_len else 0))
    seq = (seq_len - _units(short, per_token)) // SEQ_MULTIPLE * SEQ_MULTIPLE
    if seq >= SEQ_MULTIPLE:
        options.append(f"data.seq_len from {seq_len} to {seq} (--set data.seq_len={seq}; a multiple of 128): a token "
                       f"of the step's {rows_per_step} rows takes {_mib(per_token)}")
    return _message(head, options, "Even one row of 128 tokens does not fit: use a larger card or a smaller target", message)


def regenerate_oom_message(message: str, shape: TargetShape, *, batch_size: int, prompt_tokens: int, new_tokens: int,
                           free_fallback: Optional[int] = None) -> str:
    """What a regeneration that ran out of device memory should lower: --batch-size (one row's KV cache at
    --max-prompt-tokens + --max-new-tokens tokens), with its new value."""
    head, short = _header("regenerate", message, free_fallback)
    row = regen_row_bytes(shape, prompt_tokens, new_tokens)
    rows = batch_size - _units(short, row)
    options = [f"regenerate's --batch-size from {batch_size} to {rows}: a row's KV cache of {prompt_tokens}+{new_tokens} "
               f"tokens takes {_mib(row)}"] if rows >= 1 else []
    return _message(head, options, "One row does not fit: lower --max-prompt-tokens or --max-new-tokens", message)


def eval_oom_message(message: str, shape: TargetShape, *, batch_size: int, new_tokens: int, block_size: int,
                     float32: bool, prompt_tokens: int = EVAL_PROMPT_TOKENS,
                     free_fallback: Optional[int] = None) -> str:
    """What an eval that ran out of device memory should lower, each with its new value: --batch-size (one
    turn's KV cache at prompt_tokens, the eval's --max-prompt-tokens, + new tokens + one block, in the
    target's dtype), --max-prompt-tokens (the batch's longest prompt sets every turn's cache; this helps
    only when the prompts reach the cap) and, for an fp32 target whose bf16 saving (weights and the
    batch's KV cache) is at least a tenth of the shortfall (or the shortfall is unknown), --dtype
    bfloat16."""
    head, short = _header("eval", message, free_fallback)
    elem = 4 if float32 else 2  # the cache is in the target's dtype
    row = regen_row_bytes(shape, prompt_tokens, new_tokens + block_size, elem)
    rows = batch_size - _units(short, row)
    options = []
    if rows >= 1:
        options.append(f"eval's --batch-size from {batch_size} to {rows}: a turn's KV cache of {prompt_tokens}+"
                       f"{new_tokens}+{block_size} tokens takes {_mib(row)}")
    per_token = regen_row_bytes(shape, 1, 0, elem) * batch_size  # one more prompt token in every row of the batch
    tokens = prompt_tokens - _units(short, per_token)
    if tokens >= 1:
        options.append(f"eval's --max-prompt-tokens from {prompt_tokens} to {tokens}, when the batch's prompts reach "
                       f"it (longer turns are skipped and counted): a prompt token of {batch_size} turns takes "
                       f"{_mib(per_token)}")
    # fp32 → bf16 halves the weights and every turn's KV cache
    saved = shape.params * 2 + batch_size * (row - regen_row_bytes(shape, prompt_tokens, new_tokens + block_size))
    if float32 and (short == 0 or saved * 10 >= short):
        options.append(f"eval's --dtype from float32 to bfloat16: the target's weights and KV cache take "
                       f"{_gib(saved)} less")
    return _message(head, options, "One turn does not fit: lower --max-prompt-tokens or --max-new-tokens", message)


def recipe_oom_advice(stage: str, log_text: str, gpu_memory_gib: Optional[float],
                      batch_at: Callable[[float], Optional[int]]) -> Optional[str]:
    """The recipe's own flag for a regenerate or eval stage that ran out of device memory, whose message
    names the command's flags (--batch-size, --dtype) that the recipe sets from its plan: `--gpu-memory-gib G`,
    the largest whole G at which the plan's batch for that stage (`batch_at(G)`: regeneration rows or eval
    turns, powers of two) is smaller than at the plan's `gpu_memory_gib`, and at least the shortfall in torch's
    message over the share of the card the plan gives the stage (REGEN_SHARE, EVAL_SHARE) below it. None for
    another stage, a failure that is not an out-of-memory one, a plan without a card size, or no smaller plan."""
    shares = {"regenerate": REGEN_SHARE, "eval": EVAL_SHARE}
    if stage not in shares or not gpu_memory_gib or f"out of GPU memory in {stage}" not in log_text:
        return None
    asked, free = failed_allocation(log_text)
    short = max(0, asked - free) if asked is not None and free is not None else 0
    now = batch_at(gpu_memory_gib)
    if now is None:
        return None
    start = math.floor(gpu_memory_gib - max(1.0, short / GIB / shares[stage]))
    for gib in range(start, 0, -1):
        smaller = batch_at(gib)
        if smaller is not None and smaller < now:
            what = "regeneration rows" if stage == "regenerate" else "eval batch"
            return (f"In the recipe, {stage}'s batch is planned from the card's memory ({gpu_memory_gib:.0f} GiB free "
                    f"when it planned): run the same command with --gpu-memory-gib {gib}, which plans {what} "
                    f"{now:,} → {smaller:,} (the finished stages are kept)")
    return None
