"""Which target layers feed the drafter (DFlash, arXiv 2602.06036 §4).

L = number of decoder layers of the target, k = number of target layers whose outputs are
concatenated into the drafter's context features.

Layer id ℓ means the OUTPUT of decoder layer ℓ (0-based), i.e. HF `hidden_states[ℓ + 1]`
(index 0 of `hidden_states` is the embedding output; z-lab/dflash `extract_context_feature`).
An off-by-one here trains the drafter on features the serving engine never sends.

The rule: ids = [round(1 + i·(L−4)/(k−1)) for i in range(k)], and [L // 2] for k = 1
(z-lab/dflash `model/utils.py` `build_target_layer_ids` @a3516f8c).

Rounding: Python's `round` rounds halves to the even integer ("banker's rounding"), and the
published ids need exactly that. For L = 30, k = 5 the raw values are 1, 7.5, 14, 20.5, 27:
round-half-even gives [1, 8, 14, 20, 27] (the reference list), round-half-up would give
[1, 8, 14, 21, 27]. The halves are exact in floating point (n + 0.5 is representable and IEEE
division is correctly rounded), so no epsilon is involved. Never replace `round` here with
`int(x + 0.5)` or `math.floor(x + 0.5)`.
"""

from __future__ import annotations


from dflash_trainer.config.sections import check_layer_ids


def default_target_layer_ids(num_layers: int, k: int) -> list[int]:
    """The DFlash layer-id rule for a target of `num_layers` decoder layers and k features.

    Returns k strictly increasing ids in [0, num_layers − 1]; Qwen3-8B (L=36, k=5) →
    [1, 9, 17, 25, 33], a 30-layer target (SmolLM2-135M) → [1, 8, 14, 20, 27].
    Raises ValueError when num_layers < 1 or k < 1, or when the rule gives repeated or
    out-of-range ids (too many features for a shallow target: e.g. L=4, k=2 gives [1, 1]).
    """
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers}: the target must have at least one decoder layer")
    if k < 1:
        raise ValueError(f"num_target_features={k}: must be at least 1")
    ids = _rule_ids(num_layers, k)
    try:
        check_layer_ids(ids, num_layers)
    except ValueError as err:
        fits = next(j for j in range(k - 1, 0, -1) if _rule_fits(num_layers, j))
        # ids spread over 0 … L − 2, as the rule keeps off the last layer (its output is the final norm's input)
        spread = sorted({round(i * max(num_layers - 2, 0) / (k - 1)) for i in range(k)})
        raise ValueError(f"num_target_features={k} does not fit a target of {num_layers} layers: the DFlash rule "
                         f"gives {ids} ({err}); set drafter.num_target_features={fits} (the most the rule fits here) "
                         f"or pass drafter.target_layer_ids explicitly, e.g. --set 'drafter.target_layer_ids={spread}'"
                         ) from None
    return ids


def _rule_ids(num_layers: int, k: int) -> list[int]:
    """The DFlash rule's ids as computed, valid or not (`default_target_layer_ids` checks them)."""
    if k == 1:
        return [num_layers // 2]
    # Python round = round half to even; required by the reference ids (module docstring).
    return [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]


def _rule_fits(num_layers: int, k: int) -> bool:
    """Whether the DFlash rule gives valid ids for k features of a num_layers-layer target (k = 1 always does)."""
    try:
        check_layer_ids(_rule_ids(num_layers, k), num_layers)
    except ValueError:
        return False
    return True
