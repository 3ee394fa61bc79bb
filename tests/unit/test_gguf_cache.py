"""The dense copy of a GGUF target (target_model/gguf_cache.py) on the embedded SmolLM2-135M GGUF:
a load that reads the copy never touches the GGUF and gives the GGUF load's tensors bit for bit and
its tokenizer; the copy is per dtype, written whole or not at all, and can be turned off.
"""

from __future__ import annotations

import pytest
import torch
import transformers.modeling_gguf_pytorch_utils as gguf_utils

from dflash_trainer.target_model import gguf_cache
from dflash_trainer.target_model.load import load_target, load_tokenizer
from dflash_trainer.target_model.paths import resolve_target_path

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Déjà vu? 2+2 = ?\n<tab>\t"},
        {"role": "assistant", "content": "4."}]


def _gguf():
    folder, name = resolve_target_path(None, None)
    return folder / name


def _no_gguf_reads(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the GGUF was read although a dense copy exists")
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", refuse)


def _assert_same_target(got, want):
    assert got.name_or_path == want.name_or_path and got.model.config._name_or_path == want.model.config._name_or_path
    sg, sw = got.model.state_dict(), want.model.state_dict()
    assert sg.keys() == sw.keys()
    for k in sw:
        assert sg[k].dtype == sw[k].dtype and torch.equal(sg[k], sw[k]), k
    assert (got.lm_head.weight is got.embed_tokens.weight) == (want.lm_head.weight is want.embed_tokens.weight)
    assert got.model.generation_config.eos_token_id == want.model.generation_config.eos_token_id
    tg, tw = got.tokenizer, want.tokenizer
    assert tg.get_vocab() == tw.get_vocab() and tg.all_special_ids == tw.all_special_ids
    assert tg.chat_template == tw.chat_template and tg.name_or_path == tw.name_or_path
    text = tw.apply_chat_template(CHAT, tokenize=False)
    assert tg.apply_chat_template(CHAT, tokenize=False) == text
    assert tg(text)["input_ids"] == tw(text)["input_ids"]
    ids = torch.tensor([tw(text)["input_ids"][:24]])
    with torch.no_grad():
        assert torch.equal(got.model(input_ids=ids).logits, want.model(input_ids=ids).logits)


def test_load_target_keeps_a_copy_that_gives_the_gguf_load_exactly(tmp_path, monkeypatch):
    """The first load (from the GGUF) keeps an fp32 copy; the next load reads it without reading the
    GGUF and gives the first one: same tensors, tied head, stop ids, tokenizer, chat rendering and
    logits. Copies are per dtype. Loaded as a packaged target with an extra stop token: the package's
    additions are made at every load, after the copy is written (it holds the file's own generation
    config and tokenizer; the template applies only to files without one)."""
    import json
    from types import SimpleNamespace

    import dflash_trainer.target_model.load as load_mod

    monkeypatch.setenv(gguf_cache.ENV, str(tmp_path))
    entry = SimpleNamespace(chat_template="{{ 'unused: the file has a template' }}", stop_tokens=("<|im_start|>",))
    monkeypatch.setattr(load_mod, "packaged_target_of", lambda gguf: entry)
    assert gguf_cache.dense_copy(_gguf(), torch.float32) is None
    first = load_target(None, device="cpu", dtype=torch.float32)
    path = gguf_cache.dense_copy(_gguf(), torch.float32)
    assert path is not None and (path / gguf_cache.MARKER).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary folder was renamed, not left
    assert gguf_cache.dense_copy(_gguf(), torch.bfloat16) is None  # one copy per dtype
    stop = first.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert stop in first.model.generation_config.eos_token_id
    kept = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    assert stop not in (kept if isinstance(kept, list) else [kept])
    _no_gguf_reads(monkeypatch)
    second = load_target(None, device="cpu", dtype=torch.float32)
    _assert_same_target(second, first)
    assert second.tokenizer.chat_template != entry.chat_template
    copy_tokenizer = load_tokenizer(None)
    assert copy_tokenizer.get_vocab() == first.tokenizer.get_vocab()  # the copy's tokenizer
    # named as the GGUF load names it, so that records name the target, not the package's folder
    from dflash_trainer.data.prepare import tokenizer_name
    from dflash_trainer.target_model.paths import recorded_target

    assert tokenizer_name(copy_tokenizer) == tokenizer_name(first.tokenizer) == str(_gguf())
    assert recorded_target(tokenizer_name(copy_tokenizer)) == "smollm2-135m"


def test_copies_off_and_unwritable(tmp_path, monkeypatch):
    """`off` neither reads nor writes a copy; a folder that cannot be written is a warning, not an error."""
    monkeypatch.setenv(gguf_cache.ENV, "off")
    assert gguf_cache.cache_root() is None and gguf_cache.dense_copy(_gguf()) is None
    assert gguf_cache.store_dense_copy(_gguf(), torch.nn.Linear(1, 1), None, torch.float32) is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_cache.ENV, str(blocker / "sub"))  # a folder below a file: mkdir fails
    with pytest.warns(UserWarning, match="could not keep a dense copy"):
        assert gguf_cache.store_dense_copy(_gguf(), torch.nn.Linear(1, 1), None, torch.float32) is None


class _Saver:
    """A stand-in model whose save_pretrained writes one file, or raises `error`."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def save_pretrained(self, folder):
        if self.error is not None:
            raise self.error
        (folder / "model.safetensors").write_bytes(b"x")


def test_any_write_failure_is_a_warning_and_leaves_nothing(tmp_path, monkeypatch):
    """A writer's error of any type (safetensors raises its own, not OSError) is a warning, and its
    temporary folder is removed: no copy, no partial folder."""
    monkeypatch.setenv(gguf_cache.ENV, str(tmp_path))
    with pytest.warns(UserWarning, match="RuntimeError: disk full"):
        assert gguf_cache.store_dense_copy(_gguf(), _Saver(RuntimeError("disk full")), None, torch.float32) is None
    assert list(tmp_path.iterdir()) == []


def test_a_live_writer_is_left_alone_and_a_dead_ones_folder_is_not(tmp_path, monkeypatch):
    """While another live process writes the same copy (its temporary folder is recent), no second copy
    is written; a temporary folder older than WRITER_STALE_S does not stop a write."""
    import os
    import time

    monkeypatch.setenv(gguf_cache.ENV, str(tmp_path))
    final = f"{gguf_cache._key(_gguf())}-float32"
    other = tmp_path / f"{final}.tmp-{os.getppid()}"  # a live process: this one's parent
    other.mkdir()
    assert gguf_cache.store_dense_copy(_gguf(), _Saver(), None, torch.float32) is None
    assert gguf_cache.dense_copy(_gguf(), torch.float32) is None
    old = time.time() - gguf_cache.WRITER_STALE_S - 60
    os.utime(other, (old, old))
    assert gguf_cache.store_dense_copy(_gguf(), _Saver(), None, torch.float32) == tmp_path / final
    assert gguf_cache.dense_copy(_gguf(), torch.float32) == tmp_path / final


def test_a_dead_writers_folder_is_removed(tmp_path, monkeypatch):
    """A writer killed by a signal (no `finally`) leaves its recent temporary folder: its pid is gone,
    so the next writer removes it and writes the copy."""
    monkeypatch.setenv(gguf_cache.ENV, str(tmp_path))
    final = f"{gguf_cache._key(_gguf())}-float32"
    dead = tmp_path / f"{final}.tmp-{2 ** 22 + 12345}"  # above the default pid_max: no such process
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    assert gguf_cache.store_dense_copy(_gguf(), _Saver(), None, torch.float32) == tmp_path / final
    assert sorted(p.name for p in tmp_path.iterdir()) == [final]


def test_the_key_is_the_files_bytes_not_its_install(tmp_path):
    """Prevents one dense copy per virtual environment: the same GGUF installed again (another folder,
    another modification time) has the same key; a file whose last MiB differs has another."""
    import os
    import shutil

    a = tmp_path / "venv1" / "x.gguf"
    b = tmp_path / "venv2" / "x.gguf"
    for p in (a, b):
        p.parent.mkdir()
    a.write_bytes(b"GGUF" + bytes(range(256)) * (3 * 4096))  # 3 MiB + 4 bytes: head and tail do not overlap
    shutil.copyfile(a, b)
    os.utime(b, (1_000_000_000, 1_000_000_000))
    assert gguf_cache._key(a) == gguf_cache._key(b)
    body = bytearray(b.read_bytes())
    body[-1] ^= 1
    b.write_bytes(bytes(body))
    assert gguf_cache._key(a) != gguf_cache._key(b)
