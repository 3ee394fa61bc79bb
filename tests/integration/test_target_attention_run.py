"""The `target_attention` setting reaches the co-located run: a CPU run with the flex target path
trains exactly like one with the SDPA path (fp32), and the setting lands in the resolved config."""

import json

from tests.integration.tiny_run import make_prepared, make_target, train_here


def _losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_flex_and_sdpa_target_paths_train_alike(tmp_path):
    """Prevents the switch from being ignored (or the flex path feeding other features): the same
    4 steps give the same losses to 1e-4 relative with either target path (rows of 2 documents)."""
    target, prepared = make_target(tmp_path / "target"), make_prepared(tmp_path / "prepared")
    runs = {}
    for path in ("sdpa", "flex"):
        out = tmp_path / path
        result, text = train_here(out, target, prepared, f"target.target_attention={path}", max_steps=4)
        assert result.steps == 4
        assert f"target attention: {path} (target_attention={path})" in text
        runs[path] = _losses(out)
        assert json.loads((out / "train_config.json").read_text())["target"]["target_attention"] == path
    assert [s for s, _ in runs["flex"]] == [s for s, _ in runs["sdpa"]] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(runs["flex"], runs["sdpa"]):
        assert abs(a - b) <= 1e-4 * abs(b), (a, b)
