"""Drafter folders on disk: checkpoint folders (checkpoint_files.py), what a folder is (formats.py),
export to the zlab and speculators formats (export.py, keymaps.py, verifier.py: the target's
portable name) and loading any drafter folder back (load_drafter.py); docs/formats.md. Drafter configs
from a target are drafter/shape.py's. Nothing is imported here, so the torch-free `formats.py` stays
cheap to import."""
