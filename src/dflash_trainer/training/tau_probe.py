"""Measured τ during training: real speculative decoding with the drafter being trained.

Shapes: R = prompts of the slice (`tau_prompts`), P = longest rendered prompt, N = `tau_max_new_tokens`,
B = the drafter's block size, S = P + N + B cache slots per row.

Every `tau_every` optimizer steps, and once when the run ends (not after a stop request), the
co-located run decodes a fixed slice of held-out prompts with the target it already holds and the
drafter's current weights: greedy (T = 0, so lossless), all R prompts as one batch on the decoding
engine of `dflash-train eval` (decoding/engine.py; each round a CUDA graph replay on CUDA, eager
on the CPU). τ = tokens the verify rounds committed (the bonus token included, nothing past a
row's eos or token cap) per round, pooled over every round of every prompt (decoding/acceptance.py;
`tau_measured_uncapped` also counts what a last round accepted past the end): what `dflash-train eval --dataset D --max-prompts R --max-turns 1
--max-new-tokens N --batch-size R --max-prompt-tokens P` (P at least the slice's longest prompt: the probe
skips none) reports for a checkpoint of the same weights (the same value on the CPU,
tests/unit/test_tau_during_training.py).

The slice: the first `tau_prompts` prompts of `tau_dataset` (data/suites.py), first user turn
only, rendered once with the run's chat template and thinking flag, sorted by length as eval
sorts a batch.

What a measurement leaves alone: it runs between optimizer steps (never inside one, so it may
read the host), under torch.no_grad, with the global CPU/CUDA RNG states forked and restored
(anchors come from per-row generators anyway), the optimizer untouched, and the drafter put in
eval mode and back in its mode after; a run with `tau_every` trains exactly as one without.
Dtypes: the probe decodes with the run's target as loaded and the drafter in the target's dtype.
On the CPU both train in fp32, the live drafter module decodes as is, and τ equals eval's. On CUDA
(bf16 target, fp32 drafter) it decodes a bf16 copy of the current weights, refreshed in place
before each measurement (the dtype serving engines run; the fp32 drafter would cast the LM head
[V,H] to fp32 every round). `dflash-train eval` decodes in bf16 on CUDA too, unless given --dtype float32,
so its τ of the same weights can differ by rounding.

Memory: everything is built once, when the probe is made (before the first step: an OOM shows at
once, not hours in), and reused by every measurement, so nothing grows: the target's KV cache
(R × S slots per target layer), the drafter's context cache (R × S per drafter layer), the captured
step and round (CUDA) and, on CUDA, the drafter copy. With the default slice of ShareGPT (P ≈ 1.5K tokens)
and a Qwen3-8B target that is ≈ 8 GiB of target cache.

Process layouts (target and drafter on separate ranks) do not measure τ: the drafter ranks hold
no target. The launcher says so in one line at the start (pipeline/launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.decoding.acceptance import committed_by_rounds, summarize_rounds
from dflash_trainer.data.render import eos_token_ids, render_prompt
from dflash_trainer.decoding.engine import DecodeEngine, Decoded
from dflash_trainer.data.suites import EvalPrompt, load_suite
from dflash_trainer.decoding.batched import unsupported_reason
from dflash_trainer.target_model.load import TargetBundle

OFF_HINT = "or set tau_every=null to measure no τ"
PROCESS_LAYOUT_NOTICE = ("note: tau_every is ignored in process layouts (the drafter ranks hold no target); "
                         "measure τ of a checkpoint with `dflash-train eval`")


@dataclass
class TauMeasurement:
    """One measurement: step (optimizer steps done), tau (tokens committed per round incl. the bonus;
    None when no row ran a round, e.g. every row ended at its first token), tau_uncapped (mean n+1
    over rounds, decoding/acceptance.py), prompts (R), tokens (new
    tokens, all rows), rounds (all rows), wall_s (host seconds: prefill + rounds + one read of the
    results; the probe's construction and warm-up are not counted)."""

    step: int
    tau: float | None
    tau_uncapped: float | None
    prompts: int
    tokens: int
    rounds: int
    wall_s: float

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl record (telemetry/tensorboard_log.py maps tau_measured → `tau/measured`)."""
        return {"step": self.step, "tau_measured": self.tau, "tau_measured_uncapped": self.tau_uncapped,
                "tau_prompts": self.prompts, "tau_tokens": self.tokens,
                "tau_rounds": self.rounds, "tau_tokens_per_s": self.tokens / max(self.wall_s, 1e-9),
                "tau_wall_s": self.wall_s}


def load_tau_prompts(cfg: TrainConfig) -> list[EvalPrompt] | None:
    """The slice's prompts (`tau_prompts` of `tau_dataset`), or None when `tau_every` is off. Cheap
    and model-free, so a run calls it before the target loads. Raises ValueError naming
    tau_dataset for an unknown suite, a missing file or one without a usable conversation, and
    FileNotFoundError (with the install command) for a suite whose package is missing."""
    if not cfg.tau.tau_every:
        return None
    try:
        return load_suite(cfg.tau.tau_dataset, cfg.tau.tau_prompts)
    except ValueError as e:
        raise ValueError(f"tau_dataset={cfg.tau.tau_dataset!r}: {e}; {OFF_HINT}") from None


def render_first_turns(tokenizer: Any, chat_template: str, prompts: list[EvalPrompt],
                       enable_thinking: bool | None) -> list[list[int]]:
    """Token ids of each prompt's first user turn (with its system message) followed by the
    assistant generation prompt, rendered as eval renders it (data/render.py)."""
    return [render_prompt(tokenizer, chat_template, p.messages([]), enable_thinking) for p in prompts]


class TauProbe:
    """Measures τ of `drafter` (the live module being trained) over `target` on fixed prompts.

    prompts: R token-id lists (≥ 1 token each). max_new_tokens: N per row. eos_ids: ids that end a
    response. zero_features: feed zeros instead of target features (control drafters).
    cuda_graph: capture one round on CUDA (eval's default). Builds the caches (and the graph) now;
    `measure(step)` reuses them. Raises ValueError for an empty prompt or empty eos_ids, and
    naming tau_every for a target the decoding engine cannot run.
    """

    @torch.no_grad()
    def __init__(self, target: TargetBundle, drafter: DFlashDrafter, prompts: list[list[int]], *,
                 max_new_tokens: int, eos_ids: set[int], zero_features: bool = False, cuda_graph: bool = True):
        reason = unsupported_reason(target)
        if reason:
            raise ValueError(f"tau_every: measured τ decodes with eval's engine, which cannot run this target "
                             f"({reason}); {OFF_HINT}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(f"tau_every: every prompt of the slice needs at least one token; {OFF_HINT}")
        if not eos_ids:
            raise ValueError(f"tau_every: the target names no end-of-sequence token; {OFF_HINT}")
        self.drafter = drafter
        self.device = target.embed_tokens.weight.device
        self.prompts = sorted(prompts, key=len)  # eval's batch order (stable)
        with self._isolated():
            self.decoder = self._decoder(target)  # the live drafter, or its copy in the target's dtype
            self.engine = DecodeEngine(target, self.decoder, rows=len(prompts),
                                       max_prompt_tokens=len(self.prompts[-1]), max_new_tokens=max_new_tokens,
                                       eos_ids=eos_ids, zero_features=zero_features, cuda_graph=cuda_graph)
            # warm-up (lazy kernels, allocator): a prefill and one round, state reset by every measurement
            self.engine.decode(self.prompts, speculative=True, max_new_tokens=min(2, max_new_tokens))
        self.total_wall_s = 0.0  # all measurements so far (the run leaves it out of its tok/s)
        self.last: TauMeasurement | None = None
        self.last_decoded: Decoded | None = None

    @property
    def uses_cuda_graph(self) -> bool:
        return bool(self.engine.graphs)

    def _decoder(self, target: TargetBundle) -> DFlashDrafter:
        """The drafter itself when it already has the target's dtype, else a frozen copy in that
        dtype over the same embedding and LM head (its weights refreshed by `_refresh`)."""
        dtype = target.embed_tokens.weight.dtype
        if self.drafter.fc.weight.dtype == dtype:
            return self.drafter
        with torch.device(self.device):  # made where it runs (random init values are overwritten)
            copy = DFlashDrafter(self.drafter.config, target.embed_tokens, target.lm_head, compile_flex=False)
        return copy.to(dtype=dtype).eval().requires_grad_(False)

    def _refresh(self) -> None:
        """Copy the live weights into the decoder's (in place: a captured round keeps its addresses)."""
        if self.decoder is self.drafter:
            return
        live = self.drafter.state_dict()
        for name, t in self.decoder.state_dict().items():
            t.copy_(live[name])

    def _isolated(self) -> Any:
        """Global RNG states forked and restored (CPU, and this CUDA device)."""
        return torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])

    @torch.no_grad()
    def measure(self, step: int) -> TauMeasurement:
        """Decode the slice with the drafter's current weights; returns (and keeps as `last`) the
        measurement (and as `last_decoded` the engine's output). Synchronizes the device (honest wall
        time) and reads the results: call it between optimizer steps only."""
        was_training = self.drafter.training
        self.drafter.eval()
        try:
            with self._isolated():
                self._refresh()
                self.last_decoded = out = self.engine.decode(self.prompts, speculative=True)
        finally:
            self.drafter.train(was_training)
        summary = summarize_rounds({str(r): acc for r, acc in enumerate(out.accepted)},
                                   {str(r): committed_by_rounds(t) for r, t in enumerate(out.tokens)},
                                   self.drafter.config.block_size)
        m = TauMeasurement(step=step, tau=summary["tau"], tau_uncapped=summary["tau_uncapped"], prompts=len(out.tokens),
                           tokens=sum(map(len, out.tokens)),
                           rounds=int(summary["rounds"]), wall_s=out.wall_s)
        self.total_wall_s += out.wall_s
        self.last = m
        return m


def build_tau_probe(cfg: TrainConfig, target: TargetBundle, drafter: DFlashDrafter, prompts: list[EvalPrompt],
                    chat_template: str | None) -> TauProbe:
    """The probe of a co-located run: `prompts` (load_tau_prompts) rendered with the run's
    `chat_template` (the one its checkpoints record) and cfg.data.enable_thinking, N = cfg.tau.tau_max_new_tokens,
    zero features when cfg.experimental.no_target_features. Raises ValueError naming tau_every when the target
    has no tokenizer or no chat template."""
    if target.tokenizer is None:
        raise ValueError(f"tau_every: target {target.name_or_path} has no tokenizer to render the prompts; {OFF_HINT}")
    if not chat_template:
        raise ValueError(f"tau_every: target {target.name_or_path} has no chat template; pass chat_template=FILE, "
                         f"{OFF_HINT}")
    ids = render_first_turns(target.tokenizer, chat_template, prompts, cfg.data.enable_thinking)
    return TauProbe(target, drafter, ids, max_new_tokens=cfg.tau.tau_max_new_tokens, eos_ids=eos_token_ids(target),
                    zero_features=cfg.experimental.no_target_features)
