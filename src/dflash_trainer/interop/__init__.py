"""Interop with serving engines: drafter configs from a target, export to the zlab and speculators
formats, and loading any drafter folder back (docs/formats.md)."""

from dflash_trainer.interop.export import FORMATS, write_export
from dflash_trainer.interop.init_config import build_drafter_config
from dflash_trainer.interop.load_drafter import load_drafter

__all__ = ["FORMATS", "build_drafter_config", "load_drafter", "write_export"]
