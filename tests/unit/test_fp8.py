"""The `fp8` setting on the CPU (drafter/fp8.py): the refusals (no CUDA, no torchao), which linears
convert, and that a converted drafter trains, saves, resumes and exports exactly like a bf16 one.

FP8 GEMMs need a GPU of compute capability 8.9+; here torchao's emulation (fp32 matmuls of the
float8 values, `emulate=True`) runs the converted modules, so the conversion path, the gradients
and the checkpoint/export keys are checked on the CPU. The tests that need torchao skip without
it (`pip install '.[fp8]'`; `make test` installs it). tests/gpu/test_fp8_cuda.py runs the real
kernels.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.config.schema import TrainConfig, saved_config
from dflash_trainer.config.load import load_config
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter import build as drafter_build
from dflash_trainer.drafter import fp8
from dflash_trainer.training.checkpoint import check_resume_config
from dflash_trainer.interop.checkpoint_files import save_checkpoint
from dflash_trainer.training.optim import build_optimizer
from dflash_trainer.training.step import StepSettings, drafter_step

V, H, T = 64, 32, 48
ALL_LINEARS = ["fc"] + [f"layers.{i}.{m}" for i in range(2) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]

needs_torchao = pytest.mark.skipif(not fp8.torchao_installed(), reason="torchao not installed (pip install '.[fp8]')")


def tiny_config(**kw) -> DrafterConfig:
    """Every linear's dims are multiples of 16 (H 32, MLP 64, q 4×8, kv 2×8, fc 2·32 → 32)."""
    base = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=V, block_size=4, mask_token_id=V - 1, target_layer_ids=[0, 1],
                num_target_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    return DrafterConfig(**{**base, **kw})


def tiny_drafter(cfg: DrafterConfig | None = None, seed: int = 0) -> DFlashDrafter:
    """Random weights from `seed`; the target's embedding and LM head the same for every seed."""
    cfg = cfg or tiny_config()
    g = torch.Generator().manual_seed(seed)
    emb, head = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size), torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(emb.weight.shape, generator=torch.Generator().manual_seed(100)))
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(101)) * 0.3)
    drafter = DFlashDrafter(cfg, emb, head)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return drafter


def step_inputs(seed: int = 5):
    """One packed row of two documents (T = 48), random features [1,T,2H] and labels [1,T]."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(24), torch.arange(24)])[None]
    rows = {"input_ids": torch.randint(0, V - 1, (1, T), generator=g), "position_ids": pos, "loss_mask": pos >= 3}
    return rows, torch.randn(1, T, 2 * H, generator=g), torch.randint(0, V - 1, (1, T), generator=g)


def loss_and_grads(drafter: DFlashDrafter) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    rows, feats, argmax = step_inputs()
    sums = drafter_step(drafter, rows, feats, argmax, StepSettings(num_anchors=8, gamma=2.0),
                        torch.Generator().manual_seed(3), None)
    loss = sums.loss_sum / sums.weight_sum
    drafter.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}


# ---------------------------------------------------------------------------------------------
# The setting and its refusals (no torchao needed)


def test_fp8_is_off_by_default_and_takes_only_known_recipes():
    """Prevents FP8 turning on before it is measured, and a typo running bf16 silently."""
    assert TrainConfig().experimental.fp8 == "off"
    assert load_config(None, None, ["fp8=rowwise"]).experimental.fp8 == "rowwise"
    with pytest.raises(ValueError, match="fp8"):
        load_config(None, None, ["fp8=fp16"])


@pytest.mark.parametrize("sets", [["device=cpu"], ["drafter_procs=1", "target_procs=1"], ["procs=2"]])
def test_fp8_on_a_cpu_run_is_refused_naming_the_field_and_the_fix(sets):
    """Prevents a CPU run accepting fp8 and failing later inside torch._scaled_mm (or training in fp32 unawares)."""
    with pytest.raises(ValueError, match=r"fp8=rowwise needs a CUDA GPU of compute capability 8\.9.*fp8=off"):
        load_config(None, None, sets + ["fp8=rowwise"])
    assert load_config(None, None, sets + ["fp8=off"]).experimental.fp8 == "off"


def test_check_fp8_refuses_a_cpu_device_and_passes_off():
    """Prevents the runtime check (device=auto resolved to the CPU, a rank's device) letting fp8 through."""
    fp8.check_fp8("off", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"fp8=tensorwise needs a CUDA GPU.*trains on cpu: use --set fp8=off"):
        fp8.check_fp8("tensorwise", torch.device("cpu"))


def test_build_drafter_refuses_fp8_on_the_cpu_before_building():
    """Prevents a caller that skips the CLI (split probe, ranks, benchmarks) converting on the CPU."""
    cfg = TrainConfig(fp8="rowwise")  # device=auto passes the config; the device it resolves to is checked
    head = (torch.randn(V, H), torch.randn(V, H))
    with pytest.raises(ValueError, match="fp8=rowwise needs a CUDA GPU"):
        drafter_build.build_drafter(cfg, tiny_config(), head, torch.device("cpu"))


def test_missing_torchao_is_one_line_naming_the_extra(monkeypatch):
    """Prevents an ImportError traceback: without torchao the run says what to install, in one line."""
    monkeypatch.setattr(fp8, "torchao_installed", lambda: False)
    with pytest.raises(ValueError) as e:
        fp8.require_torchao("rowwise")
    msg = str(e.value)
    assert "\n" not in msg and "dflash-trainer[fp8]" in msg and fp8.TORCHAO_PIN in msg and "fp8=off" in msg
    from dflash_trainer.preflight import checks as preflight

    monkeypatch.setattr(preflight, "cuda_ruled_out", lambda: False)
    with pytest.raises(ValueError, match=r"needs torchao.*dflash-trainer\[fp8\]"):
        preflight.check_fp8_available("rowwise")
    preflight.check_fp8_available("off")


def test_train_cli_refuses_fp8_on_cpu_in_one_line(tmp_path):
    """Prevents `train --set fp8=…` on a CPU run starting (or leaving a run folder) before it is refused."""
    r = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), "--device", "cpu", "--set", "fp8=rowwise"])
    assert r.exit_code == 2, r.output
    assert "fp8=rowwise needs a CUDA GPU" in " ".join(r.output.split())
    assert not (tmp_path / "run").exists()


def test_bench_step_refuses_an_unknown_recipe_before_looking_for_a_gpu():
    r = CliRunner().invoke(app, ["bench", "step", "--fp8", "fp16"])
    assert r.exit_code == 2 and "use off | rowwise | tensorwise" in " ".join(r.output.split()), r.output


def test_resume_with_another_fp8_setting_is_refused_and_an_older_checkpoint_resumes():
    """Prevents a resume silently switching the matmul precision mid-run; a checkpoint written before
    the setting existed (no `fp8` in its config) resumes as the bf16 run it was."""
    saved = saved_config(TrainConfig())
    with pytest.raises(ValueError, match=r"experimental.fp8: 'off' → 'rowwise'"):
        check_resume_config(saved, TrainConfig().updated({"fp8": "rowwise"}).model_dump(), "ck")
    older = {**saved, "experimental": {k: v for k, v in saved["experimental"].items() if k != "fp8"}}
    check_resume_config(older, saved, "ck")


# ---------------------------------------------------------------------------------------------
# Which linears convert (no torchao needed)


def test_plan_is_every_decoder_projection_and_fc_never_the_target_head():
    """Prevents the LM head or the embedding (the target's frozen weights) being converted, and a
    projection being left out."""
    d = tiny_drafter()
    plan = fp8.fp8_plan(d)
    assert sorted(plan.convert) == sorted(ALL_LINEARS) and plan.skipped == []
    assert all(not n.startswith(("embed", "lm_head")) for n, _ in d.named_modules())  # held outside the tree


def test_plan_keeps_linears_whose_dims_are_not_multiples_of_16_and_names_them():
    """Prevents torch._scaled_mm failing on a misaligned shape: head_dim 12 makes q 48 (kept in FP8)
    but k/v 24 wide; H 48 → fc 96→48 (FP8)."""
    cfg = tiny_config(hidden_size=48, head_dim=12, intermediate_size=64)
    plan = fp8.fp8_plan(tiny_drafter(cfg))
    skipped = {n for n, _ in plan.skipped}
    assert skipped == {f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "v_proj")}
    assert "fc" in plan.convert and "layers.0.self_attn.q_proj" in plan.convert
    line = plan.line("rowwise")
    assert "layers.0.self_attn.k_proj 24×48" in line and "kept in bf16" in line


# ---------------------------------------------------------------------------------------------
# The conversion, emulated on the CPU (needs torchao)


@needs_torchao
@pytest.mark.parametrize("recipe", fp8.FP8_RECIPES)
def test_conversion_swaps_exactly_the_plan_and_keeps_parameters_and_state_dict(recipe):
    """Prevents a conversion that re-creates parameters (the optimizer would train stale ones) or
    changes the saved keys/dtypes (checkpoints, resume and exports read them)."""
    from torchao.float8.float8_linear import Float8Linear

    cfg = tiny_config(hidden_size=48, head_dim=12)
    d = tiny_drafter(cfg)
    params = [(n, id(p)) for n, p in d.named_parameters()]
    before = {k: (v.dtype, tuple(v.shape), v.clone()) for k, v in d.state_dict().items()}
    plan = fp8.convert_fp8(d, recipe, emulate=True)
    converted = {n for n, m in d.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(plan.convert) and set(fp8.fp8_linears(d)) == converted
    assert all(type(d.get_submodule(n)) is torch.nn.Linear for n, _ in plan.skipped)
    assert [(n, id(p)) for n, p in d.named_parameters()] == params
    after = d.trainable_state_dict()
    assert list(after) == list(before)
    for k, v in after.items():
        assert (v.dtype, tuple(v.shape)) == before[k][:2] and torch.equal(v, before[k][2]), k
    assert type(d.fc.weight) is torch.nn.Parameter and d.fc.weight.dtype == torch.float32


@needs_torchao
@pytest.mark.parametrize("recipe", fp8.FP8_RECIPES)
def test_emulated_fp8_step_tracks_the_fp32_step(recipe):
    """Prevents FP8 wiring that trains something else: on the same weights and batch the loss is
    within 2 % of the fp32 one, every gradient is finite, nonzero where the fp32 one is, and points
    the same way (cosine > 0.9 over all parameters; FP8 rounds each GEMM operand to 3 mantissa bits)."""
    ref = tiny_drafter()
    d = tiny_drafter()
    fp8.convert_fp8(d, recipe, emulate=True)
    l_ref, g_ref = loss_and_grads(ref)
    l8, g8 = loss_and_grads(d)
    assert torch.isfinite(l8) and abs(float(l8) - float(l_ref)) <= 0.02 * float(l_ref), (float(l8), float(l_ref))
    for n in g_ref:
        assert torch.isfinite(g8[n]).all(), n
        assert g8[n].abs().sum() > 0 or g_ref[n].abs().sum() == 0, n
    a = torch.cat([g.flatten() for g in g_ref.values()])
    b = torch.cat([g8[n].flatten() for n in g_ref])
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.9
    opt = build_optimizer([p for p in d.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    w0 = d.fc.weight.detach().clone()
    opt.step()
    assert not torch.equal(d.fc.weight, w0)  # the optimizer holds the converted module's parameter


@needs_torchao
def test_prepare_for_training_converts_before_it_compiles(monkeypatch):
    """Prevents compiling the bf16 linears and converting afterwards (the compiled graphs would keep
    the bf16 matmuls, or recompile): compile_layers sees FP8 linears, and fc is compiled with FP8."""
    from torchao.float8.float8_linear import Float8Linear

    d = tiny_drafter()
    seen = []
    monkeypatch.setattr(drafter_build, "convert_fp8", lambda m, s: fp8.convert_fp8(m, s, emulate=True))
    monkeypatch.setattr(d, "compile_layers", lambda: seen.append(
        ("layers", isinstance(d.layers[0].self_attn.q_proj, Float8Linear))))
    monkeypatch.setattr(Float8Linear, "compile", lambda self, **kw: seen.append(("fc", self is d.fc, kw)))
    lines = []
    drafter_build.prepare_for_training(d, "rowwise", compile_layers=True, log=lines.append)
    assert seen == [("layers", True), ("fc", True, {"dynamic": False})]
    assert lines and lines[0].startswith("fp8: rowwise scales, 15 linears in FP8")
    plain = tiny_drafter()
    seen.clear()
    monkeypatch.setattr(plain, "compile_layers", lambda: seen.append("layers"))
    monkeypatch.setattr(plain.fc, "compile", lambda **kw: seen.append("fc"))
    drafter_build.prepare_for_training(plain, "off", compile_layers=True)
    assert seen == ["layers"] and fp8.fp8_linears(plain) == []  # bf16 runs compile as before


@needs_torchao
def test_checkpoint_and_export_of_a_converted_drafter_match_the_bf16_ones(tmp_path):
    """Prevents FP8 leaking into what vLLM/SGLang read: the checkpoint and both exports of a converted
    drafter (after a training step) hold the same keys, shapes and dtypes as those of a plain drafter,
    and load back into a plain drafter with the converted one's weights."""
    from dflash_trainer.interop.export import write_export
    from dflash_trainer.interop.load_drafter import load_drafter

    meta = {"target": "tiny-target", "chat_template": None, "mask_token_reason": "given", "step": 1}
    d8 = tiny_drafter()
    fp8.convert_fp8(d8, "rowwise", emulate=True)
    loss_and_grads(d8)
    build_optimizer([p for p in d8.parameters()], lr=1e-3, weight_decay=0.0).step()
    plain = tiny_drafter(seed=1)

    def layout(folder):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}

    for name, model in (("fp8", d8), ("plain", plain)):
        ck = save_checkpoint(tmp_path / name / "checkpoint", model.trainable_state_dict(), model.config, meta)
        for fmt in ("zlab", "speculators"):
            dc, weights, m = load_drafter(ck)
            write_export(tmp_path / name / fmt, fmt, dc, weights, m)
    for sub in ("checkpoint", "zlab", "speculators"):
        assert layout(tmp_path / "fp8" / sub) == layout(tmp_path / "plain" / sub), sub
    assert {dt for dt, _ in layout(tmp_path / "fp8" / "checkpoint").values()} == {"F32"}
    for sub in ("checkpoint", "zlab"):
        dc, weights, _ = load_drafter(tmp_path / "fp8" / sub)
        back = DFlashDrafter(dc, d8.embed_tokens, d8.lm_head)
        back.load_trainable_state_dict(weights)
        assert all(torch.equal(v, back.state_dict()[k]) for k, v in d8.trainable_state_dict().items()), sub
    for fmt in ("zlab", "speculators"):  # nothing tells an engine to quantize
        assert "quantization_config" not in json.loads((tmp_path / "fp8" / fmt / "config.json").read_text())


def test_a_bare_off_in_yaml_means_off(tmp_path):
    """Prevents `--set fp8=off` / `fp8: off` failing: YAML reads a bare off as false."""
    assert load_config(None, None, ["fp8=off"]).experimental.fp8 == "off"
    f = tmp_path / "c.yaml"
    f.write_text("fp8: off\n")
    assert load_config(str(f)).experimental.fp8 == "off"
    with pytest.raises(ValueError, match="fp8"):
        load_config(None, None, ["fp8=true"])
