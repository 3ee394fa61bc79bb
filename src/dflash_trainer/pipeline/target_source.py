"""Where the pipeline's target comes from: checkpoint files, or random weights built in memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from dflash_trainer.target_model.load import TargetBundle, bundle_from_model, load_embedding_and_head, load_target


@dataclass(frozen=True)
class CheckpointTarget:
    """A target on disk (HF folder, .gguf file, None = embedded SmolLM2). Drafters read only its
    embedding and LM head from the files."""

    path: str | None
    shares_head: bool = False

    def load_full(self, device: torch.device, dtype: torch.dtype) -> TargetBundle:
        return load_target(self.path, device=device, dtype=dtype)

    def load_head(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return load_embedding_and_head(self.path, dtype=dtype)


@dataclass(frozen=True)
class RandomTarget:
    """A random-weight HF causal LM built in memory from config fields (tests, throughput runs).

    It exists only on the target ranks, so target rank 0 sends its embedding and LM head to every
    drafter at startup. family: "llama" | "qwen3"; config: fields of LlamaConfig / Qwen3Config.
    """

    family: Literal["llama", "qwen3"]
    config: dict[str, Any]
    seed: int = 0
    shares_head: bool = True

    def load_full(self, device: torch.device, dtype: torch.dtype) -> TargetBundle:
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

        hf = {"llama": LlamaConfig, "qwen3": Qwen3Config}[self.family](**self.config)
        hf._attn_implementation = "sdpa"
        devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa", dtype=dtype)
        return bundle_from_model(model, name_or_path=f"random-{self.family}")


TargetSource = CheckpointTarget | RandomTarget
