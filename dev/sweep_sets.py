"""Print a sweep variant's train settings as `--set` flags, one a line: python dev/sweep_sets.py SWEEP.yaml NAME.
The sweep file maps variant name → list of `section.field=value` (dev/sweep_smollm2.yaml). An unknown name
exits 2 naming the known ones."""

import sys

import yaml


def main() -> int:
    """Read the sweep file, print NAME's flags; exit 2 for an unknown name or a bad entry."""
    path, name = sys.argv[1], sys.argv[2]
    with open(path, encoding="utf-8") as f:
        sweep = yaml.safe_load(f) or {}
    if name not in sweep:
        print(f"variant {name!r} is not in {path}; known: {', '.join(sweep)}", file=sys.stderr)
        return 2
    sets = sweep[name] or []
    bad = [s for s in sets if not isinstance(s, str) or "=" not in s]
    if bad:
        print(f"{path}: variant {name!r}: {bad} are not section.field=value strings", file=sys.stderr)
        return 2
    for s in sets:
        print(f"--set\n{s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
