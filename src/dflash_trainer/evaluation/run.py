"""`dflash-train eval`: measured acceptance length by real speculative decoding with the target.

Flow: drafter checkpoint (load.py) → target (frozen, same template as training) → prompts
(suites.py) → per conversation turn: render with the drafter's chat template → plain target
decoding (reference and baseline) → DFlash speculative decoding (speculate.py) → compare →
offline τ of the same drafter on the same prompts + reference responses (acceptance.py) →
JSON + PNG.

Multi-turn prompts (MT-Bench has two turns): turn i is asked with the earlier turns answered by
the target's plain (greedy) responses, so both decoders see the same conversation. At T = 0 the
speculative output must equal the reference token for token (`lossless`); every mismatch is
reported with its prompt, turn and first differing index. At T > 0 `lossless` is null and the
reference is still greedy (it gives the baseline speed and the responses for offline τ).

Result fields: tau, tau_per_prompt {id: τ}, accept_histogram [B] (rounds by accepted drafts n),
conditional_accept_per_position [B−1], lossless (true/false at T = 0, null at T > 0), mismatches
[{id, turn, index, speculative, plain}], rounds, tokens (speculative, all turns),
target_tokens_per_s (plain decoding), speculative_tokens_per_s, speedup, offline_tau_exact,
offline_tau_estimate, offline_acc_per_position, per_prompt (per turn: prompt tokens, tokens,
rounds, lossless, stop, both speeds), settings, drafter, target, dataset, provenance, plot.
Speeds are host wall-clock over whole generate calls (prefill included), after one warm-up call.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from dflash_trainer.data.tokenize import resolve_chat_template
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.evaluation.acceptance import offline_acceptance, summarize_rounds
from dflash_trainer.evaluation.chat import eos_token_ids, render_prompt
from dflash_trainer.evaluation.draft import DraftSession
from dflash_trainer.evaluation.load import (build_drafter, checkpoint_format, load_drafter_checkpoint,
                                             resolve_drafter_path)
from dflash_trainer.evaluation.plots import plot_acceptance
from dflash_trainer.evaluation.speculate import TargetSession, generate_plain, generate_speculative
from dflash_trainer.evaluation.suites import EvalPrompt, load_suite
from dflash_trainer.target.features import TargetFeatureExtractor
from dflash_trainer.target.load import TargetBundle, load_target
from dflash_trainer.telemetry.provenance import provenance
from dflash_trainer.training.run import resolve_device


@dataclass
class EvalSettings:
    """What `dflash-train eval` runs. block_size None = the trained B; max_turns None = all turns;
    json_out / plot_out None = not written (plot_out defaults to json_out with .png)."""

    drafter: str
    target: str | None = None
    dataset: str = "mt-bench"
    max_prompts: int | None = 10
    max_new_tokens: int = 256
    temperature: float = 0.0
    block_size: int | None = None
    max_turns: int | None = None
    json_out: str | None = None
    plot_out: str | None = None
    device: str = "auto"
    seed: int = 0
    offline: bool = True
    threads: int | None = None  # CPU intra-op threads (None = torch's default); decoding is latency-bound


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def evaluate(target: TargetBundle, drafter: DFlashDrafter, prompts: list[EvalPrompt], *, chat_template: str,
             enable_thinking: bool | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
             block_size: int | None = None, max_turns: int | None = None, seed: int = 0,
             zero_features: bool = False, offline: bool = True, console: Console | None = None) -> dict[str, Any]:
    """Speculative decoding of every prompt turn against plain decoding; returns the result dict
    (fields in the module docstring). Raises ValueError on a bad block size or no prompts."""
    console = console or Console(quiet=True)
    if not prompts:
        raise ValueError("no prompts to evaluate")
    cfg = drafter.config
    B = block_size or cfg.block_size
    if not 2 <= B <= cfg.block_size:
        raise ValueError(f"block_size={B}: use 2..{cfg.block_size} (the drafter was trained at B={cfg.block_size})")
    tok = target.tokenizer
    eos = eos_token_ids(target)
    device = target.embed_tokens.weight.device
    tsess = TargetSession(target, cfg.target_layer_ids)
    dsess = DraftSession(drafter, zero_features=zero_features)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    # Warm-up outside the timed region (first-call allocations, lazy kernels).
    warm = render_prompt(tok, chat_template, prompts[0].messages([]), enable_thinking)
    generate_speculative(tsess, dsess, warm, block_size=B, max_new_tokens=2 * B, eos_ids=eos, temperature=0.0)

    accepted: dict[str, list[int]] = {}
    details: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    sequences: list[tuple[list[int], list[int]]] = []
    ref_tokens = ref_wall = spec_tokens = spec_wall = 0.0
    for pi, prompt in enumerate(prompts):
        turns = prompt.user_turns[:max_turns] if max_turns else prompt.user_turns
        responses: list[str] = []
        rounds: list[int] = []
        turn_rows = []
        for ti in range(len(turns)):
            ids = render_prompt(tok, chat_template, prompt.messages(responses), enable_thinking)
            ref = generate_plain(tsess, ids, max_new_tokens=max_new_tokens, eos_ids=eos)
            spec = generate_speculative(tsess, dsess, ids, block_size=B, max_new_tokens=max_new_tokens, eos_ids=eos,
                                        temperature=temperature, generator=gen)
            lossless = None
            if temperature <= 0:
                at = _first_mismatch(spec.tokens, ref.tokens)
                lossless = at is None
                if at is not None:
                    mismatches.append({"id": prompt.id, "turn": ti, "index": at,
                                       "speculative": spec.tokens[at] if at < len(spec.tokens) else None,
                                       "plain": ref.tokens[at] if at < len(ref.tokens) else None})
            rounds += spec.accepted
            ref_tokens += len(ref.tokens)
            ref_wall += ref.wall_s
            spec_tokens += len(spec.tokens)
            spec_wall += spec.wall_s
            sequences.append((ids, ref.tokens))
            turn_rows.append({"turn": ti, "prompt_tokens": len(ids), "tokens": len(spec.tokens),
                              "rounds": len(spec.accepted), "lossless": lossless, "stop": spec.stop,
                              "plain_tokens_per_s": len(ref.tokens) / max(ref.wall_s, 1e-9),
                              "speculative_tokens_per_s": len(spec.tokens) / max(spec.wall_s, 1e-9)})
            body = [t for t in ref.tokens if t not in eos]
            responses.append(tok.decode(body, skip_special_tokens=True))
        accepted[prompt.id] = rounds
        details.append({"id": prompt.id, "turns": turn_rows})
        r = summarize_rounds({prompt.id: rounds}, B)["tau"]
        console.print(f"  [{pi + 1}/{len(prompts)}] {prompt.id}: τ {r if r is None else round(r, 2)}, "
                      f"{sum(t['tokens'] for t in turn_rows)} tokens, "
                      f"lossless {all(t['lossless'] is not False for t in turn_rows)}")

    summary = summarize_rounds(accepted, B)
    result: dict[str, Any] = {
        "tau": summary["tau"],
        "tau_per_prompt": summary["tau_per_prompt"],
        "accept_histogram": summary["accept_histogram"],
        "conditional_accept_per_position": summary["conditional_accept_per_position"],
        "lossless": (not mismatches) if temperature <= 0 else None,
        "mismatches": mismatches,
        "rounds": summary["rounds"],
        "tokens": int(spec_tokens),
        "target_tokens_per_s": ref_tokens / max(ref_wall, 1e-9),
        "speculative_tokens_per_s": spec_tokens / max(spec_wall, 1e-9),
        "speedup": (spec_tokens / max(spec_wall, 1e-9)) / max(ref_tokens / max(ref_wall, 1e-9), 1e-9),
        "block_size": B,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(prompts),
        "num_turns": sum(len(d["turns"]) for d in details),
        "per_prompt": details,
    }
    if offline:
        extractor = TargetFeatureExtractor(target, cfg.target_layer_ids)
        off = offline_acceptance(drafter, extractor, sequences, block_size=B, zero_features=zero_features)
        result.update({"offline_tau_exact": off["tau_exact"], "offline_tau_estimate": off["tau_estimate"],
                       "offline_acc_per_position": off["acc_per_position"], "offline_blocks": off["num_blocks"]})
    return result


def run_eval(settings: EvalSettings, console: Console | None = None) -> dict[str, Any]:
    """Load everything named by the settings, evaluate, write JSON and PNG; returns the result."""
    console = console or Console()
    if settings.temperature < 0:
        raise ValueError(f"temperature={settings.temperature} must be >= 0 (0 = greedy)")
    if settings.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={settings.max_new_tokens} must be >= 1")
    device = resolve_device(settings.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    checkpoint_format(resolve_drafter_path(settings.drafter))  # fail before the slow target load
    prompts = load_suite(settings.dataset, settings.max_prompts)
    target = load_target(settings.target, device=device, dtype=torch.float32)
    ckpt = load_drafter_checkpoint(settings.drafter, num_target_layers=target.num_layers)
    if target.tokenizer is None:
        raise ValueError(f"target {target.name_or_path} has no tokenizer; eval renders chat prompts")
    template = ckpt.chat_template
    if template is None:
        console.print("[yellow]warning:[/] the checkpoint records no chat template; using the target tokenizer's "
                      "(acceptance drops when it differs from the training template)")
        template = resolve_chat_template(target.tokenizer)
    drafter = build_drafter(ckpt, target)
    console.print(f"eval: drafter {ckpt.path} ({ckpt.format}, B={ckpt.config.block_size}), target {target.name_or_path}, "
                  f"{settings.dataset}: {len(prompts)} prompts, max_new_tokens {settings.max_new_tokens}, "
                  f"T={settings.temperature}")
    result = evaluate(target, drafter, prompts, chat_template=template, enable_thinking=ckpt.enable_thinking,
                      max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                      block_size=settings.block_size, max_turns=settings.max_turns, seed=settings.seed,
                      zero_features=ckpt.no_target_features, offline=settings.offline, console=console)
    result["settings"] = asdict(settings)
    result["drafter"] = {"path": str(ckpt.path), "format": ckpt.format, "trained_block_size": ckpt.config.block_size,
                         "no_target_features": ckpt.no_target_features, "target_at_training": ckpt.metadata.get("target")}
    result["target"] = target.name_or_path
    result["dataset"] = settings.dataset
    result["provenance"] = provenance()
    plot = settings.plot_out or (str(Path(settings.json_out).with_suffix(".png")) if settings.json_out else None)
    if plot:
        plot_acceptance(result["conditional_accept_per_position"], result["accept_histogram"], plot,
                        title=f"{settings.dataset}, B={result['block_size']}, T={settings.temperature}",
                        tau=result["tau"], offline_tau=result.get("offline_tau_exact"))
        result["plot"] = plot
    if settings.json_out:
        Path(settings.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result
