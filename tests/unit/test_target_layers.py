"""The DFlash target-layer rule and the validation of explicit target_layer_ids."""

from __future__ import annotations

import pytest

from dflash_trainer.config.sections import check_layer_ids
from dflash_trainer.target_model.layers import default_target_layer_ids


@pytest.mark.parametrize(
    ("num_layers", "k", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B, the paper's reference
        (30, 5, [1, 8, 14, 20, 27]),  # SmolLM2-135M: 7.5 → 8 and 20.5 → 20 (half to even)
        (28, 5, [1, 7, 13, 19, 25]),
        (24, 5, [1, 6, 11, 16, 21]),
        (40, 5, [1, 10, 19, 28, 37]),
        (64, 5, [1, 16, 31, 46, 61]),
        (36, 3, [1, 17, 33]),
        (30, 3, [1, 14, 27]),
        (8, 3, [1, 3, 5]),
        (12, 5, [1, 3, 5, 7, 9]),
        (7, 3, [1, 2, 4]),  # 2.5 → 2 (half to even)
        (6, 3, [1, 2, 3]),
        (36, 2, [1, 33]),
    ],
)
def test_default_rule_values(num_layers, k, expected):
    """The layer-id rule reproduces the published ids; a wrong rule feeds the drafter features the
    serving engine never sends."""
    assert default_target_layer_ids(num_layers, k) == expected


@pytest.mark.parametrize(("num_layers", "expected"), [(36, [18]), (30, [15]), (8, [4]), (3, [1]), (1, [0])])
def test_single_feature_is_middle_layer(num_layers, expected):
    """k = 1 takes the middle layer L // 2 (the general formula would divide by zero)."""
    assert default_target_layer_ids(num_layers, 1) == expected


def test_half_values_round_to_even():
    """Python's round (half to even) is what the reference ids need: round-half-up would turn the
    30-layer target's 20.5 into 21 and shift the fourth feature layer."""
    raw = [1 + i * (30 - 4) / 4 for i in range(5)]
    assert raw == [1.0, 7.5, 14.0, 20.5, 27.0]
    half_up = [int(x + 0.5) for x in raw]
    assert half_up == [1, 8, 14, 21, 27]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27] != half_up


@pytest.mark.parametrize(("num_layers", "k"), [(4, 2), (5, 3), (4, 5), (3, 2), (2, 2)])
def test_rule_refuses_too_many_features_for_shallow_targets(num_layers, k):
    """Repeated or out-of-range ids from the rule on shallow targets (L=4, k=2 gives [1, 1]) raise a
    ValueError with the fix instead of silently duplicating a feature block."""
    with pytest.raises(ValueError, match="target_layer_ids"):
        default_target_layer_ids(num_layers, k)


@pytest.mark.parametrize(("num_layers", "k"), [(0, 5), (36, 0), (36, -1)])
def test_rule_refuses_nonsense_sizes(num_layers, k):
    with pytest.raises(ValueError):
        default_target_layer_ids(num_layers, k)


def test_check_accepts_valid_ids():
    assert check_layer_ids([0, 5, 29], 30) == [0, 5, 29]
    assert check_layer_ids((1, 8, 14, 20, 27), 30) == [1, 8, 14, 20, 27]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], r"target_layer_ids=\[\]"),
        ([1, 30], r"outside \[0, 29\]"),
        ([-1, 3], r"outside \[0, 29\]"),
        ([8, 1], r"ascending order .* use \[1, 8\]"),
        ([1, 1, 8], r"ids \[1\] are duplicated .* use \[1, 8\]"),
        ([1, 2.0], "integers"),
        ([True, 3], "integers"),
    ],
)
def test_check_rejects_bad_ids(ids, message):
    """Ids beyond the last layer, negative ids (which Python indexing would silently accept),
    duplicates and unsorted lists (the concat order is part of the drafter's fc weights) are user
    errors naming target_layer_ids."""
    with pytest.raises(ValueError, match="target_layer_ids") as err:
        check_layer_ids(ids, 30)
    assert err.match(message)
