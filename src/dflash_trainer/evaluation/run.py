"""`dflash-train eval`: measured acceptance length by real speculative decoding with the target.

Flow: drafter (load.py), target, prompts (suites.py); turn by turn over all prompts, `batch_size`
turns at once on one engine (engine.py), each rendered with the drafter's chat template and decoded
plain (greedy: reference and baseline), then speculatively; then the offline τ of the same drafter
on the same prompts and reference responses (acceptance.py), JSON + PNG, and with `batch_sizes` a
speedup table (speedup.py). Every row of a batch decodes as it would alone (batch-size independence
at T = 0, tests/unit/test_engine.py). Progress: progress.py; CPU defaults: docs/eval.md.

Multi-turn prompts (MT-Bench has two turns): turn i is asked with the earlier turns answered by
the target's plain (greedy) responses, so both decoders see the same conversation; a response
enters the history as the target emitted it (special tokens kept, the end-of-turn token left to
the template). At T = 0 the speculative output must equal the reference token for token
(`lossless`); every mismatch is reported with its prompt, turn and first differing index. At T > 0
(speculative sampling) `lossless` is null and the reference is still greedy (it gives the baseline
speed and the responses for offline τ).

Result fields: tau (tokens committed by the verify rounds / rounds, decoding/acceptance.py),
tau_uncapped (mean n+1 over rounds, also counting what a turn's last round accepted past its eos or
cap), committed_tokens, tau_per_prompt {id: τ}, accept_histogram [B] (rounds by accepted drafts n),
conditional_accept_per_position [B−1], lossless (true/false at T = 0, null at T > 0), mismatches
[{id, turn, index, speculative, plain}], rounds, tokens (speculative, all turns),
target_tokens_per_s (plain decoding), speculative_tokens_per_s, speedup (speculative ÷ plain tok/s
on the same turns: the wall-clock gain a user sees at this batch size), plain_wall_s,
speculative_wall_s, batch_size, target_dtype (what ran: bfloat16 by default on CUDA, float32 on
the CPU or with --dtype float32), cuda_graphs (the modes replayed from CUDA graphs: plain and
speculative on CUDA, [] when eager), step_attention (how the target's steps attended: batched.default_step_attention,
"sdpa" for a bf16 target above one row, "cache" for fp32 or one row; None on the HF-cache path), offline_tau_exact,
offline_tau_estimate, offline_acc_per_position, offline_tau_walk and offline_walk_rounds (the offline blocks at
decoding's anchors only: measured τ up to rounding, decoding/acceptance.py),
per_prompt (the prompt's category when the suite names one, MT-Bench's; per turn: prompt tokens, tokens,
rounds, lossless, stop; both speeds at batch 1), tau_breakdown (committed τ by turn, by how the turn
ended and by category: decoding/committed.py),
max_prompt_tokens, skipped [{id, turn, prompt_tokens}] (conversations stopped at a turn whose prompt
is over max_prompt_tokens) and skipped_turns (the turns not decoded for that),
speedup_table (with batch_sizes; per batch size all B−1 drafts and the chosen draft length k,
evaluation/speedup.py and draft_length.py), settings, drafter, target, dataset, provenance, plot. Speeds are
host wall-clock over whole batches (prefill included), after a warm-up (the speedup table's: steady
continuous batches, speedup.py); graph capture is not timed.
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
from dflash_trainer.decoding.acceptance import committed_by_rounds, offline_acceptance, summarize_rounds
from dflash_trainer.decoding.committed import tau_breakdown
from dflash_trainer.data.render import eos_token_ids, render_prompt
from dflash_trainer.decoding.engine import DecodeEngine
from dflash_trainer.evaluation.load import build_drafter, load_drafter_checkpoint
from dflash_trainer.evaluation.record import portable_record
from dflash_trainer.evaluation.plots import plot_acceptance, plot_speedup
from dflash_trainer.evaluation.progress import TurnProgress, cpu_defaults
from dflash_trainer.evaluation.settings import EvalSettings, check_eval_settings
from dflash_trainer.evaluation.speedup import speedup_table
from dflash_trainer.interop.fingerprint import weights_fingerprint
from dflash_trainer.data.suites import EvalPrompt, load_suite
from dflash_trainer.decoding.batched import unsupported_reason
from dflash_trainer.target_model.families import TargetSupport, check_supported, target_support
from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.target_model.load import TargetBundle, load_target
from dflash_trainer.telemetry.provenance import provenance
from dflash_trainer.training.precision import compute_dtype, set_cpu_threads
from dflash_trainer.training.run import resolve_device


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if at == len(a) == len(b) else at


@dataclass
class _Turn:
    """One evaluated turn: prompt ids, the plain (reference) and speculative outputs; speeds (both
    tok/s) only at batch 1, as larger batches are timed as a whole."""

    id: str
    turn: int
    ids: list[int]
    ref: list[int]
    spec: list[int]
    accepted: list[int]
    stop: str
    speeds: dict[str, float]


def evaluate(target: TargetBundle, drafter: DFlashDrafter, prompts: list[EvalPrompt], *, chat_template: str,
             enable_thinking: bool | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
             block_size: int | None = None, max_turns: int | None = None, seed: int = 0,
             zero_features: bool = False, offline: bool = True, batch_size: int = 1, cuda_graph: bool = True,
             max_prompt_tokens: int | None = None, console: Console | None = None) -> dict[str, Any]:
    """Speculative decoding of every prompt turn against plain decoding; returns the result dict
    (fields in the module docstring). Turn by turn over all prompts, `batch_size` turns at once
    (decoding/engine.py; on CUDA each plain step and speculative round is a CUDA graph replay
    unless cuda_graph is False). max_prompt_tokens: a turn whose rendered prompt is longer is not
    decoded, nor are its conversation's later turns (their history would need its answer); each
    such conversation is listed in `skipped` ({id, turn, prompt_tokens}) and counted in
    `skipped_turns` (None = no cap). Raises ValueError on a bad block size, batch size, no prompts,
    or when every first turn is over max_prompt_tokens."""
    console = console or Console(quiet=True)
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    B = drafter.config.inference_block_size(block_size)
    tok, eos = target.tokenizer, eos_token_ids(target)
    gen = torch.Generator(device=target.embed_tokens.weight.device).manual_seed(seed)
    user_turns = {p.id: (p.user_turns[:max_turns] if max_turns else p.user_turns) for p in prompts}
    responses: dict[str, list[str]] = {p.id: [] for p in prompts}
    progress = TurnProgress(console, num_turns=sum(map(len, user_turns.values())))
    turns: list[_Turn] = []
    ref_wall = spec_wall = 0.0
    one_row = unsupported_reason(target)  # not on the static-cache path: the HF model's own cache, one row
    if one_row and batch_size > 1:
        console.print(f"  batch size 1, not {batch_size}: {one_row}; decoding with the model's own forward",
                      highlight=False)
    skipped: list[dict[str, Any]] = []  # the first turn over max_prompt_tokens of each conversation cut there
    stopped: set[str] = set()
    for ti in range(max(map(len, user_turns.values()))):
        todo = [(pi, p, render_prompt(tok, chat_template, p.messages(responses[p.id]), enable_thinking))
                for pi, p in enumerate(prompts) if ti < len(user_turns[p.id]) and p.id not in stopped]
        if max_prompt_tokens is not None:
            for _, p, ids in todo:
                if len(ids) > max_prompt_tokens:
                    stopped.add(p.id)
                    skipped.append({"id": p.id, "turn": ti, "prompt_tokens": len(ids)})
                    progress.num_turns -= len(user_turns[p.id]) - ti  # the turns left to decode (ETA)
            todo = [x for x in todo if x[1].id not in stopped]
            if not todo and ti == 0:
                raise ValueError(f"every first turn has more than {max_prompt_tokens} prompt tokens (--max-prompt-tokens)"
                                 f"; the shortest has {min(s['prompt_tokens'] for s in skipped)}: raise --max-prompt-tokens")
        if not todo:
            break
        if batch_size > 1:
            todo.sort(key=lambda x: len(x[2]))  # similar lengths decode together
        rows = 1 if one_row else min(batch_size, len(todo))
        engine = DecodeEngine(target, drafter, rows=rows, max_prompt_tokens=max(len(x[2]) for x in todo),
                              max_new_tokens=max_new_tokens, eos_ids=eos, block_size=B, temperature=temperature,
                              generator=gen, zero_features=zero_features, cuda_graph=cuda_graph)
        if ti == 0:  # warm-up outside the timed region (first-call allocations, lazy kernels)
            console.print("  warming up (one short speculative decode)", highlight=False)
            engine.warm_up(todo[0][2])
        for c0 in range(0, len(todo), rows):
            chunk = todo[c0:c0 + rows]
            ids = [x[2] for x in chunk]
            if rows == 1:
                pi, p, _ = chunk[0]
                progress.begin(f"prompt {pi + 1}/{len(prompts)} turn {ti + 1}/{len(user_turns[p.id])}", p.id)
            else:
                progress.begin(f"turn {ti + 1} prompts {c0 + 1}-{c0 + len(chunk)}/{len(todo)}")
            progress.phase("plain decoding")
            ref = engine.decode(ids, speculative=False, on_round=progress.tick)
            progress.phase("speculative decoding")
            spec = engine.decode(ids, speculative=True, on_round=progress.tick)
            ref_wall += ref.wall_s
            spec_wall += spec.wall_s
            for r, (_, p, pid) in enumerate(chunk):
                speeds = {} if rows > 1 else {"plain_tokens_per_s": len(ref.tokens[r]) / max(ref.wall_s, 1e-9),
                                              "speculative_tokens_per_s": len(spec.tokens[r]) / max(spec.wall_s, 1e-9)}
                turns.append(_Turn(p.id, ti, pid, ref.tokens[r], spec.tokens[r], spec.accepted[r], spec.stop[r],
                                   speeds))
                # the next turn's history: without the eos (the template writes its own), special tokens kept
                body = [t for t in ref.tokens[r] if t not in eos]
                responses[p.id].append(tok.decode(body, skip_special_tokens=False))
            progress.end(len(chunk), sum(map(len, spec.tokens)), sum(map(len, ref.tokens)),
                         [n for a in spec.accepted for n in a], sum(map(committed_by_rounds, spec.tokens)),
                         ref.wall_s, spec.wall_s)
        replayed, step_attention = sorted(engine.graphs), engine.step_attention
        del engine  # its caches go before the next turn's are made
    order = {p.id: i for i, p in enumerate(prompts)}
    turns.sort(key=lambda t: (order[t.id], t.turn))
    result = _assemble(turns, prompts, B, temperature, ref_wall, spec_wall)
    skipped_turns = sum(len(user_turns[s["id"]]) - s["turn"] for s in skipped)
    if skipped:
        console.print(f"  skipped {skipped_turns} turns of {len(skipped)} conversations: a prompt over "
                      f"{max_prompt_tokens} tokens (--max-prompt-tokens; the conversation stops there)", highlight=False)
    result.update(skipped=skipped, skipped_turns=skipped_turns, max_prompt_tokens=max_prompt_tokens)
    result.update(max_new_tokens=max_new_tokens, batch_size=1 if one_row else batch_size,
                  target_dtype=str(target.embed_tokens.weight.dtype).removeprefix("torch."), cuda_graphs=replayed,
                  step_attention=step_attention)
    if offline:
        console.print(f"  offline τ: one target + drafter pass per turn over {len(turns)} turns", highlight=False)
        # One turn per forward, of every length: flex would compile per length and skips nothing; the
        # dense path is SDPA, or eager for families SDPA cannot run exactly (target_model/families.py).
        extractor = TargetFeatureExtractor(target, drafter.config.target_layer_ids,
                                           attention=target_support(target.model).dense_path)
        off = offline_acceptance(drafter, extractor, [(t.ids, t.ref) for t in turns], block_size=B,
                                 zero_features=zero_features)
        result.update({"offline_tau_exact": off["tau_exact"], "offline_tau_estimate": off["tau_estimate"],
                       "offline_acc_per_position": off["acc_per_position"], "offline_blocks": off["num_blocks"],
                       "offline_tau_walk": off["tau_walk"], "offline_walk_rounds": off["walk_rounds"]})
    return result


def _assemble(turns: list[_Turn], prompts: list[EvalPrompt], B: int, temperature: float, ref_wall: float,
              spec_wall: float) -> dict[str, Any]:
    """The result dict (module docstring) from the evaluated turns."""
    mismatches: list[dict[str, Any]] = []
    details: dict[str, list[dict[str, Any]]] = {p.id: [] for p in prompts}
    accepted: dict[str, list[int]] = {p.id: [] for p in prompts}
    committed: dict[str, int] = {p.id: 0 for p in prompts}
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
        committed[t.id] += committed_by_rounds(t.spec)
        details[t.id].append({"turn": t.turn, "prompt_tokens": len(t.ids), "tokens": len(t.spec),
                              "rounds": len(t.accepted), "lossless": lossless, "stop": t.stop, **t.speeds})
    summary = summarize_rounds(accepted, committed, B)
    ref_tokens, spec_tokens = sum(len(t.ref) for t in turns), sum(len(t.spec) for t in turns)
    target_tps, spec_tps = ref_tokens / max(ref_wall, 1e-9), spec_tokens / max(spec_wall, 1e-9)
    category = {p.id: p.meta["category"] for p in prompts if p.meta.get("category")}
    per_prompt = [{"id": pid, **({"category": category[pid]} if pid in category else {}), "turns": rows}
                  for pid, rows in details.items()]
    return {**{k: summary[k] for k in ("tau", "tau_uncapped", "committed_tokens", "tau_per_prompt", "accept_histogram",
                                        "conditional_accept_per_position")},
            "lossless": (not mismatches) if temperature <= 0 else None, "mismatches": mismatches,
            "rounds": summary["rounds"], "tokens": int(spec_tokens), "target_tokens_per_s": target_tps,
            "speculative_tokens_per_s": spec_tps, "speedup": spec_tps / max(target_tps, 1e-9),
            "plain_wall_s": ref_wall, "speculative_wall_s": spec_wall, "block_size": B, "temperature": temperature,
            "num_prompts": len(prompts), "num_turns": len(turns),
            "per_prompt": per_prompt, "tau_breakdown": tau_breakdown(per_prompt)}


def check_decodable(support: TargetSupport) -> None:
    """Raise ValueError (one line) for a target speculative decoding here cannot run: a refused family,
    or layers that carry state across positions (the state of rejected drafts cannot be dropped
    from the target's cache the way rejected keys and values are cropped)."""
    check_supported(support)
    if support.stateful:
        raise ValueError(f"eval: {support.architecture} has {support.stateful}, which carry state across positions; "
                         "speculative decoding here drops rejected drafts by cropping the KV cache, which cannot undo "
                         "that state; use the offline τ of train's validation (summary.json) for this target")


def target_dtype(name: str, device: torch.device) -> torch.dtype:
    """The target's dtype for `--dtype` name: auto = bfloat16 on CUDA (the speed a server sees),
    float32 on the CPU (no fast bf16 kernels there, and the exact lossless check)."""
    return compute_dtype(device) if name == "auto" else {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def run_eval(settings: EvalSettings, console: Console | None = None) -> dict[str, Any]:
    """Load everything named by the settings, evaluate, write JSON and PNG; returns the result."""
    console = console or Console()
    check_eval_settings(settings)  # values, device, paths: before the slow target load
    device = resolve_device(settings.device)
    hint = set_cpu_threads(settings.threads, device, "--threads 1")
    if hint:
        console.print(f"note: {hint}", highlight=False)
    max_prompts, max_new_tokens, note = cpu_defaults(settings.max_prompts, settings.max_new_tokens, device.type)
    if note:
        console.print(f"note: {note}", highlight=False)
    prompts = load_suite(settings.dataset, max_prompts)
    console.print(f"eval: loading target {settings.target or 'SmolLM2-135M-Instruct (embedded GGUF, ~40 s on CPU)'} "
                  f"on {device.type}, then the drafter", highlight=False)
    dtype = target_dtype(settings.dtype, device)
    target = load_target(settings.target, device=device, dtype=dtype)
    check_decodable(target_support(target.model))
    ckpt = load_drafter_checkpoint(settings.drafter, num_target_layers=target.num_layers)
    if target.tokenizer is None:
        raise ValueError(f"target {target.name_or_path} has no tokenizer; eval renders chat prompts")
    template = ckpt.chat_template
    if template is None:
        console.print("[yellow]warning:[/] the checkpoint records no chat template; using the target tokenizer's "
                      "(acceptance drops when it differs from the training template)")
        template = resolve_chat_template(target.tokenizer)
    drafter = build_drafter(ckpt, target)
    batch_size = settings.batch_size or (256 if device.type == "cuda" else 1)
    console.print(f"eval: drafter {ckpt.path} ({ckpt.format}, B={ckpt.config.block_size}), target "
                  f"{target.name_or_path} ({str(dtype).removeprefix('torch.')}), {settings.dataset}: {len(prompts)} "
                  f"prompts, max_new_tokens {max_new_tokens}, T={settings.temperature}, batch {batch_size}")
    result = evaluate(target, drafter, prompts, chat_template=template, enable_thinking=ckpt.enable_thinking,
                      max_new_tokens=max_new_tokens, temperature=settings.temperature,
                      block_size=settings.block_size, max_turns=settings.max_turns, seed=settings.seed,
                      zero_features=ckpt.no_target_features, offline=settings.offline, batch_size=batch_size,
                      cuda_graph=settings.cuda_graph, max_prompt_tokens=settings.max_prompt_tokens, console=console)
    if settings.batch_sizes:
        first_turns = [ids for p in prompts
                       if len(ids := render_prompt(target.tokenizer, template, p.messages([]), ckpt.enable_thinking))
                       <= settings.max_prompt_tokens]  # the turns the eval decoded (the rest are in `skipped`)
        sizes, one_row = settings.batch_sizes, unsupported_reason(target)
        if one_row and sizes != [1]:  # the HF cache path decodes one row
            console.print(f"  speedup table at batch size 1 only, not {sizes}: {one_row}", highlight=False)
            sizes = [1]
        result["speedup_table"] = speedup_table(
            target, drafter, first_turns, sizes, max_new_tokens=max_new_tokens,
            block_size=settings.block_size, temperature=settings.temperature, seed=settings.seed,
            zero_features=ckpt.no_target_features, cuda_graph=settings.cuda_graph, console=console)
    # settings: what ran (the CPU defaults when they applied)
    result.update(settings={**asdict(settings), "max_prompts": max_prompts, "max_new_tokens": max_new_tokens},
                  drafter={"path": str(ckpt.path), "format": ckpt.format, "trained_block_size": ckpt.config.block_size,
                           "no_target_features": ckpt.no_target_features,
                           "target_at_training": ckpt.metadata.get("target"),
                           "weights_sha256": weights_fingerprint(ckpt.weights)},
                  target=target.name_or_path, dataset=settings.dataset, provenance=provenance())
    plot = settings.plot_out or (str(Path(settings.json_out).with_suffix(".png")) if settings.json_out else None)
    if plot:
        plot_acceptance(result["conditional_accept_per_position"], result["accept_histogram"], plot,
                        title=f"{settings.dataset}, B={result['block_size']}, T={settings.temperature}",
                        tau=result["tau"], offline_tau=result.get("offline_tau_exact"))
        result["plot"] = plot
    if plot and settings.batch_sizes:
        curve = str(Path(plot).with_name(Path(plot).stem + "-speedup.png"))
        plot_speedup(result["speedup_table"], curve, title=f"{settings.dataset}, B={result['block_size']}, "
                     f"T={settings.temperature}, {result['target_dtype']}")
        result["speedup_plot"] = curve
    if settings.json_out:
        Path(settings.json_out).parent.mkdir(parents=True, exist_ok=True)
        body = portable_record(result, settings.json_out)  # paths relative to the JSON's folder, targets by name
        Path(settings.json_out).write_text(json.dumps(body, indent=2) + "\n")
    return result
