"""`dflash-train bench regenerate`: generated tokens/s of our continuous batching against HF `generate`.

Same process, same target, same prompts (the first user turn of the first usable conversations of
a chat file whose first-turn prompt, rendered with the target's chat template, has at most
`max_prompt_tokens` tokens; longer ones are left out), greedy or sampled (temperature, top_p),
`max_new_tokens` per prompt, every output cut at its first end-of-sequence token:
  * ours: `ContinuousGenerator` with `slots` rows over all prompts (rows refilled as they finish),
    the shortest waiting prompts first with `shortest_first`, each row attending its own slots with
    `row_attention`; the loop guard when `loop_ngram` is
    set (HF has none: its rows run on through loops);
  * HF `generate` at batch 1 over the first `hf_batch1_prompts` prompts;
  * HF `generate` at batch `hf_batch` (default `slots`; left padding, dynamic cache) over the
    first `hf_batch` prompts.
tokens/s = generated tokens (eos included) / host wall-clock (CUDA synchronized), prefill
included. `agreement_batch1` = share of the batch-1 prompts whose output equals ours token for
token (bf16 numerics can flip near-ties between batch shapes; both are greedy).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dflash_trainer.data.chat import ReadStats, iter_conversations
from dflash_trainer.data.sources import default_sharegpt_path
from dflash_trainer.data.tokenize import resolve_chat_template
from dflash_trainer.data.render import eos_token_ids, render_prompt
from dflash_trainer.decoding.engine import sync_device
from dflash_trainer.decoding.continuous import ContinuousGenerator, generate_all
from dflash_trainer.decoding.gen_counts import ratios
from dflash_trainer.decoding.hf_generate import HFGenerator
from dflash_trainer.target_model.load import load_target
from dflash_trainer.training import precision


def _timed(fn, device: torch.device) -> tuple[Any, float]:
    sync_device(device)
    t0 = time.perf_counter()
    out = fn()
    sync_device(device)
    return out, time.perf_counter() - t0


@torch.no_grad()
def run(target: str | None = None, data: str | None = None, *, num_prompts: int = 1024, slots: int = 512,
        max_new_tokens: int = 256, max_prompt_tokens: int = 1024, hf_batch1_prompts: int = 4,
        hf_batch: int | None = None, temperature: float = 0.0, top_p: float = 1.0, loop_ngram: int | None = None,
        shortest_first: bool = False, row_attention: bool | None = None,
        device: torch.device | None = None, bundle: Any = None) -> dict[str, Any]:
    """Run the three generators (module docstring); returns the result dict. bundle: an already
    loaded target (TargetBundle) to use instead of loading `target` (several runs, one load)."""
    hf_batch = hf_batch or slots
    device = device or torch.device("cuda")
    bundle = bundle or load_target(target, device=device, dtype=precision.compute_dtype(device))
    tok = bundle.tokenizer
    template = resolve_chat_template(tok)
    eos = eos_token_ids(bundle)
    prompts: list[list[int]] = []
    for conv in iter_conversations(data or default_sharegpt_path(), ReadStats()):
        first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        ids = render_prompt(tok, template, conv.messages[:first_user + 1])
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) >= num_prompts:
            break

    if not prompts:
        raise ValueError(f"no first-turn prompt of at most {max_prompt_tokens} tokens in the data")

    def ours() -> list[list[int]]:
        gen = ContinuousGenerator(bundle, slots=slots, max_prompt_tokens=max_prompt_tokens,
                                  max_new_tokens=max_new_tokens, eos_ids=eos, temperature=temperature, top_p=top_p,
                                  loop_ngram=loop_ngram, shortest_first=shortest_first, row_attention=row_attention,
                                  overlap=False, generator=torch.Generator(device=device).manual_seed(0))
        stats["row_attention"] = gen.row_attention  # what ran (row_attention None chose it: row_kernel_runs)
        done = generate_all(gen, prompts)
        stats["looped"] = sum(f.looped for f in done)
        stats["finished"] = sum(f.finished for f in done)
        stats["decode_steps"] = gen.steps
        stats["generator"] = gen.counts.as_dict()  # occupancy, spans, queue waits (decoding/gen_counts.py)
        stats["span_steps"] = stats["generator"]["span_steps"]
        stats["generator_ratios"] = ratios(stats["generator"])
        return [f.tokens for f in done]

    stats: dict[str, Any] = {}

    def hf(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        gen = HFGenerator(bundle, slots=len(batch), max_prompt_tokens=max_prompt_tokens, max_new_tokens=new_tokens,
                          eos_ids=eos, temperature=temperature, top_p=top_p)
        return [f.tokens for f in generate_all(gen, batch)]

    # warm-up: lazy CUDA init and kernels, outside the timed runs
    generate_all(ContinuousGenerator(bundle, slots=4, max_prompt_tokens=max_prompt_tokens, max_new_tokens=8,
                                     eos_ids=eos), prompts[:1])
    hf(prompts[:2], 8)
    mine, t_ours = _timed(ours, device)
    b1: list[list[int]] = []
    t_b1 = 0.0
    for p in prompts[:hf_batch1_prompts]:
        o, t = _timed(lambda: hf([p], max_new_tokens), device)
        b1 += o
        t_b1 += t
    bn, t_bn = _timed(lambda: hf(prompts[:hf_batch], max_new_tokens), device)
    n_ours, n_b1, n_bn = sum(map(len, mine)), sum(map(len, b1)), sum(map(len, bn))
    res = {
        "target": bundle.name_or_path, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "prompts": len(prompts), "slots": slots, "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens, "temperature": temperature, "top_p": top_p, "loop_ngram": loop_ngram,
        "shortest_first": shortest_first, "row_attention": stats["row_attention"], "overlap": False,
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "ours": {"tokens": n_ours, "wall_s": t_ours, "tokens_per_s": n_ours / t_ours, **stats},
        "hf_generate_batch1": {"prompts": hf_batch1_prompts, "tokens": n_b1, "wall_s": t_b1, "tokens_per_s": n_b1 / t_b1},
        "hf_generate_batch_slots": {"prompts": min(hf_batch, len(prompts)), "tokens": n_bn, "wall_s": t_bn,
                                    "tokens_per_s": n_bn / t_bn},
        # greedy only (sampled runs draw differently); bf16 near-ties can flip between batch shapes
        "agreement_batch1": sum(a == b for a, b in zip(mine, b1)) / max(len(b1), 1) if temperature <= 0 else None,
    }
    res["speedup_vs_hf_batch1"] = res["ours"]["tokens_per_s"] / res["hf_generate_batch1"]["tokens_per_s"]
    res["speedup_vs_hf_same_batch"] = res["ours"]["tokens_per_s"] / res["hf_generate_batch_slots"]["tokens_per_s"]
    return res
