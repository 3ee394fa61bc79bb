"""`dflash-train bench regen-shapes`: the regeneration's decode rate on random-weight targets of several
shapes, one process, one card, at the rows the recipe's plan gives each shape on this card.

What it measures: generated tokens a second of `ContinuousGenerator` (the regenerate stage's engine, CUDA
graph on, no loop guard) over 2 · rows random prompts (token ids uniform in [100, 10,000), lengths uniform
in [64, 1,024]) that each generate `new_tokens` tokens (random weights rarely emit the end-of-sequence id
0, so rows run to the cap: the batch stays full). Prefill is included, as in the stage. The rows are the
plan's (recipe/memory.py `regen_rows` for the card's free memory, sized for 1,536 prompt + 512 new tokens a
row) or `rows`; the engine holds 1,536 prompt + `new_tokens` tokens a row, so `peak_gib` is below the
stage's own peak at those rows.

Speed does not depend on weight values, but real answers end earlier and vary in length: the absolute
rates differ from a regeneration of real prompts; the ratios between shapes are what the recipe's plan
uses (recipe/regen_time.py), applied to SmolLM2's measured rate.

Shapes (HF configs, bf16): SHAPES below. Raises ValueError for an unknown shape name.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (HF model_type, config fields); the public checkpoints' config.json numbers
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-1.7b": ("qwen3", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               tie_word_embeddings=False)),
    "tiny": ("llama", dict(vocab_size=10_240, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
}  # tiny: a CPU check of the code path
PROMPT_TOKENS, NEW_TOKENS = 1536, 512  # the engine's size, as the recipe's regenerate stage sets it


def _model(name: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, fields = SHAPES[name]  # a name bench_regen_shapes checked
    cfg = AutoConfig.for_model(kind, max_position_embeddings=8192, **fields)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on the device (an 8B fp32 copy on the host is slow)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg).eval()
    finally:
        torch.set_default_dtype(prev)


def shape_numbers(name: str) -> dict[str, float]:
    """The recipe's TargetShape numbers of a named shape (hidden, layers, kv_heads, head_dim, vocab, params),
    counted from its config as the recipe counts a target's (recipe/inputs.py `shape_from_config`)."""
    from dataclasses import asdict

    from dflash_trainer.recipe.inputs import shape_from_config

    nums = asdict(shape_from_config(SHAPES[name][1], k=5))
    nums.pop("k")
    return nums


def _run_shape(name: str, rows: int, device: torch.device, new_tokens: int) -> dict[str, Any]:
    """One shape's timed run (module docstring): rate, steps, peak memory."""
    from dflash_trainer.decoding.continuous import ContinuousGenerator, generate_all
    from dflash_trainer.target_model.load import bundle_from_model

    bundle = bundle_from_model(_model(name, device), name_or_path=f"random-{name}")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 1025, (2 * rows,), generator=g).tolist()
    prompts = [torch.randint(100, 10_000, (n,), generator=g).tolist() for n in lengths]

    def make(slots: int, new: int) -> ContinuousGenerator:
        # the shared span without overlap: the conditions recipe/regen_time.py's fit was measured in
        return ContinuousGenerator(bundle, slots=slots, max_prompt_tokens=PROMPT_TOKENS, max_new_tokens=new,
                                   eos_ids={0}, row_attention=False, overlap=False)

    generate_all(make(min(rows, 8), 4), prompts[:8])  # warm-up: kernels, allocator
    gen = make(rows, new_tokens)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d: None)
    sync(device)
    t0 = time.perf_counter()
    done = generate_all(gen, prompts)
    sync(device)
    dt = time.perf_counter() - t0
    tokens = sum(len(f.tokens) for f in done)
    return {"rows": rows, "prompts": len(prompts), "mean_prompt_tokens": sum(lengths) / len(lengths),
            "tokens": tokens, "wall_s": dt, "tokens_per_s": tokens / dt, "decode_steps": gen.steps,
            "ms_per_step": 1e3 * dt / max(gen.steps, 1), "row_attention": gen.row_attention, "overlap": gen.overlap,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else None}


@torch.no_grad()
def bench_regen_shapes(shapes: list[str], *, device: torch.device, rows: int | None = None, new_tokens: int = 128,
                       free_gib: float | None = None) -> dict[str, Any]:
    """Decode rate per shape (module docstring). Returns {"shapes": {name: {...rate, rows, steps...}},
    "free_gib", "device", "torch"}; each shape's `vs_first` is its rate over the first shape's. A shape whose
    rows run out of GPU memory (a `rows` above what the plan gives it) is reported with an `error` naming the
    rows, and the others still run. Raises ValueError for no shape, an unknown one or new_tokens outside
    [1, 512]."""
    from dflash_trainer.recipe.memory import TargetShape, regen_rows

    if not shapes:
        raise ValueError(f"no shape: name one or more of {', '.join(SHAPES)}")
    for name in shapes:
        if name not in SHAPES:
            raise ValueError(f"shape {name!r}: use one of {', '.join(SHAPES)}")
    if not 1 <= new_tokens <= NEW_TOKENS:
        raise ValueError(f"new_tokens={new_tokens}: must lie in [1, {NEW_TOKENS}]")
    if free_gib is None:
        free_gib = (torch.cuda.mem_get_info(device)[0] / 1024**3) if device.type == "cuda" else 2.0
    import transformers

    out: dict[str, Any] = {"free_gib": free_gib, "new_tokens": new_tokens, "torch": torch.__version__,
                           "transformers": transformers.__version__,
                           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "shapes": {}}
    for name in shapes:
        nums = shape_numbers(name)
        r = rows or regen_rows(free_gib, TargetShape(**nums), PROMPT_TOKENS, NEW_TOKENS, 10**9)[0]
        try:
            out["shapes"][name] = {**nums, **_run_shape(name, r, device, new_tokens)}
        except torch.cuda.OutOfMemoryError:
            out["shapes"][name] = {**nums, "rows": r, "error": f"CUDA out of memory at {r} rows: lower --rows "
                                                              f"(or leave it out: the plan's rows fit)"}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    first = out["shapes"][shapes[0]].get("tokens_per_s")
    for v in out["shapes"].values():
        if first and "tokens_per_s" in v:
            v["vs_first"] = v["tokens_per_s"] / first
    return out
