"""`dflash-train eval`: measured acceptance length by real speculative decoding with the target.

Flow: drafter checkpoint (load.py) → target (frozen, same template as training) → prompts
(suites.py) → per conversation turn: render with the drafter's chat template → plain target
decoding (reference and baseline) → DFlash speculative decoding (speculate.py) → compare →
offline τ of the same drafter on the same prompts + reference responses (acceptance.py) →
JSON + PNG.

Two drivers, same result: one sequence at a time (speculate.py; any temperature), or, at T = 0,
`batch_size` turns at once (batched.py: static per-row caches, per-row acceptance; token for token
the one-sequence output, tests/unit/test_eval_batched.py), turn by turn over all prompts.

One-sequence decoding (the CPU path) prints a line per finished turn and a heartbeat during long
turns (progress.py); on the CPU, unset --max-prompts / --max-new-tokens get small defaults
(`progress.cpu_defaults`, docs/eval.md).

Multi-turn prompts (MT-Bench has two turns): turn i is asked with the earlier turns answered by
the target's plain (greedy) responses, so both decoders see the same conversation; a response
enters the history as the target emitted it (special tokens kept, the end-of-turn token left to
the template). At T = 0 the
speculative output must equal the reference token for token (`lossless`); every mismatch is
reported with its prompt, turn and first differing index. At T > 0 `lossless` is null and the
reference is still greedy (it gives the baseline speed and the responses for offline τ).

Result fields: tau, tau_per_prompt {id: τ}, accept_histogram [B] (rounds by accepted drafts n),
conditional_accept_per_position [B−1], lossless (true/false at T = 0, null at T > 0), mismatches
[{id, turn, index, speculative, plain}], rounds, tokens (speculative, all turns),
target_tokens_per_s (plain decoding), speculative_tokens_per_s, speedup (speculative ÷ plain tok/s
on the same turns: the wall-clock gain a user sees at this batch size), plain_wall_s,
speculative_wall_s, batch_size, offline_tau_exact, offline_tau_estimate, offline_acc_per_position,
per_prompt (per turn: prompt tokens, tokens, rounds, lossless, stop; both speeds at batch 1),
settings, drafter, target, dataset, provenance, plot. Speeds are host wall-clock over whole
generate calls or batches (prefill included), after one warm-up call.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from dflash_trainer.data.tokenize import resolve_chat_template
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.evaluation.acceptance import offline_acceptance, summarize_rounds
from dflash_trainer.evaluation.batched import plain_batch, speculative_batch
from dflash_trainer.evaluation.chat import eos_token_ids, render_prompt
from dflash_trainer.evaluation.draft import DraftSession
from dflash_trainer.evaluation.load import build_drafter, load_drafter_checkpoint
from dflash_trainer.evaluation.plots import plot_acceptance
from dflash_trainer.evaluation.progress import TurnProgress, cpu_defaults
from dflash_trainer.evaluation.settings import EvalSettings, check_eval_settings
from dflash_trainer.evaluation.speculate import TargetSession, generate_plain, generate_speculative
from dflash_trainer.evaluation.suites import EvalPrompt, load_suite
from dflash_trainer.target_model.batched import unsupported_reason
from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.target_model.load import TargetBundle, load_target
from dflash_trainer.telemetry.provenance import provenance
from dflash_trainer.training.run import resolve_device


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class _Turn:
    """One evaluated turn: prompt ids, the plain (reference) and speculative outputs; walls are
    per turn in sequential mode and None in batched mode (batches are timed as a whole)."""

    id: str
    turn: int
    ids: list[int]
    ref: list[int]
    spec: list[int]
    accepted: list[int]
    stop: str
    ref_wall: float | None = None
    spec_wall: float | None = None


def _response_text(tokenizer: Any, tokens: list[int], eos: set[int]) -> str:
    """The assistant text of a turn for the next turn's history: the generated tokens without
    the end-of-sequence token (the template writes its own), special tokens kept as emitted."""
    return tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=False)


def evaluate(target: TargetBundle, drafter: DFlashDrafter, prompts: list[EvalPrompt], *, chat_template: str,
             enable_thinking: bool | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
             block_size: int | None = None, max_turns: int | None = None, seed: int = 0,
             zero_features: bool = False, offline: bool = True, batch_size: int = 1, cuda_graph: bool = True,
             console: Console | None = None) -> dict[str, Any]:
    """Speculative decoding of every prompt turn against plain decoding; returns the result dict
    (fields in the module docstring). batch_size > 1 decodes that many turns at once
    (evaluation/batched.py, T = 0 only; on CUDA the decode steps and speculative rounds are CUDA
    graph replays unless cuda_graph is False); 1 runs one sequence at a time (any T).
    Raises ValueError on a bad block size, no prompts, or batch_size > 1 with T > 0."""
    console = console or Console(quiet=True)
    if not prompts:
        raise ValueError("no prompts to evaluate")
    B = drafter.config.inference_block_size(block_size)
    if batch_size > 1 and temperature > 0:
        raise ValueError("batched eval is greedy only: use --batch-size 1 with --temperature > 0")
    run = functools.partial(_run_batched, cuda_graph=cuda_graph) if batch_size > 1 else _run_sequential
    turns, ref_wall, spec_wall = run(target, drafter, prompts, chat_template=chat_template,
                                     enable_thinking=enable_thinking, max_new_tokens=max_new_tokens,
                                     temperature=temperature, B=B, max_turns=max_turns, seed=seed,
                                     zero_features=zero_features, batch_size=batch_size, console=console)
    result = _assemble(turns, prompts, B, temperature, ref_wall, spec_wall)
    result.update(max_new_tokens=max_new_tokens, batch_size=batch_size)
    if offline:
        console.print(f"  offline τ: one target + drafter pass per turn over {len(turns)} turns", highlight=False)
        # One turn per forward, of every length: flex would compile per length and skips nothing.
        extractor = TargetFeatureExtractor(target, drafter.config.target_layer_ids, attention="sdpa")
        off = offline_acceptance(drafter, extractor, [(t.ids, t.ref) for t in turns], block_size=B,
                                 zero_features=zero_features)
        result.update({"offline_tau_exact": off["tau_exact"], "offline_tau_estimate": off["tau_estimate"],
                       "offline_acc_per_position": off["acc_per_position"], "offline_blocks": off["num_blocks"]})
    return result


def _run_sequential(target, drafter, prompts, *, chat_template, enable_thinking, max_new_tokens, temperature, B,
                    max_turns, seed, zero_features, batch_size, console) -> tuple[list[_Turn], float, float]:
    """One sequence at a time (speculate.py), each turn timed on its own."""
    tok = target.tokenizer
    eos = eos_token_ids(target)
    device = target.embed_tokens.weight.device
    tsess = TargetSession(target, drafter.config.target_layer_ids)
    dsess = DraftSession(drafter, zero_features=zero_features)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    # Warm-up outside the timed region (first-call allocations, lazy kernels).
    console.print("  warming up (one short speculative decode)", highlight=False)
    warm = render_prompt(tok, chat_template, prompts[0].messages([]), enable_thinking)
    generate_speculative(tsess, dsess, warm, block_size=B, max_new_tokens=2 * B, eos_ids=eos, temperature=0.0)
    user_turns = [prompt.user_turns[:max_turns] if max_turns else prompt.user_turns for prompt in prompts]
    progress = TurnProgress(console, num_prompts=len(prompts), num_turns=sum(map(len, user_turns)), block_size=B)
    turns: list[_Turn] = []
    for pi, prompt in enumerate(prompts):
        responses: list[str] = []
        for ti in range(len(user_turns[pi])):
            progress.begin(pi, prompt.id, ti, len(user_turns[pi]))
            ids = render_prompt(tok, chat_template, prompt.messages(responses), enable_thinking)
            progress.phase("plain decoding")
            ref = generate_plain(tsess, ids, max_new_tokens=max_new_tokens, eos_ids=eos, on_token=progress.tick)
            progress.phase("speculative decoding")
            spec = generate_speculative(tsess, dsess, ids, block_size=B, max_new_tokens=max_new_tokens, eos_ids=eos,
                                        temperature=temperature, generator=gen, on_token=progress.tick)
            turns.append(_Turn(prompt.id, ti, ids, ref.tokens, spec.tokens, spec.accepted, spec.stop,
                               ref.wall_s, spec.wall_s))
            progress.end(len(spec.tokens), len(ref.tokens), spec.accepted, ref.wall_s, spec.wall_s)
            responses.append(_response_text(tok, ref.tokens, eos))
    return turns, sum(t.ref_wall for t in turns), sum(t.spec_wall for t in turns)


def _run_batched(target, drafter, prompts, *, chat_template, enable_thinking, max_new_tokens, temperature, B,
                 max_turns, seed, zero_features, batch_size, console, cuda_graph=True) -> tuple[list[_Turn], float, float]:
    """Turn by turn over all prompts, `batch_size` prompts decoded at once (plain, then
    speculative), longest prompts together. Walls are whole-batch host times."""
    tok = target.tokenizer
    eos = eos_token_ids(target)
    layer_ids = drafter.config.target_layer_ids
    warm = [render_prompt(tok, chat_template, prompts[0].messages([]), enable_thinking)]
    plain_batch(target, warm, max_new_tokens=2, eos_ids=eos, cuda_graph=cuda_graph)  # warm-up: lazy kernels, allocator
    speculative_batch(target, drafter, warm, block_size=B, max_new_tokens=2 * B, eos_ids=eos, layer_ids=layer_ids,
                      cuda_graph=cuda_graph)
    user_turns = {p.id: (p.user_turns[:max_turns] if max_turns else p.user_turns) for p in prompts}
    responses: dict[str, list[str]] = {p.id: [] for p in prompts}
    turns: list[_Turn] = []
    ref_wall = spec_wall = 0.0
    for ti in range(max(len(u) for u in user_turns.values())):
        todo = [(p, render_prompt(tok, chat_template, p.messages(responses[p.id]), enable_thinking))
                for p in prompts if ti < len(user_turns[p.id])]
        todo.sort(key=lambda x: len(x[1]))
        for c0 in range(0, len(todo), batch_size):
            chunk = todo[c0:c0 + batch_size]
            ids = [x[1] for x in chunk]
            ref = plain_batch(target, ids, max_new_tokens=max_new_tokens, eos_ids=eos, cuda_graph=cuda_graph)
            spec = speculative_batch(target, drafter, ids, block_size=B, max_new_tokens=max_new_tokens, eos_ids=eos,
                                     layer_ids=layer_ids, zero_features=zero_features, cuda_graph=cuda_graph)
            ref_wall += ref.wall_s
            spec_wall += spec.wall_s
            for r, (p, pid) in enumerate(chunk):
                turns.append(_Turn(p.id, ti, pid, ref.tokens[r], spec.tokens[r], spec.accepted[r], spec.stop[r]))
                responses[p.id].append(_response_text(tok, ref.tokens[r], eos))
            n = sum(len(t) for t in spec.tokens)
            console.print(f"  turn {ti + 1}: {c0 + len(chunk)}/{len(todo)} prompts, plain {ref.wall_s:.1f} s, "
                          f"speculative {spec.wall_s:.1f} s ({n / max(spec.wall_s, 1e-9):,.1f} tok/s)")
    order = {p.id: i for i, p in enumerate(prompts)}
    turns.sort(key=lambda t: (order[t.id], t.turn))
    return turns, ref_wall, spec_wall


def _assemble(turns: list[_Turn], prompts: list[EvalPrompt], B: int, temperature: float, ref_wall: float,
              spec_wall: float) -> dict[str, Any]:
    """The result dict (module docstring) from the evaluated turns."""
    mismatches: list[dict[str, Any]] = []
    details: dict[str, list[dict[str, Any]]] = {p.id: [] for p in prompts}
    accepted: dict[str, list[int]] = {p.id: [] for p in prompts}
    for t in turns:
        lossless = None
        if temperature <= 0:
            at = _first_mismatch(t.spec, t.ref)
            lossless = at is None
            if at is not None:
                mismatches.append({"id": t.id, "turn": t.turn, "index": at,
                                   "speculative": t.spec[at] if at < len(t.spec) else None,
                                   "plain": t.ref[at] if at < len(t.ref) else None})
        accepted[t.id] += t.accepted
        row = {"turn": t.turn, "prompt_tokens": len(t.ids), "tokens": len(t.spec), "rounds": len(t.accepted),
               "lossless": lossless, "stop": t.stop}
        if t.ref_wall is not None and t.spec_wall is not None:
            row.update(plain_tokens_per_s=len(t.ref) / max(t.ref_wall, 1e-9),
                       speculative_tokens_per_s=len(t.spec) / max(t.spec_wall, 1e-9))
        details[t.id].append(row)
    summary = summarize_rounds(accepted, B)
    ref_tokens, spec_tokens = sum(len(t.ref) for t in turns), sum(len(t.spec) for t in turns)
    target_tps, spec_tps = ref_tokens / max(ref_wall, 1e-9), spec_tokens / max(spec_wall, 1e-9)
    return {
        "tau": summary["tau"],
        "tau_per_prompt": summary["tau_per_prompt"],
        "accept_histogram": summary["accept_histogram"],
        "conditional_accept_per_position": summary["conditional_accept_per_position"],
        "lossless": (not mismatches) if temperature <= 0 else None,
        "mismatches": mismatches,
        "rounds": summary["rounds"],
        "tokens": int(spec_tokens),
        "target_tokens_per_s": target_tps,
        "speculative_tokens_per_s": spec_tps,
        "speedup": spec_tps / max(target_tps, 1e-9),
        "plain_wall_s": ref_wall,
        "speculative_wall_s": spec_wall,
        "block_size": B,
        "temperature": temperature,
        "num_prompts": len(prompts),
        "num_turns": len(turns),
        "per_prompt": [{"id": pid, "turns": rows} for pid, rows in details.items()],
    }


def run_eval(settings: EvalSettings, console: Console | None = None) -> dict[str, Any]:
    """Load everything named by the settings, evaluate, write JSON and PNG; returns the result."""
    console = console or Console()
    check_eval_settings(settings)  # values, device, paths: before the slow target load
    device = resolve_device(settings.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    max_prompts, max_new_tokens, note = cpu_defaults(settings.max_prompts, settings.max_new_tokens, device.type)
    if note:
        console.print(f"note: {note}", highlight=False)
    prompts = load_suite(settings.dataset, max_prompts)
    console.print(f"eval: loading target {settings.target or 'SmolLM2-135M-Instruct (embedded GGUF, ~40 s on CPU)'} "
                  f"on {device.type}, then the drafter", highlight=False)
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
    batch_size = settings.batch_size or (256 if device.type == "cuda" and settings.temperature <= 0 else 1)
    why_not = unsupported_reason(target) if batch_size > 1 else None
    if why_not and settings.batch_size is None:  # the default only: an explicit --batch-size fails below, saying why
        console.print(f"note: one sequence at a time: the batched engine cannot run this target ({why_not})",
                      highlight=False)
        batch_size = 1
    console.print(f"eval: drafter {ckpt.path} ({ckpt.format}, B={ckpt.config.block_size}), target {target.name_or_path}, "
                  f"{settings.dataset}: {len(prompts)} prompts, max_new_tokens {max_new_tokens}, "
                  f"T={settings.temperature}")
    result = evaluate(target, drafter, prompts, chat_template=template, enable_thinking=ckpt.enable_thinking,
                      max_new_tokens=max_new_tokens, temperature=settings.temperature,
                      block_size=settings.block_size, max_turns=settings.max_turns, seed=settings.seed,
                      zero_features=ckpt.no_target_features, offline=settings.offline, batch_size=batch_size,
                      cuda_graph=settings.cuda_graph, console=console)
    # what ran: the CPU defaults when they applied
    result["settings"] = {**asdict(settings), "max_prompts": max_prompts, "max_new_tokens": max_new_tokens}
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
