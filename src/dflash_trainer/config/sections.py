"""The sections of TrainConfig (config/schema.py), each a small pydantic model of the settings of
one job, and the drafter shape's rules they check: B divides the flex tile, layer_types parse, a
window when a layer slides, target layer ids ascending. Torch-free."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_SECTION_CONFIG = ConfigDict(extra="forbid", validate_assignment=True)

TILE = 128  # flex attention's sparse block: a query tile holds whole draft blocks (drafter/masks.py)
_LAYER_ALIASES = {"full": "full_attention", "swa": "sliding_attention", "sliding": "sliding_attention",
                  "full_attention": "full_attention", "sliding_attention": "sliding_attention"}


def parse_layer_types(spec: str | list[str], num_layers: int) -> list[str]:
    """Expand a layer-type spec into one entry per drafter layer (list[str] of "full_attention" /
    "sliding_attention").

    spec: "all-swa" | "full" | "last-full" | a list / comma string of "full"/"swa"/
    "full_attention"/"sliding_attention" with exactly `num_layers` entries.
    Raises ValueError naming `layer_types` when the spec is unknown or has the wrong length.
    """
    if isinstance(spec, str):
        if spec == "all-swa":
            return ["sliding_attention"] * num_layers
        if spec == "full":
            return ["full_attention"] * num_layers
        if spec == "last-full":
            return ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    out = []
    for s in spec:
        if s not in _LAYER_ALIASES:
            raise ValueError(f"layer_types: unknown entry {s!r}; use full|swa or all-swa|full|last-full")
        out.append(_LAYER_ALIASES[s])
    if len(out) != num_layers:
        raise ValueError(f"layer_types: {len(out)} entries for num_layers={num_layers}; give one per layer")
    return out


def check_layer_ids(ids: Any, num_layers: int | None = None) -> list[int]:
    """The rule for target layer ids (list[int] returned): non-empty, integers, no duplicates,
    ascending, and within [0, num_layers − 1] (only ≥ 0 while the target's layer count is unknown,
    num_layers None: the drafter section; the upper bound once the target is read). Raises
    ValueError naming `target_layer_ids` and the fix."""
    ids = list(ids)
    if not ids:
        rule = f"default_target_layer_ids({num_layers}, 5)" if num_layers else "null (the DFlash rule)"
        raise ValueError(f"target_layer_ids=[]: give at least one layer id, e.g. the default rule {rule}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"target_layer_ids={ids}: ids must be integers, got {i!r}")
    bad = [i for i in ids if i < 0 or (num_layers is not None and i >= num_layers)]
    if bad:
        where = (f"[0, {num_layers - 1}] (the target has {num_layers} decoder layers; id ℓ is the output of "
                 "decoder layer ℓ)") if num_layers is not None else "[0, L − 1] (L: the target's decoder layers)"
        raise ValueError(f"target_layer_ids={ids}: ids {bad} lie outside {where}")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"target_layer_ids={ids}: ids {dup} are duplicated (each target layer feeds the drafter "
                         f"once); use {sorted(set(ids))}")
    if ids != sorted(ids):
        raise ValueError(f"target_layer_ids={ids}: ids must be in ascending order (the order is baked into the "
                         f"drafter's fc weights); use {sorted(ids)}")
    return ids


def check_flex_tiles(num_anchors: int, block_size: int) -> None:
    """The CUDA flex path's rule for the drafter's queries: Q = num_anchors × block_size whole query
    tiles of TILE. Raises ValueError naming both settings and a fix when Q % TILE != 0."""
    q = num_anchors * block_size
    if q % TILE:
        per = TILE // math.gcd(TILE, block_size)
        raise ValueError(f"loss.num_anchors × drafter.block_size = {num_anchors} × {block_size} = {q} must be a "
                         f"multiple of {TILE} on CUDA (flex attention tiles); use a multiple of {per} anchors, "
                         f"e.g. num_anchors={max(per, num_anchors // per * per)}")


class DataSection(BaseModel):
    """`data`: the chats the run trains on, how they are packed into rows and what is held out."""

    model_config = _SECTION_CONFIG

    chats: str | None = Field(None, description="Chat data (ShareGPT or OpenAI-style JSON/JSONL). None = embedded ShareGPT.")
    prepared: str | None = Field(None, description="Folder written by `dflash-train prepare`. None = prepare into OUT/data first.")
    seq_len: int = Field(512, gt=0, description="T: tokens per packed row. Multiple of 128 (flex tiles).")
    max_conversations: int | None = Field(None, gt=0, description="Read at most this many usable conversations (None = all of them).")
    validation_fraction: float = Field(0.02, ge=0.0, lt=1.0, description="Fraction of conversations held out for validation (records sharing an id, a prompt's samples, go together).")
    validation_max_rows: int | None = Field(16, gt=0, description="Validate at most this many held-out rows at the end of the run, the same rows every time (None = all); the summary says how many of how many.")
    validation_max_seconds: float | None = Field(60.0, gt=0, description="Start no new validation row after this many seconds, counted from the end of the first row (None = no limit; at least one row runs); the summary says when it cut validation short.")
    chat_template: str | None = Field(None, description="Jinja chat template file overriding the tokenizer's (must match serving).")
    enable_thinking: bool | None = Field(None, description="Thinking flag passed to the chat template (None = not passed).")

    @model_validator(mode="after")
    def _check(self) -> "DataSection":
        if self.seq_len % 128:
            raise ValueError(f"seq_len={self.seq_len} must be a multiple of 128; e.g. {(self.seq_len // 128 + 1) * 128}")
        return self

    def chat_template_text(self) -> str | None:
        """The `chat_template` file's text (str), or None when the field is unset (the tokenizer's
        own then). Raises OSError when the file cannot be read."""
        return Path(self.chat_template).read_text() if self.chat_template else None


class TargetSection(BaseModel):
    """`target`: the frozen target model and how its forward runs."""

    model_config = _SECTION_CONFIG

    path: str | None = Field(None, description="Target model: HF folder, .gguf file or a name (smollm2-135m, qwen2.5-coder-0.5b, gemma3-270m; `dflash-train fetch-target NAME` fetches the last two). None = embedded SmolLM2-135M-Instruct GGUF.")
    target_attention: Literal["auto", "flex", "sdpa", "eager"] = Field("auto", description="Target attention over packed rows: flex = document-causal flex BlockMask (block-sparse), sdpa = SDPA with a dense [T,T] mask, eager = transformers' own attention math with that mask (slow; runs attention sinks and soft-capping); auto = flex on CUDA, else sdpa, or eager where sdpa would be wrong (docs/targets.md). A path that cannot give exact features for the target is refused.")
    target_compile: bool = Field(True, description="Compile the target's decoder layers on the flex path on CUDA (one graph per layer type, compiled once; fuses HF's memory-bound norm/RoPE/activation kernels); false = eager layers.")
    overlap_target: bool = Field(True, description="Co-located on CUDA: run the target forward of the next batch on its own stream, overlapping the drafter step (one extra batch of features in memory).")
    feature_cache_gib: float = Field(0.0, ge=0, description="Keep the target's outputs (aux hidden states, labels) of up to this many GiB of dataset rows on the target's device, so later epochs skip the target forward for the rows stored (training/feature_cache.py; the size per row is in docs/running.md). 0 = off. Rows beyond the budget are recomputed every epoch; with several target ranks each caches the rows it serves.")


class DrafterSection(BaseModel):
    """`drafter`: where the drafter comes from and its shape (used when `drafter_config` is None).

    The one home of the drafter shape's defaults (the paper's: 5 layers, B = 16) and rules (B
    divides 128, layer_types parse with one entry per layer, a window when a layer slides,
    target_layer_ids non-negative and ascending); `init-config` and `train` build their shape from
    it, so both refuse a bad shape before anything loads. Raises ValueError naming the field."""

    model_config = _SECTION_CONFIG

    drafter_config: str | None = Field(None, description="Drafter config JSON (from `init-config`). None = derive from the target with the fields below.")
    init_from: str | None = Field(None, description="Warm start: a drafter folder (checkpoint, zlab or speculators export); its config replaces the drafter fields below.")
    num_layers: int = Field(5, gt=0, description="Drafter decoder layers (the paper's 5).")
    block_size: int = Field(16, ge=2, le=128, description="B: tokens per draft block, the anchor and B−1 mask slots (the paper's 16; 8 common). Divides 128 (flex tiles hold whole blocks).")
    layer_types: str = Field("full", description="all-swa | last-full | full | comma list of full/swa, one per layer.")
    sliding_window: int | None = Field(None, gt=0, description="W for sliding layers (e.g. 2048). Required when any layer slides.")
    target_layer_ids: list[int] | None = Field(None, description="Target layers feeding the drafter. None = the DFlash rule for k=num_target_features.")
    num_target_features: int = Field(5, gt=0, description="k: number of target layers when target_layer_ids is None.")
    mask_token_id: int | None = Field(None, ge=0, description="Mask token row. None = first unused embedding row, else a special token the template never emits.")

    @model_validator(mode="after")
    def _check(self) -> "DrafterSection":
        if TILE % self.block_size:
            raise ValueError(f"block_size={self.block_size} must divide {TILE} (flex tiles hold whole blocks); use 4, 8, 16, 32 ...")
        types = parse_layer_types(self.layer_types, self.num_layers)
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError(f"sliding_window: required when a layer slides (layer_types={self.layer_types}); "
                             "set e.g. drafter.sliding_window=2048")
        if self.target_layer_ids is not None:
            check_layer_ids(self.target_layer_ids)  # the upper bound once the target is read
        return self

    def resolved_layer_types(self) -> list[str]:
        """`layer_types` as one "full_attention" / "sliding_attention" entry per layer (list[str])."""
        return parse_layer_types(self.layer_types, self.num_layers)


class LossSection(BaseModel):
    """`loss`: the training objective — anchors, labels, the per-slot loss and its position weights."""

    model_config = _SECTION_CONFIG

    kind: Literal["ce", "kl", "ce_kl"] = Field("ce", description="Per-slot loss: ce on labels, kl to the target distribution, or ce_kl = loss_ce_weight*CE + loss_kl_weight*KL (PARD-2). docs/losses.md.")
    num_anchors: int = Field(32, gt=0, description="Anchors (blocks) per row (paper: 512 at T=8192). num_anchors*block_size multiple of 128 on CUDA.")
    label_source: Literal["target", "data"] = Field("target", description="target = target argmax (online distillation); data = dataset tokens (regenerated data).")
    loss_ce_weight: float = Field(0.1, ge=0, description="CE coefficient of loss.kind=ce_kl (PARD-2 recipe: 0.1).")
    loss_kl_weight: float = Field(1.0, ge=0, description="KL coefficient of loss.kind=ce_kl (PARD-2 recipe: 1.0).")
    position_weights: Literal["decay", "dpace", "cat"] = Field("dpace", description="Per-slot loss weights: dpace = D-PACE weights from the drafter's own confidence (arXiv 2605.18810; the default, docs/losses.md compares them); decay = exp(-(k-1)/γ) (DFlash); cat = PARD-2's product of the target's probabilities of the earlier labels (arXiv 2605.08632).")
    gamma: float | None = Field(None, gt=0, description="Position decay γ of w_k = exp(-(k-1)/γ) (position_weights=decay). None = 7/5/4 for B=16/10/8.")

    @model_validator(mode="after")
    def _check(self) -> "LossSection":
        if self.kind == "ce_kl" and self.loss_ce_weight == 0 and self.loss_kl_weight == 0:
            raise ValueError("loss.kind=ce_kl with loss_ce_weight=0 and loss_kl_weight=0 trains nothing; "
                             "give one of them a positive value (PARD-2: 0.1 and 1.0)")
        return self


class OptimSection(BaseModel):
    """`optim`: the optimizer, its schedule and how long the run trains."""

    model_config = _SECTION_CONFIG

    lr: float = Field(6e-4, gt=0, description="Peak AdamW learning rate (paper A.1: 6e-4).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.04, ge=0, lt=1, description="Linear warmup as a fraction of total steps (paper: 4%).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip (paper: 1.0).")
    rows_per_step: int = Field(1, gt=0, description="R: packed rows per optimizer step.")
    epochs: int = Field(1, gt=0, description="Passes over the training rows (paper: 6); anchors are resampled each epoch.")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps; when set it overrides `epochs` (None = `epochs` full passes).")


class RuntimeSection(BaseModel):
    """`runtime`: device, seed, logging, checkpoints and resuming, compilation."""

    model_config = _SECTION_CONFIG

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    seed: int = Field(0, description="Seeds data order, anchor sampling and init.")
    log_every: int = Field(10, gt=0, description="Steps between metric logs (one device→host copy each).")
    save_every: int | None = Field(None, gt=0, description="Steps between checkpoints (None = only the final one).")
    resume: str = Field("auto", description="auto = continue from OUT's newest readable checkpoint if any; never; or a run/checkpoint folder.")
    keep_last: int = Field(3, ge=1, description="Step checkpoints kept (checkpoint-final is always kept).")
    max_consecutive_skips: int = Field(20, ge=1, description="Stop with an error after this many consecutive non-finite steps (checked at log steps).")
    threads: int | None = Field(None, gt=0, description="CPU threads of torch's intra-op pool (None = torch's default, one per core; 1 is often faster on a busy shared CPU). Co-located runs; a process layout's ranks run one thread each.")
    compile: bool = Field(True, description="Compile flex attention, the drafter layers, the loss and the clip + AdamW update on CUDA (eager flex is a slow reference path).")


class LayoutSection(BaseModel):
    """`layout`: the process layout (pipeline/layout.py; one process per GPU when set)."""

    model_config = _SECTION_CONFIG

    target_gpus: str | None = Field(None, description="GPUs running the frozen target, e.g. '0-4' (one process each; per node under torchrun).")
    drafter_gpus: str | None = Field(None, description="GPUs training the drafter data-parallel, e.g. '5-7' (one process each).")
    colocate: bool = Field(False, description="Target and drafter in one process on one device (the default without a layout).")
    target_procs: int | None = Field(None, ge=1, description="CPU target processes (gloo); with drafter_procs, the CPU twin of the GPU layout.")
    drafter_procs: int | None = Field(None, ge=1, description="CPU drafter processes (gloo).")
    gpus: str | None = Field(None, description="GPUs to split between target and drafter ranks automatically, e.g. '0-7': both rates are measured on this run's rows first and the split with the highest projected tok/s runs (pipeline/auto_split.py).")
    procs: int | None = Field(None, description="CPU processes to split automatically (gloo); the CPU twin of `gpus`, at least 2.")
    queue_depth: int = Field(2, ge=1, description="D: micro-batches a drafter has granted ahead; no target runs further ahead of it.")
    comm_timeout_s: float = Field(600.0, gt=0, description="Timeout of every collective and point-to-point wait between ranks (seconds).")
    dry_run: bool = Field(False, description="Print the resolved process layout as JSON and exit.")

    def any_layout(self) -> bool:
        """True (bool) when a process layout is asked for (GPU or CPU ranks, explicit or split)."""
        return any(getattr(self, f) for f in ("target_gpus", "drafter_gpus", "target_procs", "drafter_procs",
                                              "gpus", "procs"))


class TauSection(BaseModel):
    """`tau`: measured τ during training (training/tau_probe.py; co-located runs only)."""

    model_config = _SECTION_CONFIG

    tau_every: int | None = Field(None, ge=0, description="Every this many optimizer steps, and once at the end, decode `tau_prompts` held-out prompts by real greedy speculative decoding with the current drafter and log the measured acceptance length τ (metrics.jsonl `tau_measured`). None or 0 = off. Process layouts skip it.")
    tau_prompts: int = Field(32, gt=0, description="Prompts of the measured-τ slice (the first of `tau_dataset`, first user turn each), decoded as one batch.")
    tau_max_new_tokens: int = Field(128, gt=0, description="New tokens per prompt in a measured-τ decode (a row stops earlier at its end-of-sequence token).")
    tau_dataset: str = Field("sharegpt-heldout", description="Prompts of the measured-τ slice: a suite of `dflash-train eval` (sharegpt-heldout | mt-bench | humaneval) or a JSON/JSONL chat file. Keep the eval suites for the final eval.")


class ExperimentalSection(BaseModel):
    """`experimental`: research and speed levers whose default is already the recommended choice."""

    model_config = _SECTION_CONFIG

    per_document_quota: bool = Field(False, description="Guarantee every document at least one anchor (short documents do not starve).")
    dpace_alpha: float = Field(0.5, gt=0, le=1, description="D-PACE confidence smoothing α in (0, 1]: q~ = (1-α)q + α (paper: 0.5).")
    dpace_denominator: Literal["blocks", "weights"] = Field("blocks", description="D-PACE loss divided by the global number of valid blocks (the method author's choice, keeps the weights' scale) or by the global weight sum.")
    rejection_weight: float = Field(0.0, ge=0, description="Training only: a block whose anchor is where another block of its row rejects a draft (the anchors decoding starts from) gets its loss weights times 1 + this; 0 = off. Costs one more LM-head forward per step (drafter/rejection.py, docs/losses.md).")
    feature_dropout: float = Field(0.0, ge=0, lt=1, description="Training only: probability of zeroing the target features of a document (or position, see feature_dropout_unit); PARD-2 uses 0.1. Never at validation or eval.")
    feature_dropout_unit: Literal["document", "position"] = Field("document", description="What feature_dropout drops whole: a packed document (PARD-2's per-sample masking) or a single context position.")
    no_target_features: bool = Field(False, description="Zero the target features fed to the drafter (the control drafter the paper compares against); recorded in the checkpoint so eval does the same.")
    anchor_draws_per_row: int = Field(1, ge=1, description="Feature reuse: optimizer steps per target batch, each on freshly drawn anchors over the same target features (drafters that would wait for the target train instead); target tokens per step fall by this factor.")
    loss_chunk: int | None = Field(None, gt=0, description="LM-head positions per loss chunk (recomputed in backward; saves memory at large vocab). None = one chunk.")
    loss_impl: Literal["autograd", "fused"] = Field("fused", description="How the LM head + loss gets the drafter's gradient: fused = the closed-form gradient w.r.t. the drafter's hidden states computed chunk by chunk in the forward pass (drafter/fused_loss.py; loss ce in two memory-speed passes over the logits, drafter/ce_rows.py); autograd = backward through log-softmax and the LM head (each loss_chunk recomputed in backward). Same loss, gradient equal up to rounding, every loss option. fused is the default (faster, less peak memory: benchmarks/README.md).")
    checkpoint_layers: str = Field("none", description="Activation checkpointing: none | all | comma list of layer indices.")
    fp8: Literal["off", "rowwise", "tensorwise"] = Field("off", description="FP8 matmuls for the drafter's linears (its decoder layers' q/k/v/o and MLP projections and fc; never the target's embedding or LM head) through torchao's float8 training: rowwise = one scale per row (power of 2), tensorwise = one per tensor; off = bf16. Needs a CUDA GPU of compute capability 8.9+ and torchao (`pip install 'dflash-trainer[fp8]'`). Weights, checkpoints and exports stay fp32/bf16. Speed and τ against bf16: drafter/fp8.py, benchmarks/README.md.")
    profile_at_step: int | None = Field(None, ge=0, description="Profile optimizer steps N … N+profile_steps−1 once (torch.profiler) and write where their time went (target forward, drafter forward, LM head + loss, backward, optimizer, mask build, other) to OUT/step_breakdown.json; None = off. Pick N past warm-up (the first steps compile). Co-located runs only; the other steps run untouched.")
    profile_steps: int = Field(5, gt=0, description="Steps in the profile_at_step window.")
    split_ddp_efficiency: float = Field(1.0, gt=0, le=1, description="Automatic split (layout.gpus/procs): d >= 2 data-parallel drafters train d * drafter rate * this factor (1.0 = linear scaling).")
    split_probe_s: float = Field(10.0, gt=0, description="Automatic split (layout.gpus/procs): timed seconds per role at most (after 2 untimed warm-up calls; at most 5 timed calls).")

    @field_validator("fp8", mode="before")
    @classmethod
    def _fp8_off(cls, v: Any) -> Any:
        """YAML reads a bare `off` (a config file's `fp8: off`, `--set fp8=off`) as false: that is "off"."""
        return "off" if v is False else v

    def checkpoint_policy(self) -> list[int] | Literal["all"] | None:
        """Parse `checkpoint_layers` into None, "all" or a list of layer indices (list[int]).
        Raises ValueError on anything else."""
        s = self.checkpoint_layers.strip()
        if s in ("", "none"):
            return None
        if s == "all":
            return "all"
        try:
            return [int(x) for x in s.split(",")]
        except ValueError:
            raise ValueError(f"checkpoint_layers={s!r}: use none | all | comma list of layer indices") from None
