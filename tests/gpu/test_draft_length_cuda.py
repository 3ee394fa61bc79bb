"""GPU-only: draft lengths k on CUDA (decoding/engine.py `set_draft_length` re-captures the speculative
round's graph, its drafter block now k+1 slots): replayed decoding at every k equals slow greedy decoding, and the speedup table
(evaluation/speedup.py) measures round costs from graph replays and decodes the chosen k losslessly."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_eval_common import greedy_reference, target_and_drafter, word_tokenizer  # noqa: E402

from dflash_trainer.decoding.engine import PLAIN, SPECULATIVE, DecodeEngine  # noqa: E402
from dflash_trainer.evaluation.draft_length import best_draft_length  # noqa: E402
from dflash_trainer.evaluation.speedup import speedup_table  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts(seed=3, lengths=(5, 1, 9, 3, 12, 7, 2, 4)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 11, (L,), generator=g).tolist() for L in lengths]


def test_every_draft_length_replays_losslessly_on_cuda():
    """Prevents a stale graph (captured at another k) or a graph captured with live rows: after each
    set_draft_length the replayed decode equals slow greedy decoding, accepts at most k, and k = 0
    keeps only the plain graph."""
    dev = torch.device("cuda")
    bundle, drafter = target_and_drafter("qwen3", vocab_size=12, block_size=4)
    bundle.model.to(dev)
    drafter.to(dev)
    prompts = _prompts()
    refs = [greedy_reference(bundle, p, 20, {2}) for p in prompts]
    engine = DecodeEngine(bundle, drafter, rows=4, max_prompt_tokens=12, max_new_tokens=20, eos_ids={2})
    for k in (0, 1, 2, 3, 1):
        engine.set_draft_length(k)
        assert set(engine.graphs) == ({PLAIN} if k == 0 else {PLAIN, SPECULATIVE})
        out = [engine.decode(prompts[c:c + 4], speculative=True) for c in (0, 4)]
        assert [(t, s) for d in out for t, s in zip(d.tokens, d.stop)] == refs, k
        assert all(n <= k for d in out for a in d.accepted for n in a)


def test_speedup_table_on_cuda():
    """The table on CUDA: graph-replayed round costs for every k, the chosen k the best predicted,
    every measured run lossless."""
    dev = torch.device("cuda")
    bundle, drafter = target_and_drafter("llama", vocab_size=12, block_size=4)
    bundle.model.to(dev)
    drafter.to(dev)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    table = speedup_table(bundle, drafter, _prompts(), [1, 4, 8], max_new_tokens=16)
    for r in table:
        assert r["cuda_graphs"] == [PLAIN, SPECULATIVE] and len(r["round_s"]) == 4
        assert r["chosen_draft_length"] == best_draft_length(r["predicted"])
        assert r["lossless"] is True and r["chosen_lossless"] is True
        print(r["batch_size"], [round(t * 1e6, 1) for t in r["round_s"]], r["chosen_draft_length"],
              round(r["speedup"], 3), round(r["chosen_speedup"], 3))
