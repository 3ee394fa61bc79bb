"""Interop with serving engines: drafter configs from a target (config_from_target.py), export to the zlab
and speculators formats (export.py, formats.py), and loading any drafter folder back
(load_drafter.py); docs/formats.md. Nothing is imported here, so the torch-free `formats.py` stays
cheap to import."""
