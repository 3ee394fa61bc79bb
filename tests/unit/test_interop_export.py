"""Export to the zlab / speculators folders and import back (docs/formats.md).

Shapes: R rows, T context positions, N anchors, B block size, Q = N·B, H hidden, k target layers.
Every drafter weight is random (norms too), so a transposed, swapped or dropped tensor changes
the forward output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.masks import build_dense_masks
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.interop.export import export_drafter, write_export
from dflash_trainer.interop.formats import FORMATS
from dflash_trainer.interop.keymaps import WEIGHT_TABLES, expand_table
from dflash_trainer.interop.load_drafter import load_drafter
from dflash_trainer.interop.checkpoint_files import save_checkpoint

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "interop"
B, W, V, MASK = 4, 5, 40, 39
LAYER_TYPES = {
    "swa+full": ["sliding_attention", "full_attention"],
    "all-swa": ["sliding_attention", "sliding_attention"],
    "all-full": ["full_attention", "full_attention"],
}
META = {"target": "tiny-target", "chat_template": "{{ messages }}", "enable_thinking": False,
        "mask_token_reason": "given explicitly", "step": 7}


def tiny_config(layer_types: list[str]) -> DrafterConfig:
    sliding = "sliding_attention" in layer_types
    return DrafterConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
                         max_position_embeddings=4096, block_size=B, mask_token_id=MASK, target_layer_ids=[0, 2],
                         num_target_layers=4, layer_types=layer_types, sliding_window=W if sliding else None)


def target_modules(seed: int = 1) -> tuple[nn.Embedding, nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    embed, head = nn.Embedding(V, 32), nn.Linear(32, V, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=g))
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.3)
    return embed, head


def random_drafter(cfg: DrafterConfig, modules: tuple[nn.Embedding, nn.Linear], seed: int = 0) -> DFlashDrafter:
    g = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg, *modules)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    return model


def forward(model: DFlashDrafter, seed: int = 3) -> torch.Tensor:
    """One row (T=12) with anchors at 5 and 9 → final hidden [1,Q,H]."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    T, anchors = 12, [5, 9]
    features = torch.randn(1, T, cfg.num_aux_layers * cfg.hidden_size, generator=g)  # [R,T,k·H]
    tokens = torch.randint(0, V - 1, (T,), generator=g)
    ids = torch.full((1, len(anchors) * B), MASK, dtype=torch.long)
    pos = torch.zeros(1, len(anchors) * B, dtype=torch.long)
    for j, a in enumerate(anchors):
        ids[0, j * B] = tokens[a]
        pos[0, j * B:(j + 1) * B] = torch.arange(a, a + B)
    lo = torch.zeros(1, len(anchors), dtype=torch.int32)
    hi = torch.tensor([anchors], dtype=torch.int32)
    masks = build_dense_masks(lo, hi, T, B, cfg.attention_windows())
    with torch.no_grad():
        return model(features, torch.arange(T)[None], ids, pos, masks)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", sorted(LAYER_TYPES))
def test_round_trip_identical_tensors_and_outputs(tmp_path: Path, fmt: str, kind: str) -> None:
    """Export → import gives the same config, bit-identical tensors and bit-identical forward
    outputs (a swapped q/k, a transposed projection or a layer-index shift would change them)."""
    cfg = tiny_config(LAYER_TYPES[kind])
    modules = target_modules()
    model = random_drafter(cfg, modules)
    weights = model.trainable_state_dict()
    write_export(tmp_path / fmt, fmt, cfg, weights, META)
    cfg2, weights2, meta2 = load_drafter(tmp_path / fmt)
    assert cfg2.model_dump() == cfg.model_dump()
    assert sorted(weights2) == sorted(weights)
    for name, t in weights.items():
        assert weights2[name].dtype == t.dtype and torch.equal(weights2[name], t), name
    model2 = DFlashDrafter(cfg2, *modules)
    model2.load_trainable_state_dict(weights2)
    assert torch.equal(forward(model2), forward(model))
    assert meta2["kind"] == fmt and meta2["chat_template"] == META["chat_template"]
    assert meta2["enable_thinking"] is False and meta2["target"] == "tiny-target" and meta2["step"] == 7


def test_checkpoint_to_zlab_to_speculators_chain(tmp_path: Path) -> None:
    """A training checkpoint exported to zlab, that folder exported to speculators and back:
    every hop keeps tensors and metadata (export accepts any drafter folder)."""
    cfg = tiny_config(LAYER_TYPES["swa+full"])
    model = random_drafter(cfg, target_modules())
    save_checkpoint(tmp_path / "ckpt", model.trainable_state_dict(), cfg, META)
    export_drafter(tmp_path / "ckpt", "zlab", tmp_path / "z", read_target=False)
    export_drafter(tmp_path / "z", "speculators", tmp_path / "s", read_target=False)
    cfg3, weights3, meta3 = load_drafter(tmp_path / "s")
    assert cfg3 == cfg
    assert all(torch.equal(weights3[k], v) for k, v in model.trainable_state_dict().items())
    assert meta3["chat_template"] == META["chat_template"] and meta3["mask_token_reason"] == "given explicitly"


def test_bfloat16_export_casts_weights_and_records_dtype(tmp_path: Path) -> None:
    """--dtype bfloat16 writes bf16 tensors and says so in config.json (engines use it for dtype=auto)."""
    cfg = tiny_config(LAYER_TYPES["all-full"])
    weights = random_drafter(cfg, target_modules()).trainable_state_dict()
    write_export(tmp_path / "z", "zlab", cfg, weights, META, dtype=torch.bfloat16)
    _, w2, _ = load_drafter(tmp_path / "z")
    assert all(w2[k].dtype == torch.bfloat16 and torch.equal(w2[k], v.to(torch.bfloat16)) for k, v in weights.items())
    assert json.loads((tmp_path / "z" / "config.json").read_text())["dtype"] == "bfloat16"


def _folder_listing(path: Path) -> dict:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    return {"files": sorted(p.name for p in path.iterdir()), "weights": shapes}


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_matches_handwritten_golden(tmp_path: Path, fmt: str) -> None:
    """An exported folder has exactly the documented files, config keys/values and weight names
    and shapes (tests/assets/interop/<fmt>_golden.json, written by hand from docs/formats.md):
    no embedding or LM head, no extra or renamed keys."""
    cfg = tiny_config(LAYER_TYPES["swa+full"])
    weights = random_drafter(cfg, target_modules()).trainable_state_dict()
    write_export(tmp_path / fmt, fmt, cfg, weights, META, mask_token="<mask>", verifier_architectures=["TinyForCausalLM"])
    golden = json.loads((ASSETS / f"{fmt}_golden.json").read_text())
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    assert sorted(config) == sorted(golden["config"])
    assert config == golden["config"]
    listing = _folder_listing(tmp_path / fmt)
    assert listing["files"] == golden["files"]
    assert listing["weights"] == golden["weights"]
    assert (tmp_path / fmt / "chat_template.jinja").read_text() == META["chat_template"]


def test_keymap_tables_cover_the_drafter_exactly() -> None:
    """Each format's table names every drafter parameter once (a new parameter in model.py
    without a table entry would be silently dropped by export)."""
    cfg = tiny_config(LAYER_TYPES["swa+full"])
    names = set(random_drafter(cfg, target_modules()).trainable_state_dict())
    for fmt, table in WEIGHT_TABLES.items():
        expanded = expand_table(table, cfg.num_hidden_layers)
        assert set(expanded) == names, fmt
        assert len(set(expanded.values())) == len(expanded), fmt


def test_speculators_stores_capture_ids_one_above_dflash_ids(tmp_path: Path) -> None:
    """speculators' aux_hidden_state_layer_ids are EAGLE capture ids (residual entering layer i =
    output of layer i−1): ours + 1. Storing ours unshifted would feed the drafter features one
    layer too early in vLLM (vLLM PR #40727)."""
    cfg = tiny_config(LAYER_TYPES["all-full"])
    write_export(tmp_path / "s", "speculators", cfg, random_drafter(cfg, target_modules()).trainable_state_dict(), META)
    body = json.loads((tmp_path / "s" / "config.json").read_text())
    assert body["aux_hidden_state_layer_ids"] == [1, 3]
    assert body["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1


def _export(tmp_path: Path, fmt: str, layer_types: list[str]) -> Path:
    cfg = tiny_config(layer_types)
    return write_export(tmp_path / fmt, fmt, cfg, random_drafter(cfg, target_modules()).trainable_state_dict(), META)


def _edit_config(path: Path, **changes) -> None:
    body = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    (path / "config.json").write_text(json.dumps(body))


@pytest.mark.parametrize("changes, message", [
    ({"is_causal": None}, "without `is_causal: false`"),
    ({"is_causal": True}, "is_causal=true"),
    ({"architectures": ["DFlash2DraftModel"]}, "only DFlashDraftModel"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "RoPE type 'llama3'"),
    ({"num_target_layers": 6}, "num_target_layers=6 but the target has 4"),
    ({"dflash_config": {"block_size": 4, "mask_token_id": 39, "target_layer_ids": [0, 2], "conv_kernel_size": 2}},
     "dflash_config.conv_kernel_size=2 is not supported"),
    ({"dflash_config": {"block_size": 4, "mask_token_id": 40, "target_layer_ids": [0, 2]}}, "outside the vocabulary"),
])
def test_zlab_import_refuses_what_the_drafter_cannot_reproduce(tmp_path: Path, changes: dict, message: str) -> None:
    """Folders whose serving semantics differ from this drafter (causal SWA blocks, DFlash2, other
    MLP or RoPE, another target) fail with the reason instead of loading into a different model."""
    path = _export(tmp_path, "zlab", LAYER_TYPES["swa+full"])
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_drafter(path, num_target_layers=4)


@pytest.mark.parametrize("changes, message", [
    ({"sliding_window_non_causal": False}, "sliding_window_non_causal=false"),
    ({"draft_vocab_size": 32}, "reduced draft vocabularies"),
    ({"sample_from_anchor": True}, "sample_from_anchor=True"),
    ({"aux_hidden_state_layer_ids": [0, 2]}, "contains 0"),
    ({"input_embedding_scale": 8.0}, "input_embedding_scale=8.0 is not supported"),
])
def test_speculators_import_refuses_what_the_drafter_cannot_reproduce(tmp_path: Path, changes: dict,
                                                                      message: str) -> None:
    """Causal sliding layers, a reduced vocabulary, anchor sampling, an embedding capture id or an
    embedding scale (vLLM does not apply one) cannot be represented; each is refused with its reason."""
    path = _export(tmp_path, "speculators", LAYER_TYPES["swa+full"])
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        load_drafter(path)


def test_import_refuses_own_embedding_or_lm_head(tmp_path: Path) -> None:
    """A folder that ships its own embedding (or LM head) would be served with it; importing it
    onto the target's embedding would silently change the drafter."""
    from safetensors.torch import load_file, save_file

    path = _export(tmp_path, "zlab", LAYER_TYPES["all-full"])
    tensors = load_file(str(path / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(V, 32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="own token embedding"):
        load_drafter(path)


def test_zlab_import_accepts_model_prefix_and_reference_defaults(tmp_path: Path) -> None:
    """Folders written by other tools: a `model.` prefix on every tensor, block_size only at top
    level, rope_theta only at top level, all-full layers without is_causal (non-causal everywhere
    in every engine) all load."""
    from safetensors.torch import load_file, save_file

    path = _export(tmp_path, "zlab", LAYER_TYPES["all-full"])
    tensors = load_file(str(path / "model.safetensors"))
    save_file({f"model.{k}": v for k, v in tensors.items()}, str(path / "model.safetensors"))
    body = json.loads((path / "config.json").read_text())
    for key in ("is_causal", "rope_parameters", "dflash_trainer"):
        body.pop(key)
    body["dflash_config"].pop("block_size")
    (path / "config.json").write_text(json.dumps(body))
    cfg, weights, meta = load_drafter(path)
    assert cfg == tiny_config(LAYER_TYPES["all-full"])
    assert set(weights) == set(tensors) and meta["step"] is None


def test_export_refuses_non_empty_folder_and_unknown_format(tmp_path: Path) -> None:
    """An export never mixes files into an existing folder, names the valid formats, and refuses a
    control drafter trained without target features."""
    cfg = tiny_config(LAYER_TYPES["all-full"])
    weights = random_drafter(cfg, target_modules()).trainable_state_dict()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        write_export(tmp_path / "busy", "zlab", cfg, weights, META)
    with pytest.raises(ValueError, match="zlab, speculators"):
        write_export(tmp_path / "new", "eagle", cfg, weights, META)
    with pytest.raises(ValueError, match="without target features"):  # engines would feed it features
        write_export(tmp_path / "new", "zlab", cfg, weights, {**META, "no_target_features": True})


def test_cli_export_both_formats(tmp_path: Path) -> None:
    """`dflash-train export CKPT --format F --out DIR` writes loadable folders; a bad folder
    exits 2 with one error line."""
    cfg = tiny_config(LAYER_TYPES["swa+full"])
    model = random_drafter(cfg, target_modules())
    save_checkpoint(tmp_path / "ckpt", model.trainable_state_dict(), cfg, META)
    runner = CliRunner()
    for fmt in FORMATS:
        res = runner.invoke(app, ["export", str(tmp_path / "ckpt"), "--format", fmt, "--out", str(tmp_path / fmt),
                                  "--no-read-target"])
        assert res.exit_code == 0, res.output
        assert load_drafter(tmp_path / fmt)[0] == cfg
    res = runner.invoke(app, ["export", str(tmp_path / "nowhere"), "--format", "zlab", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and f"SOURCE {tmp_path / 'nowhere'}: not found" in " ".join(res.output.split())
