"""`dflash-train init-config`: drafter configs derived from a target, and their validation.

L = target decoder layers, k = target features, H = hidden, V = embedding rows.
Targets: tiny random Qwen3 / Llama (tests/tiny_targets.py) with a small word-level tokenizer, and the
real SmolLM2-135M-Instruct (tokenizer + GGUF config only, marked slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.interop.export import write_export
from dflash_trainer.drafter.shape import drafter_config_from_target, load_target_config, shape_from_flags
from dflash_trainer.interop.load_drafter import load_drafter
from tests.tiny_targets import bundle_from_model, tiny_llama, tiny_qwen3
from dflash_trainer.training.run import load_drafter_config

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"


def init_config(hf_config, tokenizer, *, chat_template=None, **flags):
    """What `init-config` builds: its flags as the drafter section (`shape_from_flags`), then the one
    builder; info's notes are both steps' notes."""
    shape, notes = shape_from_flags(**flags)
    dc, info = drafter_config_from_target(hf_config, tokenizer, shape, chat_template=chat_template)
    return dc, {**info, "notes": notes + info["notes"]}


def word_tokenizer(num_words: int = 96, specials: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<extra_0>", "<extra_1>")):
    """A word-level tokenizer: <unk>=0, <s>=1 (bos), </s>=2 (eos), w3 … w{num_words-1}, then the
    added special tokens; chat template TEMPLATE (emits <|im_start|> and <|im_end|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, num_words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(list(specials))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    return tok


def target_folder(tmp_path: Path, model, tokenizer) -> Path:
    """An HF folder with the target's config and tokenizer (no weights: init-config reads none)."""
    folder = tmp_path / "target"
    model.config.architectures = [type(model).__name__]  # as save_pretrained of the model would record
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_tiny_qwen3_defaults(tmp_path: Path) -> None:
    """Qwen3 (L=8, k=5): ids round(1 + i·4/4) = [1,2,3,4,5]; widths copied (explicit head_dim 16);
    mask = first unused embedding row 100 (100 tokenizer entries, 128 rows)."""
    model = tiny_qwen3(num_layers=8)
    dc, info = init_config(model.config, word_tokenizer())
    assert dc.target_layer_ids == [1, 2, 3, 4, 5] and dc.num_target_layers == 8
    assert (dc.hidden_size, dc.intermediate_size, dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim) == (64, 128, 4, 2, 16)
    assert dc.vocab_size == 128 and dc.rope_theta == model.config.rope_parameters["rope_theta"]
    assert dc.rms_norm_eps == model.config.rms_norm_eps
    assert dc.mask_token_id == 100 and info["mask_token"] is None and "unused embedding row" in info["mask_token_reason"]
    assert dc.num_hidden_layers == 5 and dc.block_size == 16 and dc.layer_types == ["full_attention"] * 5
    assert dc.sliding_window is None


def test_tiny_llama_full_vocabulary_picks_spare_special_token() -> None:
    """Llama (L=6, k=3 → [1,2,3]; head_dim = 64/4 = 16). With every row a real token (128 entries,
    128 rows) the mask is the first special token that is not bos/eos/unk and that the chat template
    never emits: <extra_0> (id 126), not <|im_start|> (124)."""
    tok = word_tokenizer(num_words=124)
    assert len(tok) == 128
    dc, info = init_config(tiny_llama(num_layers=6).config, tok, num_target_features=3, num_layers=3,
                                    block_size=8, layer_types="last-full")
    assert dc.target_layer_ids == [1, 2, 3] and dc.head_dim == 16 and dc.num_key_value_heads == 2
    assert dc.mask_token_id == 126 and info["mask_token"] == "<extra_0>"
    assert dc.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert dc.sliding_window == 2048 and any("default window" in n for n in info["notes"])


def gguf_padded_tokenizer(real: int = 100, rows: int = 128):
    """Like a tokenizer read from a GGUF whose converter padded the vocabulary: ids 0 … real−1 are
    word tokens and the specials <|im_start|> (real−2) and <|im_end|> (real−1); ids real … rows−1 are
    placeholder tokens `[PAD{id}]` (Qwen2.5-Coder-0.5B's GGUF: 151665 real, 151936 rows)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, real - 2)},
             "<|im_start|>": real - 2, "<|im_end|>": real - 1, **{f"[PAD{i}]": i for i in range(real, rows)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    return tok


def test_gguf_padding_placeholders_count_as_unused_rows() -> None:
    """A GGUF tokenizer lists every embedding row, the converter's padding rows as `[PAD{id}]`: the mask
    is the first of them (as with the model's own HF tokenizer, which ends before them), not a spare
    special token; an explicit placeholder row is accepted, and it has no token name to export."""
    from dflash_trainer.drafter.shape import mask_token_text, real_token_count

    tok = gguf_padded_tokenizer()
    assert len(tok) == 128 and real_token_count(tok) == 100 and real_token_count(word_tokenizer()) == 100
    dc, info = init_config(tiny_qwen3(num_layers=8).config, tok)
    assert dc.mask_token_id == 100 and info["mask_token"] is None
    assert info["mask_token_reason"] == ("first unused embedding row (100 tokenizer entries + 28 GGUF padding "
                                         "placeholders [PADn], 128 rows)")
    dc, _ = init_config(tiny_qwen3(num_layers=8).config, tok, mask_token_id=127)
    assert dc.mask_token_id == 127 and mask_token_text(tok, 127) is None
    assert "≥ 100" in _err(tokenizer=tok, mask_token_id=50)


def _err(**kw) -> str:
    model = kw.pop("model", None) or tiny_qwen3(num_layers=8)
    with pytest.raises(ValueError) as e:
        init_config(model.config, kw.pop("tokenizer", word_tokenizer()), **kw)
    return str(e.value)


@pytest.mark.parametrize("kw, message", [
    ({"target_layer_ids": [1, 8]}, "target_layer_ids=[1, 8]: ids [8] lie outside [0, 7]"),
    ({"target_layer_ids": [-1, 3]}, "ids [-1] lie outside"),
    ({"target_layer_ids": [5, 2, 7]}, "must be in ascending order"),
    ({"target_layer_ids": [2, 2, 5]}, "ids [2] are duplicated"),
    ({"mask_token_id": 50}, "mask_token_id=50: the tokenizer uses it for the real token 'w50'"),
    ({"mask_token_id": 2}, "it is the tokenizer's eos_token '</s>'"),
    ({"mask_token_id": 96}, "the chat template emits '<|im_start|>'"),
    ({"mask_token_id": 128}, "mask_token_id=128 is outside the vocabulary (128 rows)"),
    ({"sliding_window": 0, "layer_types": "all-swa"}, "--sliding-window 0: must be ≥ 1"),
    ({"sliding_window": -4}, "--sliding-window -4"),
    ({"block_size": 1}, "--block-size 1: a block is the anchor plus at least one mask slot"),
    ({"num_layers": 0}, "--num-layers 0"),
    ({"layer_types": "swa,full"}, "--layer-types 'swa,full': 2 entries for num_layers=5"),
])
def test_each_validation_error_has_its_message(kw: dict, message: str) -> None:
    """Every invalid choice is refused before anything is written, naming the flag and the fix."""
    assert message in _err(**kw)


def test_widths_that_do_not_divide_are_refused() -> None:
    """KV heads that do not divide the query heads, or a hidden size not divisible by the heads
    without an explicit head_dim, cannot form a drafter with the target's width."""
    cfg = tiny_qwen3(num_layers=8).config
    cfg.num_key_value_heads = 3
    with pytest.raises(ValueError, match="num_key_value_heads=3 does not divide num_attention_heads=4"):
        init_config(cfg, word_tokenizer())
    cfg = tiny_llama(num_layers=6).config
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 6, 3, None
    with pytest.raises(ValueError, match="hidden_size=64 is not divisible by num_attention_heads=6"):
        init_config(cfg, word_tokenizer())


def test_spare_special_mask_is_accepted_and_explicit_window_kept() -> None:
    """An explicit spare special token (<extra_1>, 99) and an explicit window are kept as given."""
    dc, info = init_config(tiny_qwen3(num_layers=8).config, word_tokenizer(), mask_token_id=99,
                                    layer_types="all-swa", sliding_window=64)
    assert dc.mask_token_id == 99 and info["mask_token"] == "<extra_1>" and dc.sliding_window == 64


@pytest.mark.parametrize("mask_token_id, message", [
    (50, "mask_token_id=50: the tokenizer uses it for the real token 'w50'"),
    (2, "mask_token_id=2: it is the tokenizer's eos_token '</s>'"),
    (96, "mask_token_id=96: the chat template emits '<|im_start|>'"),
    (128, "mask_token_id=128 is outside the vocabulary (128 rows)"),
])
def test_train_refuses_the_mask_ids_init_config_refuses(mask_token_id: int, message: str) -> None:
    """Prevents `train --set mask_token_id=ID` from accepting an id that init-config refuses (eos, a
    special the chat template emits): both paths run the same rule with the same message."""
    model = tiny_qwen3(num_layers=8)
    assert message in _err(model=model, mask_token_id=mask_token_id)
    with pytest.raises(ValueError) as e:
        load_drafter_config(TrainConfig(mask_token_id=mask_token_id), bundle_from_model(model, word_tokenizer()))
    assert message in str(e.value)
    dc, reason = load_drafter_config(TrainConfig(mask_token_id=99), bundle_from_model(model, word_tokenizer()))
    assert dc.mask_token_id == 99 and reason == "given explicitly"  # a spare special (<extra_1>) is fine


def test_drafter_config_file_with_bad_layer_ids_names_the_field() -> None:
    """A hand-edited drafter config with unsorted or duplicated target_layer_ids is refused by
    DrafterConfig with the same message (and fix) as init-config and train."""
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=128, mask_token_id=100, num_target_layers=8, num_hidden_layers=5, block_size=16)
    from pydantic import ValidationError

    from dflash_trainer.drafter.config import DrafterConfig
    with pytest.raises(ValidationError, match=r"target_layer_ids=\[5, 2, 7\]: ids must be in ascending order .* use \[2, 5, 7\]"):
        DrafterConfig(target_layer_ids=[5, 2, 7], **base)
    with pytest.raises(ValidationError, match=r"ids \[2\] are duplicated .* use \[2, 5\]"):
        DrafterConfig(target_layer_ids=[2, 2, 5], **base)
    assert _err(target_layer_ids=[5, 2, 7]).startswith("target_layer_ids=[5, 2, 7]: ids must be in ascending order")


def test_cli_init_config_then_train_reads_it(tmp_path: Path) -> None:
    """`init-config --target DIR --out FILE` writes a file that `train --drafter-config FILE`
    accepts unchanged against the same target; a bad flag exits 2 with the message."""
    model = tiny_qwen3(num_layers=8)
    folder = target_folder(tmp_path, model, word_tokenizer())
    out = tmp_path / "drafter.json"
    res = CliRunner().invoke(app, ["init-config", "--target", str(folder), "--out", str(out), "--num-layers", "2",
                                   "--block-size", "8", "--layer-types", "swa,full", "--sliding-window", "256",
                                   "--target-layer-ids", "1,4,7"])
    assert res.exit_code == 0, res.output
    body = json.loads(out.read_text())
    assert body["dflash"]["target"] == str(folder) and body["mask_token_id"] == 100
    dc, reason = load_drafter_config(TrainConfig(drafter_config=str(out)), bundle_from_model(model))
    assert dc.target_layer_ids == [1, 4, 7] and dc.layer_types == ["sliding_attention", "full_attention"]
    assert dc.sliding_window == 256 and dc.block_size == 8 and reason.startswith("first unused embedding row")  # the reason init-config recorded

    res = CliRunner().invoke(app, ["init-config", "--target", str(folder), "--out", str(tmp_path / "bad.json"),
                                   "--target-layer-ids", "3,1"])
    assert res.exit_code == 2 and "ascending order" in " ".join(res.output.split())
    assert not (tmp_path / "bad.json").exists()


def test_init_from_takes_the_folders_config_and_checks_the_target(tmp_path: Path) -> None:
    """train --init-from: the drafter config comes from the imported folder; a folder made for
    another target, or combined with --drafter-config, is refused with a clear error."""
    model = tiny_qwen3(num_layers=8)
    dc, _ = init_config(model.config, word_tokenizer(), num_layers=2, layer_types="full")
    bundle = bundle_from_model(model)
    drafter = DFlashDrafter(dc, bundle.embed_tokens, bundle.lm_head)
    write_export(tmp_path / "z", "zlab", dc, drafter.trainable_state_dict(), {"mask_token_reason": "r"})
    init = load_drafter(tmp_path / "z", num_target_layers=bundle.num_layers)
    got, reason = load_drafter_config(TrainConfig(init_from=str(tmp_path / "z")), bundle, init)
    assert got == dc and reason.startswith(f"from {tmp_path / 'z'}")
    with pytest.raises(ValueError, match="both set"):
        load_drafter_config(TrainConfig(init_from=str(tmp_path / "z"), drafter_config="x.json"), bundle, init)
    with pytest.raises(ValueError, match="num_target_layers=8 but the target has 6"):
        load_drafter(tmp_path / "z", num_target_layers=6)
    other = bundle_from_model(tiny_qwen3(num_layers=8, hidden=32, num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="init_from: widths"):
        load_drafter_config(TrainConfig(init_from=str(tmp_path / "z")), other, init)


def test_export_names_the_mask_token_and_verifier_from_the_target(tmp_path: Path) -> None:
    """With the target readable, the zlab export writes dflash_config.mask_token (SGLang refuses
    a mask id that conflicts with the tokenizer's id for that string) and the speculators export
    the verifier's architectures; an unreadable target only drops them, with a note."""
    from dflash_trainer.interop.export import export_drafter
    from dflash_trainer.interop.checkpoint_files import save_checkpoint

    model = tiny_qwen3(num_layers=8)
    tok = word_tokenizer(num_words=124)  # every row a real token → mask = <extra_0> (126)
    folder = target_folder(tmp_path, model, tok)
    dc, info = init_config(model.config, tok, num_layers=2)
    bundle = bundle_from_model(model)
    weights = DFlashDrafter(dc, bundle.embed_tokens, bundle.lm_head).trainable_state_dict()
    save_checkpoint(tmp_path / "ckpt", weights, dc, {"target": str(folder), "mask_token_reason": info["mask_token_reason"]})
    _, _, notes = export_drafter(tmp_path / "ckpt", "zlab", tmp_path / "z")
    assert notes == []
    assert json.loads((tmp_path / "z" / "config.json").read_text())["dflash_config"]["mask_token"] == "<extra_0>"
    _, _, notes = export_drafter(tmp_path / "ckpt", "speculators", tmp_path / "s")
    verifier = json.loads((tmp_path / "s" / "config.json").read_text())["speculators_config"]["verifier"]
    # the folder has no hub id (_name_or_path): its name, never the local path, with a warning
    assert verifier == {"name_or_path": folder.name, "architectures": ["Qwen3ForCausalLM"]}
    assert len(notes) == 1 and "--verifier" in notes[0]
    _, _, notes = export_drafter(tmp_path / "ckpt", "zlab", tmp_path / "z2", target=str(tmp_path / "missing"))
    assert len(notes) == 1 and "not read" in notes[0]
    assert "mask_token" not in json.loads((tmp_path / "z2" / "config.json").read_text())["dflash_config"]


@pytest.mark.slow
def test_smollm2_from_gguf_config_and_tokenizer() -> None:
    """SmolLM2-135M-Instruct (embedded GGUF; config and tokenizer only): L=30 → [1,8,14,20,27];
    H 576, 9/3 heads, head_dim 64, MLP 1536, 49152 rows = 49152 tokens, so the mask is a special
    token the ChatML template never emits: <repo_name> (3). Reads ~1 min of GGUF metadata."""
    pytest.importorskip("gguf")
    try:
        hf_config, tokenizer, _ = load_target_config(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    dc, info = init_config(hf_config, tokenizer)
    assert dc.num_target_layers == 30 and dc.target_layer_ids == [1, 8, 14, 20, 27]
    assert (dc.hidden_size, dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim, dc.intermediate_size) == (576, 9, 3, 64, 1536)
    assert dc.vocab_size == 49152 == len(tokenizer)
    assert dc.mask_token_id == 3 and info["mask_token"] == "<repo_name>"  # first spare special (0-2 are bos/eos/ChatML)
    assert info["mask_token"] not in tokenizer.chat_template
    with pytest.raises(ValueError, match="mask_token_id=1: it is the tokenizer's bos_token '<\\|im_start\\|>'"):
        init_config(hf_config, tokenizer, mask_token_id=1)
    with pytest.raises(ValueError, match="mask_token_id=1000: the tokenizer uses it for the real token"):
        init_config(hf_config, tokenizer, mask_token_id=1000)


