"""Where a decode step and a speculative round spend their time (decoding/engine.py), at batch 1 or `--rows`.

    python benchmarks/engine_profile.py --out DIR [--target real] [--drafter PATH] [--rows R] [--tiny]

Target: a random-weight SmolLM2-135M-shaped Llama (30 layers, H 576, 9/3 heads, V 49,152; the time of
a replayed step does not depend on the weights) in bf16, or `--target real` (the embedded SmolLM2
GGUF). Drafter: random, 5 layers, B = `--block-size` (16, the recipe's), or `--drafter` (a checkpoint).
Every decode runs to the cap (no end-of-sequence id can occur), so each plain decode is N − 1
replayed steps and each speculative decode N − 1 rounds with a random drafter (τ ≈ 1): the time
per round, not τ, is what is measured; the speedup at a measured τ is projected from it
(τ × step / round).

Writes to DIR: engine-profile.json (the numbers below), {plain,spec}-replays.trace.json.gz and
{plain,spec}-decode.trace.json.gz (Chrome traces: chrome://tracing or ui.perfetto.dev),
{plain,spec}-replays.txt (top CUDA kernels and CPU ops per step), eager-step.txt (and its trace:
an eager plain step, host ops and kernels), and prints a summary:
  ms per step / round: replays alone (graph.replay × K, synchronized), and inside whole decodes
      (prefill, host looks every `sync_every` replays and the result reads included; the
      difference is host_ms_per_step)
  kernels per step / round (CUDA kernel events of the profiled replays ÷ K)
  GPU-busy fraction: union of kernel intervals ÷ the profiled wall, for back-to-back replays and
      for a whole decode (the gaps are host time: looks, prefill, launches)
  eager step (no graph): host-bound ms per step, for comparison
  round_ms_by_draft_length: a replayed round at each draft length k = 0 … B−1 (k = 0: the plain step),
      as the speedup table's round costs (evaluation/draft_length.py) but K replays each
--tiny: a 2-layer model, for a CPU smoke run of this script.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_trainer.drafter.config import DrafterConfig  # noqa: E402
from dflash_trainer.drafter.model import DFlashDrafter  # noqa: E402
from dflash_trainer.decoding.engine import PLAIN, SPECULATIVE, DecodeEngine  # noqa: E402
from dflash_trainer.target_model.head_transforms import target_head  # noqa: E402
from dflash_trainer.target_model.layers import default_target_layer_ids  # noqa: E402
from dflash_trainer.target_model.load import TargetBundle, bundle_from_model, freeze  # noqa: E402

TAU_BATCH1 = 2.52  # measured τ at batch 1 (MT-Bench, the 5-layer B = 8 drafter)


def smollm2_shaped(device: torch.device, dtype: torch.dtype, tiny: bool) -> TargetBundle:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512) if tiny else \
        dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152)
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return bundle_from_model(freeze(model.to(dtype).eval()), name_or_path="random SmolLM2-135M-shaped")


def random_drafter(bundle: TargetBundle, layers: int, block: int) -> DFlashDrafter:
    c = bundle.config
    ids = default_target_layer_ids(bundle.num_layers, min(5, bundle.num_layers - 1))
    dc = DrafterConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=layers,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       head_dim=c.hidden_size // c.num_attention_heads, vocab_size=bundle.vocab_size,
                       block_size=block, mask_token_id=bundle.vocab_size - 1, target_layer_ids=ids,
                       num_target_layers=bundle.num_layers, rms_norm_eps=c.rms_norm_eps,
                       rope_theta=float(getattr(c, "rope_theta", 10000.0)), **target_head(bundle.model).fields())
    w = bundle.embed_tokens.weight
    drafter = DFlashDrafter(dc, bundle.embed_tokens, bundle.lm_head, compile_flex=False)
    return drafter.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def busy_fraction(trace: Path) -> dict[str, float]:
    """Union of GPU kernel / memcpy / memset intervals over their span, and the kernel count."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    kernels = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "kernel")
    if not spans:
        return {"gpu_busy_fraction": float("nan"), "kernels": 0, "span_us": 0.0}
    busy, (cur0, cur1) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > cur1:
            busy, cur0, cur1 = busy + cur1 - cur0, a, b
        else:
            cur1 = max(cur1, b)
    busy += cur1 - cur0
    span = spans[-1][1] - spans[0][0]
    return {"gpu_busy_fraction": busy / span if span else float("nan"), "kernels": kernels, "span_us": span}


def profiled(name: str, out: Path, fn, steps: int, device: torch.device, by_op: bool = False,
             traces: bool = True) -> dict[str, float]:
    """Profile fn() (CPU + CUDA), keep the gzipped Chrome trace and the top-op tables per step; by_op (eager
    steps): also the CUDA time of each aten op by input shapes, which a replay cannot attribute."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts, record_shapes=by_op) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    raw = out / f"{name}.trace.json"
    prof.export_chrome_trace(str(raw))
    stats = busy_fraction(raw)
    gz = out / f"{name}.trace.json.gz"
    with open(raw, "rb") as f, gzip.open(gz, "wb") as g:
        shutil.copyfileobj(f, g)
    raw.unlink()
    if not traces:  # --no-traces: the tables only (a device call brings back a few files)
        gz.unlink()
    elif gz.stat().st_size > 15 * 2**20:  # what a device call brings back
        gz.unlink()
        print(f"   {gz.name} over 15 MiB: left out", flush=True)
    avg = prof.key_averages()
    lines = [f"{name}: {steps} steps, wall {wall * 1e3:.2f} ms ({wall * 1e3 / steps:.3f} ms per step); "
             f"{stats['kernels']} CUDA kernels ({stats['kernels'] / steps:.1f} per step), "
             f"GPU busy {stats['gpu_busy_fraction']:.3f} of the kernels' span"]
    if device.type == "cuda":
        key = "self_device_time_total" if hasattr(avg[0], "self_device_time_total") else "self_cuda_time_total"
        lines += ["", "top CUDA ops by device time (totals over all steps):",
                  avg.table(sort_by=key, row_limit=40, max_name_column_width=110)]
        if by_op:
            key_all = key.replace("self_", "")
            lines += ["", "aten ops by input shapes, by their kernels' device time (totals over all steps):",
                      prof.key_averages(group_by_input_shape=True).table(
                          sort_by=key_all, row_limit=60, max_name_column_width=40, max_shapes_column_width=90)]
        if stats["kernels"] == 0:
            lines.insert(1, "note: no kernel events in the trace (CUPTI did not report the graph's kernels); "
                            "see eager-step.txt for the kernels of one step")
    lines += ["", "top CPU ops by host time:", avg.table(sort_by="self_cpu_time_total", row_limit=20)]
    (out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    print(lines[0], flush=True)
    return {"wall_ms": wall * 1e3, "ms_per_step": wall * 1e3 / steps, "kernels_per_step": stats["kernels"] / steps,
            "gpu_busy_fraction": stats["gpu_busy_fraction"]}


def timed_replays(graph, steps: int, device: torch.device, repeats: int = 5) -> float:
    """Median ms per replay over `repeats` runs of `steps` back-to-back replays."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return sorted(times)[len(times) // 2]


def eager_ms(step, n: int, device: torch.device) -> float:
    """ms per call of step(), after one untimed call: n calls back to back, synchronized."""
    step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / n


class _Eager:
    """A replay stand-in that runs the fixed-span step eagerly (the CPU has no graphs)."""

    def __init__(self, step):
        self.replay = step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", choices=["random", "real"], default="random")
    ap.add_argument("--drafter", default=None, help="drafter checkpoint (default: random, 5 layers, B = --block-size)")
    ap.add_argument("--block-size", type=int, default=16, help="the random drafter's B")
    ap.add_argument("--prompt-tokens", type=int, default=160)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32, help="replays profiled per mode")
    ap.add_argument("--rows", type=int, default=1, help="rows decoded at once (the batch size), each the same prompt")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    ap.add_argument("--no-traces", action="store_true", help="keep the tables only, no Chrome traces")
    ap.add_argument("--step-attention", default=None, choices=["cache", "sdpa", "row"],
                    help="how the target's steps attend over its cache (decoding/batched.py STEP_ATTENTION; "
                         "default: the engine's, batched.default_step_attention)")
    args = ap.parse_args()
    traces = not args.no_traces
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if args.target == "real":
        from dflash_trainer.target_model.load import load_target
        bundle = load_target(None, device=device, dtype=dtype)
    else:
        bundle = smollm2_shaped(device, dtype, args.tiny)
    if args.drafter:
        from dflash_trainer.evaluation.load import build_drafter, load_drafter_checkpoint
        drafter = build_drafter(load_drafter_checkpoint(args.drafter, num_target_layers=bundle.num_layers), bundle)
    else:
        drafter = random_drafter(bundle, layers=2 if args.tiny else 5, block=args.block_size)
    P, N, K, R = args.prompt_tokens, args.new_tokens, args.steps, args.rows
    if R < 1:
        raise SystemExit(f"--rows {R}: must be >= 1")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, bundle.vocab_size - 1, (P,), generator=g).tolist()
    batch = [prompt] * R
    never = {bundle.vocab_size + 7}  # no token is an eos: every decode runs to the cap
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "target": bundle.name_or_path, "target_dtype": str(dtype),
            "target_layers": bundle.num_layers, "drafter_layers": drafter.config.num_hidden_layers,
            "block_size": drafter.config.block_size, "prompt_tokens": P, "new_tokens": N, "rows": R}
    print(json.dumps(info), flush=True)

    t0 = time.perf_counter()
    engine = DecodeEngine(bundle, drafter, rows=R, max_prompt_tokens=P, max_new_tokens=N, eos_ids=never,
                          step_attention=args.step_attention)
    sync(device)
    info["construct_s"] = time.perf_counter() - t0  # caches + graph capture: never in a timed region
    info["cuda_graphs"] = sorted(engine.graphs)
    graphs = engine.graphs or {m: _Eager(s) for m, s in engine.graph_steps().items()}
    for spec in (False, True):  # warm-up, as eval does
        engine.decode(batch, speculative=spec, max_new_tokens=min(2 * engine.B, N))

    # whole decodes, as eval times them (prefill, looks, result reads)
    res, tokens = {}, {}
    for spec, mode in ((False, PLAIN), (True, SPECULATIVE)):
        walls, rounds = [], 0
        for _ in range(3):
            d = engine.decode(batch, speculative=spec)
            walls.append(d.wall_s)
            rounds = len(d.accepted[0]) if spec else N - 1
            tokens[mode] = d.tokens
        wall = sorted(walls)[1]
        res[mode] = {"decode_wall_ms": wall * 1e3, "tokens_per_s": R * N / wall, "steps": rounds,
                     "decode_ms_per_step": wall * 1e3 / max(rounds, 1)}
    # the verify's greedy tokens against the plain steps' (the same rows): each row's tokens up to its first
    # disagreement (a flipped near-tie of the two attention paths in the model's dtype; the rest then diverges)
    agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
             for a, b in zip(tokens[PLAIN], tokens[SPECULATIVE])]
    info["step_attention"] = engine.step_attention
    info["speculative_equals_plain_rows"] = sum(n == len(t) for n, t in zip(agree, tokens[PLAIN]))
    info["tokens_before_first_disagreement"] = agree
    sync(device)
    t0 = time.perf_counter()
    engine.start(batch, speculative=True)
    sync(device)
    info["prefill_ms_speculative"] = (time.perf_counter() - t0) * 1e3

    # back-to-back replays (the state after start(): a live row, so every step does its full work)
    for spec, mode in ((False, PLAIN), (True, SPECULATIVE)):
        engine.start(batch, speculative=spec)
        res[mode]["replay_ms"] = timed_replays(graphs[mode], K, device)
        engine.start(batch, speculative=spec)
        res[mode]["profile_replays"] = profiled(f"{'plain' if mode == PLAIN else 'spec'}-replays", out,
                                                lambda m=mode: [graphs[m].replay() for _ in range(K)], K, device,
                                                traces=traces)
    # one whole (shorter) decode profiled per mode: host gaps (prefill, a look every sync_every replays) show here
    short = min(N, 64)
    for spec, mode in ((False, PLAIN), (True, SPECULATIVE)):
        steps = short - 1  # rounds with a random drafter (τ ≈ 1); fewer with a trained one
        res[mode]["profile_decode"] = profiled(
            f"{'plain' if mode == PLAIN else 'spec'}-decode", out,
            lambda s=spec: engine.decode(batch, speculative=s, max_new_tokens=short), steps, device,
            traces=traces)
        res[mode]["host_ms_per_step"] = res[mode]["decode_ms_per_step"] - res[mode]["replay_ms"]
    # an eager step (no graph): what the host costs per step without replays
    eager = DecodeEngine(bundle, drafter, rows=R, max_prompt_tokens=P, max_new_tokens=N, eos_ids=never,
                         step_attention=args.step_attention,
                         cuda_graph=False)
    eager.start(batch, speculative=False)
    step = eager.graph_steps()[PLAIN]
    info["eager_plain_step_ms"] = eager_ms(step, 8, device)
    info["eager_plain_step"] = profiled("eager-step", out, lambda: [step() for _ in range(4)], 4, device, by_op=True,
                                        traces=traces)
    eager.start(batch, speculative=True)
    spec_step = eager.graph_steps()[SPECULATIVE]
    spec_step()
    info["eager_round"] = profiled("eager-round", out, lambda: [spec_step() for _ in range(4)], 4, device, by_op=True,
                                   traces=traces)
    del eager
    # a round at every draft length (graphs recaptured per k, as the speedup table does)
    by_k = []
    for k in range(engine.B):
        engine.set_draft_length(k)
        engine.start(batch, speculative=True)
        graph = engine.graphs.get(SPECULATIVE if k else PLAIN) or _Eager(engine.graph_steps()[SPECULATIVE if k else PLAIN])
        by_k.append(timed_replays(graph, K, device))
    info["round_ms_by_draft_length"] = by_k
    engine.set_draft_length(engine.B - 1)

    step_ms, round_ms = res[PLAIN]["replay_ms"], res[SPECULATIVE]["replay_ms"]
    summary = {**info, PLAIN: res[PLAIN], SPECULATIVE: res[SPECULATIVE],
               "round_over_step": round_ms / step_ms,
               "projected_speedup_at_tau": {str(t): t * step_ms / round_ms for t in (TAU_BATCH1, 3.0)},
               "plain_tokens_per_s_from_replays": R * 1e3 / step_ms}
    (out / "engine-profile.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"step attention {engine.step_attention}: speculative tokens equal the plain ones on "
          f"{info['speculative_equals_plain_rows']} of {R} rows (first disagreement at "
          f"{min(info['tokens_before_first_disagreement'])} of {N} tokens at worst)")
    print(f"rows {R}: plain step {step_ms:.3f} ms ({R * 1e3 / step_ms:.0f} tok/s from replays; "
          f"{res[PLAIN]['tokens_per_s']:.0f} tok/s over whole decodes), round {round_ms:.3f} ms "
          f"(round/step {round_ms / step_ms:.2f}: at τ {TAU_BATCH1} speculative is "
          f"{TAU_BATCH1 * step_ms / round_ms:.2f}× plain); kernels per step "
          f"{res[PLAIN]['profile_replays']['kernels_per_step']:.0f}, per round "
          f"{res[SPECULATIVE]['profile_replays']['kernels_per_step']:.0f}; GPU busy: replays "
          f"{res[PLAIN]['profile_replays']['gpu_busy_fraction']:.2f} / "
          f"{res[SPECULATIVE]['profile_replays']['gpu_busy_fraction']:.2f}, whole decodes "
          f"{res[PLAIN]['profile_decode']['gpu_busy_fraction']:.2f} / "
          f"{res[SPECULATIVE]['profile_decode']['gpu_busy_fraction']:.2f}; eager step "
          f"{info['eager_plain_step_ms']:.2f} ms; prefill {info['prefill_ms_speculative']:.1f} ms; "
          f"construction (capture) {info['construct_s']:.1f} s", flush=True)
    print("round ms by draft length 0 … B−1: " + " ".join(f"{t:.3f}" for t in by_k), flush=True)


if __name__ == "__main__":
    main()
