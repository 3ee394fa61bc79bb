"""A tiny end-to-end setup for run-level tests: a random Llama HF folder with a word-level
tokenizer (100 tokens over 128 embedding rows, so row 100 is the mask token) and prepared rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np


def make_target(folder: Path, family: str | None = None) -> Path:
    """Save a tiny random Llama (3 layers, H 64, vocab rows 128) + tokenizer to `folder`; with
    `family`, that family of the target zoo (tests/zoo.py, also 128 rows) instead of the Llama."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_targets import tiny_llama
    from tests.zoo import zoo_model

    model = tiny_llama(num_layers=3, seed=7) if family is None else zoo_model(family, seed=7)[0]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 100)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant {% endif %}")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def make_prepared(folder: Path, rows: int = 12, T: int = 128, seed: int = 0, validation_rows: int = 2) -> Path:
    """Rows of two documents each (positions restart), supervised second halves; train/ and validation/."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    half = T // 2
    pos = np.concatenate([np.arange(half), np.arange(half)]).astype(np.int32)
    mask = (pos >= half // 4).astype(np.int8)
    for split, n in (("train", rows), ("validation", validation_rows)):
        ids = rng.integers(3, 100, size=(n, T)).astype(np.int32)
        Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": [mask.tolist()] * n,
                           "position_ids": [pos.tolist()] * n}).save_to_disk(str(folder / split))
    return folder


def make_chats(path: Path, n: int) -> Path:
    """A JSONL chat file of `n` one-turn ShareGPT conversations in the tiny tokenizer's words (w3 … w99;
    10-word questions, 40-word answers), seeded: the same file every call."""
    import json
    import random

    rng = random.Random(0)

    def words(k: int) -> str:
        return " ".join(f"w{rng.randrange(3, 100)}" for _ in range(k))

    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": words(10)},
                                                          {"from": "gpt", "value": words(40)}]}) + "\n"
                            for _ in range(n)))
    return path


TINY_SETS = ("seq_len=128", "num_anchors=16", "num_layers=1", "save_every=3", "target_layer_ids=[0,2]", "block_size=8")


def train_cmd(out: Path, target: Path, prepared: Path, *extra: str) -> list[str]:
    """The CLI command of a tiny CPU run (per-step logs, checkpoints every 3 steps)."""
    return [sys.executable, "-m", "dflash_trainer.cli.main", "train", "--out", str(out), "--target", str(target),
            "--prepared", str(prepared), "--device", "cpu", "--log-every", "1", "--max-steps", "12",
            *[arg for s in TINY_SETS for arg in ("--set", s)], *extra]


def train_here(out: Path, target: Path, prepared: Path | None, *sets: str, max_steps: int = 12, data: Path | None = None):
    """The run of `train_cmd` in this process, for tests that check the run rather than the CLI
    (no interpreter and library start-up): (RunResult, the console's text, each printed line whole as
    the CLI's soft-wrapping console writes it). prepared None and
    `data`: the run prepares the chats itself (train_cmd without --prepared, with --data)."""
    import io

    from rich.console import Console

    from dflash_trainer.config.load import load_config
    from dflash_trainer.training.run import train

    console = Console(file=io.StringIO(), width=200, soft_wrap=True)  # as the CLI's (cli/common.py): lines unbroken
    cfg = load_config(None, {"out": str(out), "target.path": str(target), "prepared": prepared and str(prepared),
                             "data.chats": data and str(data), "device": "cpu", "log_every": 1, "max_steps": max_steps},
                      [*TINY_SETS, *sets])
    return train(cfg, console), console.file.getvalue()


def cli_env() -> dict[str, str]:
    """The environment of a CLI subprocess: this process's torch thread count (OMP_NUM_THREADS), so a
    run started by the CLI and continued in this process (train_here) computes bit for bit alike on
    a machine with more cores than the tests use."""
    import os

    import torch

    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cli_env())
