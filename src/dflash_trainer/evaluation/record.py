"""The eval JSON's paths, portable (files/portable.py): the drafter, plots and output files inside
the JSON's folder relative to it (`checkpoint-final`, `eval.png`), targets by name (`smollm2-135m`)
or as given, a chat-file dataset as given. Torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trainer.files.portable import portable_path
from dflash_trainer.target_model.paths import recorded_target

_SETTING_PATHS = ("drafter", "dataset", "json_out", "plot_out")  # the settings that may hold a path
_RESULT_PATHS = ("plot", "speedup_plot")


def portable_record(result: dict[str, Any], json_out: str | None) -> dict[str, Any]:
    """A copy of eval's `result` as its JSON at `json_out` writes it: every path relative to the JSON's
    folder when inside it, else as given; `target` and `drafter.target_at_training` by their target
    names (`recorded_target`). The result returned to the caller keeps the paths as they are here."""
    folder = Path(json_out).parent if json_out else None
    body = dict(result)
    settings = dict(body.get("settings") or {})
    for key in _SETTING_PATHS:
        if settings.get(key) is not None:
            settings[key] = portable_path(settings[key], folder)
    if settings.get("target") is not None:
        settings["target"] = recorded_target(settings["target"])
    body["settings"] = settings
    for key in _RESULT_PATHS:
        if body.get(key) is not None:
            body[key] = portable_path(body[key], folder)
    if body.get("target") is not None:
        body["target"] = recorded_target(body["target"])
    if body.get("drafter") is not None:
        drafter = dict(body["drafter"])
        drafter["path"] = portable_path(drafter["path"], folder)
        if drafter.get("target_at_training") is not None:
            drafter["target_at_training"] = recorded_target(drafter["target_at_training"])
        body["drafter"] = drafter
    return body
