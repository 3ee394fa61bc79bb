"""FP8 matmuls for the drafter's trainable linears (setting `fp8`; off by default).

`fp8=rowwise | tensorwise` swaps the drafter's own `nn.Linear`s for torchao's float8 training
linears (`torchao.float8.convert_to_float8_training`, recipe of the same name): each matmul of the
forward and of the backward casts its two operands to float8 (e4m3) with dynamic scales computed
per call — rowwise: one scale per row of each operand, rounded down to a power of 2 (CUTLASS rowwise
kernel); tensorwise: one scale per tensor (cuBLAS) — and runs `torch._scaled_mm`, accumulating and
returning in the input's precision (bf16 under the drafter's autocast).

Which linears: every one of the drafter's decoder layers (q/k/v/o projections, MLP gate/up/down) and
`fc` (k·H → H), when both of its dims are multiples of 16 (an FP8 GEMM requirement); the others are
left in bf16 and named (`Fp8Plan.skipped`). The embedding and the LM head are the target's frozen
modules, held outside the drafter's module tree (drafter/model.py): they are never converted.

What does not change: the weights stay the same high-precision parameters (fp32 master weights; the
converted module takes over the original `Parameter` object), so `state_dict()` keys, shapes and
dtypes, the optimizer's parameter list, checkpoints, resume and exports are exactly those of a bf16
run. Only the matmuls' arithmetic differs. Measured τ during training and `eval` run a bf16 copy
(as serving does); validation at the end of the run runs the drafter as it trained (FP8 matmuls).

Needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) and torchao (the
`fp8` extra: `pip install 'dflash-trainer[fp8]'`, or its wheel). Convert before compiling: the
compiled layers then fuse the casts and scale computations around the FP8 GEMMs (and, for `fc`,
drop the input gradient torchao's backward computes for an input that needs none).

Importing this module imports neither torch nor torchao (the CLI's preflight uses its checks).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

FP8_RECIPES = ("rowwise", "tensorwise")
TORCHAO_PIN = "torchao==0.18.0"
INSTALL_HINT = (f"install torchao: pip install 'dflash-trainer[fp8]' (or {TORCHAO_PIN}; on a host without a "
                "package registry, its wheel: pip install --no-deps torchao-0.18.0-*.whl)")
MIN_CAPABILITY = (8, 9)
FP8_ALIGN = 16  # both dims of an FP8 GEMM operand must be multiples of 16


def torchao_missing_message(setting: str) -> str:
    """The one line a run with `fp8=setting` prints when torchao cannot be imported."""
    return f"fp8={setting} needs torchao, which is not installed: {INSTALL_HINT}; or --set fp8=off"


def check_fp8_setting(setting: str) -> None:
    """Raise ValueError for an unknown recipe name (the config's Literal already refuses one)."""
    if setting != "off" and setting not in FP8_RECIPES:
        raise ValueError(f"fp8={setting!r}: use off | {' | '.join(FP8_RECIPES)}")


def torchao_installed() -> bool:
    """True when torchao can be found, without importing it (or torch's heavier parts)."""
    return importlib.util.find_spec("torchao") is not None


def check_fp8(setting: str, device: torch.device) -> None:
    """Raise ValueError naming the field and the fix unless `fp8=setting` can run on `device`: a CUDA
    device of compute capability ≥ 8.9 and torchao importable. Nothing to check for `off`."""
    check_fp8_setting(setting)
    if setting == "off":
        return
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"fp8={setting} needs a CUDA GPU of compute capability 8.9 or newer (FP8 matmuls: Ada, "
                         f"Hopper, Blackwell); this drafter trains on {device}: use --set fp8=off")
    if not torch.cuda.is_available():
        raise ValueError(f"fp8={setting} needs a CUDA GPU, and none is visible: use --set fp8=off")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        raise ValueError(f"fp8={setting} needs a GPU of compute capability 8.9 or newer (FP8 matmuls); "
                         f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: use --set fp8=off")
    require_torchao(setting)


def require_torchao(setting: str) -> None:
    """Raise ValueError (one line: what to install) unless torchao's float8 training imports."""
    if not torchao_installed():
        raise ValueError(torchao_missing_message(setting))
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # noqa: BLE001 - installed but broken (e.g. built for another torch): say so in one line
        raise ValueError(f"fp8={setting}: torchao is installed but its float8 training does not import "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); {TORCHAO_PIN} needs torch >= 2.11; "
                         "or --set fp8=off") from None


@dataclass
class Fp8Plan:
    """Which of the drafter's linears convert: `convert` (module names), `skipped` ((name, (out, in))
    of those whose dims are not multiples of 16)."""

    convert: list[str] = field(default_factory=list)
    skipped: list[tuple[str, tuple[int, int]]] = field(default_factory=list)

    def line(self, setting: str) -> str:
        """One line for the run's log: the recipe, how many linears convert, which stay bf16 and why."""
        head = (f"fp8: {setting} scales, {len(self.convert)} linears in FP8 (decoder projections and fc; "
                "embedding and LM head stay bf16)")
        if not self.skipped:
            return head
        names = ", ".join(f"{n} {o}×{i}" for n, (o, i) in self.skipped[:8])
        more = f" and {len(self.skipped) - 8} more" if len(self.skipped) > 8 else ""
        return f"{head}; kept in bf16 (a dim not a multiple of {FP8_ALIGN}): {names}{more}"


def _is_drafter_linear(name: str) -> bool:
    """The drafter's trainable linears: `fc` and every linear of its decoder layers."""
    return name == "fc" or name.startswith("layers.")


def fp8_plan(drafter: nn.Module) -> Fp8Plan:
    """Which linears of `drafter` `convert_fp8` converts (see the module docstring)."""
    from torch import nn

    plan = Fp8Plan()
    for name, m in drafter.named_modules():
        if type(m) is not nn.Linear or not _is_drafter_linear(name):  # already converted ones are subclasses
            continue
        out_f, in_f = m.weight.shape
        if out_f % FP8_ALIGN or in_f % FP8_ALIGN:
            plan.skipped.append((name, (int(out_f), int(in_f))))
        else:
            plan.convert.append(name)
    return plan


def float8_config(setting: str, *, emulate: bool = False) -> Any:
    """torchao's Float8LinearConfig of the recipe `setting`; `emulate` runs the GEMMs as fp32 matmuls
    of the float8 values (any device; for tests on the CPU, never for speed)."""
    check_fp8_setting(setting)
    require_torchao(setting)
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(setting)
    return dataclasses.replace(config, emulate=True) if emulate else config


def convert_fp8(drafter: nn.Module, setting: str, *, emulate: bool = False) -> Fp8Plan:
    """Swap the linears of `fp8_plan(drafter)` for float8 training linears of recipe `setting`, in
    place (before compiling and before the optimizer is built; the parameters stay the same objects);
    returns the plan. `setting="off"` converts nothing. The device checks are `check_fp8`'s (not
    repeated here, so that `emulate` can run on the CPU)."""
    check_fp8_setting(setting)
    if setting == "off":
        return Fp8Plan()
    plan = fp8_plan(drafter)
    config = float8_config(setting, emulate=emulate)
    from torchao.float8 import convert_to_float8_training

    chosen = frozenset(plan.convert)
    convert_to_float8_training(drafter, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    return plan


def fp8_linears(drafter: nn.Module) -> list[str]:
    """Names of the drafter's modules that are float8 training linears (empty when none or without torchao)."""
    if not torchao_installed():
        return []
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, m in drafter.named_modules() if isinstance(m, Float8Linear)]
