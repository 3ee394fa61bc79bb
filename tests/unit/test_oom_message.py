"""Out-of-memory messages (recipe/oom.py) against hand-worked cases for the embedded SmolLM2-135M: H 576,
30 layers, 3 KV heads, head_dim 64, vocab 49,152, 134.5M parameters, k 5; and the commands' exit with them."""

import torch
from typer.testing import CliRunner

from dflash_trainer.recipe.oom import (eval_oom_message, failed_allocation, regenerate_oom_message,
                                       train_oom_message)
from dflash_trainer.recipe.memory import GIB
from dflash_trainer.recipe.plan import SMOLLM2_135M

S = SMOLLM2_135M
# torch's CUDA allocator message, shortened: asked 2 GiB, 1.25 GiB free → 0.75 GiB = 805,306,368 B short
TORCH_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
             "1.25 GiB is free. Including non-PyTorch memory, this process has 138.5 GiB memory in use.")


def test_failed_allocation_reads_torch_units():
    """Prevents a unit slip (MiB read as GiB) scaling every suggested cut by 1024."""
    assert failed_allocation(TORCH_OOM) == (2 * GIB, round(1.25 * GIB))
    assert failed_allocation("Tried to allocate 20.00 MiB. GPU 0 ... of which 3.12 MiB is free") == (
        20 * 2**20, round(3.12 * 2**20))
    assert failed_allocation("Tried to allocate 512 B") == (512, None)
    assert failed_allocation("device-side assert") == (None, None)


def test_train_names_each_setting_and_its_new_value():
    """Prevents an OOM that says only "out of memory": each lever gets the value that covers the shortfall."""
    msg = train_oom_message(TORCH_OOM, S, seq_len=4096, rows_per_step=8, feature_cache_gib=116)
    assert msg.startswith("out of GPU memory in train: an allocation of 2.00 GiB found 1.25 GiB free (0.75 GiB short)")
    # cache: 0.75 GiB short → one 4 GiB step: 116 → 112; a row is 4096 · 5 · 576 · 2 + 4096 · 8 = 23,625,728 B
    # (22.53 MiB), so 4 GiB = 4,294,967,296 B holds 181 rows fewer
    assert ("target.feature_cache_gib from 116 to 112 (--set target.feature_cache_gib=112): 181 fewer cached rows "
            "of 22.53 MiB") in msg
    # a step row: 4096 · (49,152 · 2 + 272 · 576) = 1,044,381,696 B = 0.97 GiB ≥ 0.75 GiB → one row fewer
    assert "optim.rows_per_step from 8 to 7 (--set optim.rows_per_step=7): a row of 4096 tokens takes 0.97 GiB" in msg
    # a token of 8 rows: 8 · 254,976 = 2,039,808 B (1.95 MiB); 805,306,368 / 2,039,808 = 394.8 → 395 tokens:
    # 4096 − 395 = 3701 → 3584 (a multiple of 128)
    assert "data.seq_len from 4096 to 3584 (--set data.seq_len=3584; a multiple of 128)" in msg
    assert "takes 1.95 MiB" in msg


def test_train_at_b16_counts_the_block_tokens():
    """Prevents advice from the B = 8 rule at the recipe's B = 16: with 512 anchors a row holds 8,192 block
    tokens, so a step row costs more and a token of seq_len saves only its logits."""
    msg = train_oom_message(TORCH_OOM, S, seq_len=4096, rows_per_step=8, feature_cache_gib=112, block_tokens=8192)
    # a step row: 4096 · 49,152 · 2 + 8192 · 272 · 576 = 1,686,110,208 B = 1.57 GiB ≥ 0.75 GiB → one row fewer
    assert "optim.rows_per_step from 8 to 7 (--set optim.rows_per_step=7): a row of 4096 tokens takes 1.57 GiB" in msg
    # a token of 8 rows: 8 · 49,152 · 2 = 786,432 B (0.75 MiB; the activations follow the 8,192 block tokens);
    # 805,306,368 / 786,432 = 1,024 tokens: 4096 − 1024 = 3072
    assert "data.seq_len from 4096 to 3072 (--set data.seq_len=3072; a multiple of 128)" in msg
    assert "takes 0.75 MiB" in msg
    # block tokens at most seq_len: the B = 8 rule (the test above)
    assert train_oom_message(TORCH_OOM, S, seq_len=4096, rows_per_step=8, feature_cache_gib=116, block_tokens=4096) \
        == train_oom_message(TORCH_OOM, S, seq_len=4096, rows_per_step=8, feature_cache_gib=116)


def test_train_cache_allocation_that_only_the_cache_can_cover():
    """Prevents suggesting rows or seq_len cuts that cannot cover a 96 GiB shortfall (the cache's own allocation)."""
    msg = train_oom_message("Tried to allocate 116.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
                            "20.00 GiB is free.", S, seq_len=4096, rows_per_step=8, feature_cache_gib=116)
    # 96 GiB short = 24 steps of 4 GiB: 116 → 20; 96 GiB / 23,625,728 B = 4,363.1 → 4,363 rows
    assert "target.feature_cache_gib from 116 to 20 (--set target.feature_cache_gib=20): 4,363 fewer cached rows" in msg
    # rows: 96 GiB / 0.97 GiB = 99 rows of 8; seq_len: 50,534 tokens of 4096 → neither is offered
    assert "rows_per_step" not in msg and "data.seq_len" not in msg


def test_train_unknown_shortfall_drops_one_unit_and_no_cache():
    """Prevents a "lower by 0" suggestion when torch's message carries no sizes (or the card is fragmented)."""
    msg = train_oom_message("CUDA error: out of memory", S, seq_len=4096, rows_per_step=1, feature_cache_gib=0)
    assert msg.startswith("out of GPU memory in train. Lower one of these")
    assert "feature_cache_gib" not in msg and "rows_per_step" not in msg  # no cache; 1 − 1 row = 0 rows
    assert "data.seq_len from 4096 to 3968" in msg  # one token fewer, down to a multiple of 128
    # the free count from torch.cuda.mem_get_info when the message lacks it: the same as TORCH_OOM's
    fallback = train_oom_message("Tried to allocate 2.00 GiB", S, seq_len=4096, rows_per_step=8, feature_cache_gib=116,
                                 free_fallback=round(1.25 * GIB))
    full = train_oom_message(TORCH_OOM, S, seq_len=4096, rows_per_step=8, feature_cache_gib=116)
    assert fallback.removesuffix(" (torch: Tried to allocate 2.00 GiB)") == full.removesuffix(f" (torch: {TORCH_OOM})")
    assert fallback != full  # each ends with its own torch text
    # nothing fits: one row of 128 tokens already short by more than all of it
    msg = train_oom_message("Tried to allocate 500.00 GiB. of which 0.00 B is free", S, seq_len=128, rows_per_step=1,
                            feature_cache_gib=0)
    assert msg.endswith("Even one row of 128 tokens does not fit: use a larger card or a smaller target (torch: Tried to "
                        "allocate 500.00 GiB. of which 0.00 B is free)")


def test_regenerate_batch():
    """Prevents a regeneration OOM that does not say how many rows the card holds."""
    msg = regenerate_oom_message("Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.2 GiB of which "
                                 "512.00 MiB is free.", S, batch_size=2048, prompt_tokens=1536, new_tokens=512)
    # KV a row: 2 · 30 · 3 · 64 · 2048 · 2 = 47,185,920 B (45 MiB); 1 GiB short / 45 MiB = 22.8 → 23 rows
    assert "regenerate's --batch-size from 2048 to 2025: a row's KV cache of 1536+512 tokens takes 45.00 MiB" in msg
    one = regenerate_oom_message("Tried to allocate 1.00 GiB. of which 0.00 B is free", S, batch_size=8,
                                 prompt_tokens=1536, new_tokens=512)
    assert one.endswith("One row does not fit: lower --max-prompt-tokens or --max-new-tokens (torch: Tried to allocate "
                        "1.00 GiB. of which 0.00 B is free)")


def test_eval_batch_and_dtype():
    """Prevents an eval OOM without its two levers: the batch of turns and the fp32 target."""
    oom = "Tried to allocate 300.00 MiB. GPU 0 has a total capacity of 79.2 GiB of which 100.00 MiB is free."
    bf16 = eval_oom_message(oom, S, batch_size=256, new_tokens=256, block_size=16, float32=False)
    # a bf16 turn: 2 · 30 · 3 · 64 · (2048 + 256 + 16) · 2 = 53,452,800 B (50.98 MiB); 200 MiB short → 3.9 → 4 turns
    assert "eval's --batch-size from 256 to 252: a turn's KV cache of 2048+256+16 tokens takes 50.98 MiB" in bf16
    # a prompt token of 256 turns: 2 · 30 · 3 · 64 · 2 B = 23,040 B · 256 = 5.625 MiB; 200 MiB short → 35.6 → 36
    assert ("eval's --max-prompt-tokens from 2048 to 2012, when the batch's prompts reach it (longer turns are "
            "skipped and counted): a prompt token of 256 turns takes 5.62 MiB") in bf16
    msg = eval_oom_message(oom, S, batch_size=256, new_tokens=256, block_size=16, float32=True)
    # an fp32 target caches in fp32: 101.95 MiB a turn → 2 turns; 11.25 MiB a prompt token of 256 turns → 18
    assert "eval's --batch-size from 256 to 254: a turn's KV cache of 2048+256+16 tokens takes 101.95 MiB" in msg
    assert "eval's --max-prompt-tokens from 2048 to 2030" in msg
    # fp32 → bf16 frees 134.5M · 2 B = 269,000,000 B of weights + 256 · 53,452,800 B of KV = 12.99 GiB
    assert "eval's --dtype from float32 to bfloat16: the target's weights and KV cache take 12.99 GiB less" in msg
    assert "--dtype" not in eval_oom_message("x", S, batch_size=256, new_tokens=256, block_size=16, float32=False)
    # 64.5 GiB short (the held-out suite's long prompts at 256 rows, once): bf16 frees 12.99 GiB (≥ a tenth)
    big = eval_oom_message("Tried to allocate 99.79 GiB. GPU 0 has a total capacity of 79.18 GiB of which 35.29 GiB "
                           "is free.", S, batch_size=256, new_tokens=256, block_size=16, float32=True)
    assert "--batch-size" not in big and "eval's --max-prompt-tokens from 2048 to" not in big  # 64.5 GiB ≫ a batch
    assert "take 12.99 GiB less" in big
    # 0.25 GiB of weights at batch 1 (0.35 GiB with its cache) is no lever for a 64.5 GiB shortfall
    one = eval_oom_message("Tried to allocate 99.79 GiB. GPU 0 has a total capacity of 79.18 GiB of which 35.29 GiB "
                           "is free.", S, batch_size=1, new_tokens=256, block_size=16, float32=True)
    assert one.startswith("out of GPU memory in eval") and "--dtype" not in one
    assert "One turn does not fit: lower --max-prompt-tokens or --max-new-tokens" in one


def test_every_message_ends_with_torchs_own_text_on_one_line():
    """Prevents the advice replacing the error: torch's message (which allocation, which device, its
    own hints) is kept, whitespace made single spaces."""
    msg = train_oom_message(TORCH_OOM, S, seq_len=4096, rows_per_step=8, feature_cache_gib=116)
    assert msg.endswith(f": a token of the step's 8 rows takes 1.95 MiB (torch: {TORCH_OOM})")
    two_lines = "CUDA out of memory.\n  Tried to allocate 1.00 GiB."
    assert eval_oom_message(two_lines, S, batch_size=256, new_tokens=256, block_size=16, float32=False).endswith(
        "(torch: CUDA out of memory. Tried to allocate 1.00 GiB.)")
    assert "(torch: " not in eval_oom_message("", S, batch_size=256, new_tokens=256, block_size=16, float32=False)


def test_eval_oom_uses_the_drafters_trained_block_size(tmp_path):
    """Prevents eval's OOM arithmetic assuming B = 16 for a drafter trained at another B when --block-size
    is not given (the eval runs the trained B): a turn's KV cache of 2048 + 256 + B tokens, 2 · 30 · 3 ·
    64 · 2 = 23,040 B a token: B = 8 → 2,312 tokens = 53,268,480 B = 50.80 MiB."""
    import json

    from dflash_trainer.cli.oom import eval_oom
    from dflash_trainer.evaluation.settings import EvalSettings
    from dflash_trainer.interop.formats import trained_block_size

    ckpt, zlab, spec = tmp_path / "ckpt", tmp_path / "zlab", tmp_path / "spec"
    for folder, body in ((ckpt, {"block_size": 8, "target_layer_ids": [1], "dflash": {}}),
                         (zlab, {"architectures": ["DFlashDraftModel"], "dflash_config": {"block_size": 10}}),
                         (spec, {"speculators_model_type": "dflash"})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(body))
    assert [trained_block_size(p) for p in (ckpt, zlab, spec, tmp_path, None)] == [8, 10, 8, None, None]
    run = tmp_path / "run"  # a run folder, as `eval --drafter runs/q3` takes it: its checkpoint-final
    (run / "checkpoint-final").mkdir(parents=True)
    (run / "checkpoint-final" / "config.json").write_text((ckpt / "config.json").read_text())
    assert trained_block_size(run) == 8
    error = torch.OutOfMemoryError(TORCH_OOM)
    msg = eval_oom(EvalSettings(drafter=str(ckpt)), error)
    assert "a turn's KV cache of 2048+256+8 tokens takes 50.80 MiB" in msg and msg.endswith(f"(torch: {TORCH_OOM})")
    assert "2048+256+4 tokens" in eval_oom(EvalSettings(drafter=str(ckpt), block_size=4), error)  # --block-size wins
    assert "2048+256+16 tokens takes 50.98 MiB" in eval_oom(EvalSettings(drafter=str(tmp_path / "none")), error)


def test_train_command_exits_with_the_message(tmp_path, monkeypatch):
    """Prevents a traceback (or a bare torch message) when a train step runs out of device memory."""
    import dflash_trainer.training.run as run_mod
    from dflash_trainer.cli.main import app

    def oom(cfg, console):
        raise torch.OutOfMemoryError(TORCH_OOM)

    monkeypatch.setattr(run_mod, "train", oom)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--out", str(out), "--device", "cpu", "--set", "data.seq_len=4096",
                                      "--set", "optim.rows_per_step=8", "--set", "target.feature_cache_gib=116"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "out of GPU memory in train" in text and "target.feature_cache_gib from 116 to 112" in text
    assert "optim.rows_per_step from 8 to 7" in text and "Traceback" not in text
    assert not out.exists()  # a start that fails leaves no run folder


def test_recipe_names_its_own_flag_for_a_stage_out_of_memory():
    """Prevents a recipe whose regenerate or eval stage ran out of memory from advising only that command's
    --batch-size / --dtype, which `recipe` does not take, or a --gpu-memory-gib that plans the same batch (both
    are powers of two). Hand-worked with SmolLM2's plan at 78.66 GiB: 1,024 regeneration rows need 45 MiB
    each in 75 % of the card less 2 GiB and the 0.2505 GiB of weights: 45 GiB ≤ 0.75 · G − 2.2505 from G = 64
    (63 leaves 44.9995), so 63 plans 512; the fp32 eval's 256 turns of 102 MiB in half the card: down to G = 51, so 50 plans 128. A 1.5 GiB
    shortfall (2.00 GiB asked, 512 MiB free) is below either step."""
    from dflash_trainer.recipe.oom import recipe_oom_advice
    from dflash_trainer.recipe.plan import MIXTURE_SMOLLM2, SMOLLM2_135M, make_plan

    def batch_at(field):
        return lambda gib: getattr(make_plan(gib, SMOLLM2_135M, MIXTURE_SMOLLM2), field)

    torch_text = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                  "512.00 MiB is free.")
    regen = "regenerate: out of GPU memory in regenerate: ... (torch: " + torch_text
    advice = recipe_oom_advice("regenerate", regen, 78.66, batch_at("regen_batch_rows"))
    assert "--gpu-memory-gib 63, which plans regeneration rows 1,024 → 512" in advice
    ev = "eval: out of GPU memory in eval: ... (torch: " + torch_text
    assert "--gpu-memory-gib 50, which plans eval batch 256 → 128" in recipe_oom_advice("eval", ev, 78.66,
                                                                                       batch_at("eval_batch"))
    # a shortfall past the first step: 40 GiB asked, none free → 40 / 0.75 = 53.3 GiB less → from 25 GiB down
    big = "out of GPU memory in regenerate (Tried to allocate 40.00 GiB ... of which 0 B is free)"
    assert "--gpu-memory-gib 25, which plans regeneration rows 1,024 → 256" in recipe_oom_advice(
        "regenerate", big, 78.66, batch_at("regen_batch_rows"))
    assert recipe_oom_advice("train", regen, 78.66, batch_at("eval_batch")) is None  # train names --set flags
    assert recipe_oom_advice("eval", "some other error", 78.66, batch_at("eval_batch")) is None
    assert recipe_oom_advice("eval", ev, None, batch_at("eval_batch")) is None  # a CPU plan
    assert recipe_oom_advice("eval", ev, 78.66, lambda gib: 1) is None  # nothing smaller to plan
