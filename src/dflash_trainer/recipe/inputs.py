"""The recipe's inputs, read without torch: the target's shape (recipe/memory.py's TargetShape), the chat
data's size (DataSize) and the packaged default prompt mixture (configs/mixture-smollm2.yaml's copy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from dflash_trainer.recipe.memory import TargetShape
from dflash_trainer.recipe.plan import (ANSWER_TOKENS_PER_TURN, MIXTURE_SMOLLM2, MIXTURE_SMOLLM2_LARGE, SMOLLM2_135M,
                                        TEMPLATE_TOKENS_PER_TURN, DataSize)

# The spec of configs/mixture-smollm2.yaml (the file is not installed with the package): written to
# RUN/mixture.yaml when neither --spec nor --data is given.
DEFAULT_MIXTURE = """\
# configs/mixture-smollm2.yaml's prompt mixture (written by `dflash-train recipe`)
seed: 0
dedupe: true
sources:
  - name: sharegpt
    count: null
  - name: math
    count: 28000
    options:
      workers: 2
  - name: chitchat
    count: null
    options:
      max_user_turns: 8
  - name: code
    count: null
    options:
      packages: [stdlib, numpy, scipy, sympy, pandas, networkx, matplotlib, torch, transformers,
                 mpmath, jinja2, pygments, rich, requests, werkzeug, PIL, fontTools]
"""

EMBEDDED_NAMES = (None, "", "smollm2-135m")
FOLDER_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")  # the weight files of an HF model folder


def shape_from_config(cfg: dict[str, Any], k: int) -> TargetShape:
    """The shape of a target from its config (a text_config's when it has one). Raises ValueError naming the
    fields a config lacks (an architecture the families of docs/targets.md do not include, e.g. GPT-2's n_embd)."""
    text = cfg.get("text_config") or cfg
    missing = [f for f in ("hidden_size", "num_hidden_layers", "vocab_size") if f not in text]
    if missing:
        raise ValueError(f"the target's config (model_type {text.get('model_type')!r}) has no {', '.join(missing)}: "
                         f"not one of the decoder families a target can be (docs/targets.md); `dflash-train "
                         f"init-config --target ...` says why")
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    heads = int(text.get("num_attention_heads", 1))
    kv = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    vocab = int(text["vocab_size"])
    inter = int(text.get("intermediate_size") or 4 * hidden)
    params = vocab * hidden * (1 if text.get("tie_word_embeddings", True) else 2) + layers * (
        hidden * (heads * head_dim) * 2 + hidden * kv * head_dim * 2 + 3 * hidden * inter)
    return TargetShape(hidden, layers, kv, head_dim, vocab, float(params), k)


def target_shape(target: Optional[str], k: int = 5) -> TargetShape:
    """The shape of a target: the embedded SmolLM2 (None or its name) from its known numbers, an HF folder
    from its config.json, anything else (a .gguf, another packaged name) through transformers'
    AutoConfig (no weights read). Raises FileNotFoundError / ValueError as the target's resolver does."""
    if target in EMBEDDED_NAMES:
        return TargetShape(**{**SMOLLM2_135M.__dict__, "k": k})
    p = Path(str(target))
    if p.is_dir() and (p / "config.json").is_file():
        return shape_from_config(json.loads((p / "config.json").read_text()), k)
    from transformers import AutoConfig

    from dflash_trainer.target_model.paths import resolve_target_path

    folder, gguf = resolve_target_path(target)
    cfg = AutoConfig.from_pretrained(str(folder), **({"gguf_file": gguf} if gguf else {}))
    return shape_from_config(cfg.to_dict(), k)


def _text_bytes(content: Any) -> int:
    """UTF-8 bytes of a message's content: a string, or OpenAI's list of parts ({"text": ...})."""
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, list):
        return sum(_text_bytes(part.get("text") if isinstance(part, dict) else part) for part in content)
    return 0


def _records(text: str) -> Optional[list[Any]]:
    """The records of a JSON array or JSONL text; a JSONL line that does not parse is left out (regenerate
    skips it too, counted); None when nothing parses."""
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            return None
    records = []
    for line in text.split("\n"):  # not splitlines(): U+2028 and other separators may sit inside a JSON string
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records or None


# The measured sizes of the shipped specs, by MixtureSpec.build_sha256() (what decides the built records: a
# copy of a shipped spec under another name, or with other weights, is the same build). A change of the
# specs or of the eval-leak rules changes the digests; tests/unit/test_recipe_plan.py checks them.
KNOWN_MIXTURES = {
    "5a1ce96618b3930e8706e2fa0a1ca8f6dea7e5943269733e68ed7c0066469d60": MIXTURE_SMOLLM2,  # configs/mixture-smollm2.yaml
    "7da73b8629e3ce0d55c2e5c4af8ea1dd21a04f0c701e221b0336a4812892c2ad": MIXTURE_SMOLLM2_LARGE,  # ...-large.yaml
}


def spec_data_size(spec: Optional[str]) -> tuple[DataSize, Optional[str]]:
    """The data size the plan takes for `--spec` (None: the packaged mixture) and a warning, or None: a shipped
    spec's measured size (KNOWN_MIXTURES; before its weights, which prepare applies: a weight-0 source is planned
    as if kept); for any other spec the packaged mixture's, with a warning that says so and how to plan on the
    real size (the size of a spec is known only once it is built, and the plan must not change between a run
    and its rerun). Raises FileNotFoundError / ValueError for a missing or bad spec."""
    if spec is None:
        return MIXTURE_SMOLLM2, None
    from dflash_trainer.data.mixture.spec import load_spec

    size = KNOWN_MIXTURES.get(load_spec(spec).build_sha256())
    if size is not None:
        return size, None
    return MIXTURE_SMOLLM2, (f"--spec {spec} is not a shipped mixture, so the plan sizes its data as the packaged "
                             f"mixture's ({MIXTURE_SMOLLM2.conversations:,} conversations, {MIXTURE_SMOLLM2.turns:,} "
                             f"user turns): the regeneration's estimate and time cap, the feature cache and the "
                             f"steps for small data follow that. To plan on its own size: `recipe --spec {spec} "
                             f"--until mixture --out RUN`, then `recipe --data RUN/prompts.jsonl --out RUN2` "
                             f"(which applies no source weights: they need the spec)")


def data_size(chats: Optional[str]) -> DataSize:
    """The size of a chat file (JSONL or a JSON array) after the recipe's regeneration, or of the default
    mixture (None: its last full build's counts). Conversations and user turns are counted; tokens are
    estimated as the target will write them: the prompts' text (every message but the assistant's, which
    the regeneration replaces) at 4 bytes a token, plus ANSWER_TOKENS_PER_TURN answer and
    TEMPLATE_TOKENS_PER_TURN chat-template tokens a user turn (the mixture's measured means). JSONL lines
    that do not parse are left out; a file of which nothing parses counts its lines as records and all its
    bytes as prompt text. Raises FileNotFoundError for a missing file."""
    if chats is None:
        return MIXTURE_SMOLLM2
    p = Path(chats)
    if not p.is_file():
        raise FileNotFoundError(f"--data {p}: file not found")
    text = p.read_text(encoding="utf-8", errors="replace")
    records, prompt_bytes = _records(text), 0
    if records is None:  # nothing parses: every line a record, every byte prompt text
        records, prompt_bytes = [None] * max(1, text.count("\n")), len(text.encode())
    turns = 0
    for r in records:
        msgs = (r.get("conversations") or r.get("messages") or []) if isinstance(r, dict) else []
        for m in msgs:
            if not isinstance(m, dict):
                continue
            role = m.get("from") or m.get("role")
            turns += role in ("human", "user")
            if role not in ("gpt", "assistant"):
                prompt_bytes += _text_bytes(m.get("value", m.get("content")))
    turns = max(turns, len(records))
    tokens = prompt_bytes // 4 + turns * (ANSWER_TOKENS_PER_TURN + TEMPLATE_TOKENS_PER_TURN)
    return DataSize(conversations=len(records), turns=turns, tokens=tokens, estimated=True)


def check_target_layers(num_layers: int, k: int, layer_ids: Optional[list[int]]) -> None:
    """Raise ValueError now, not in the train stage, when the drafter's target layers do not fit a target of
    `num_layers` decoder layers: `layer_ids` (the train config's drafter.target_layer_ids) by the id rules, else
    the DFlash rule for k features (a shallow target; the message names the settings that fit)."""
    from dflash_trainer.config.sections import check_layer_ids
    from dflash_trainer.target_model.layers import default_target_layer_ids

    try:
        if layer_ids:
            check_layer_ids(layer_ids, num_layers)
        else:
            default_target_layer_ids(num_layers, k)
    except ValueError as e:
        raise ValueError(f"the train stage would refuse the drafter's target layers: {e}") from None


def check_target_weights(target: Optional[str]) -> None:
    """Raise FileNotFoundError when an HF model folder target holds no weight file (*.safetensors, *.bin, *.pt):
    the regeneration would fail on it after the mixture. Names and GGUF files are left to the target's loader."""
    if target in EMBEDDED_NAMES:
        return
    p = Path(str(target)).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        if not any(f.suffix in FOLDER_WEIGHT_SUFFIXES for f in p.iterdir() if f.is_file()):
            raise FileNotFoundError(f"--target {target}: the folder holds config.json but no weights (*.safetensors, "
                                    f"*.bin, *.pt); copy the model's weight files into it")


def verifier_warning(target: Optional[str], verifier: Optional[str]) -> list[str]:
    """A plan warning (one line, else none) when the exports could not name the target as a serving engine on
    another machine finds it: no --verifier, and export's rule (interop/verifier.py `verifier_name`: the hub id
    the target's files give, else --target itself when it reads as a hub id, e.g. a local folder Org/Name)
    falls back to the folder's name. A target that cannot be read is left to the checks that refuse it."""
    if verifier or target in EMBEDDED_NAMES:
        return []
    from dflash_trainer.interop.verifier import target_verifier_facts, verifier_name

    try:
        facts = target_verifier_facts(target)
    except Exception:  # an unreadable target: the preflight and the stages say what is wrong with it
        return []
    name, warning = verifier_name(None, facts, target, target)
    if warning is None:
        return []
    return [f"the target's files do not say its hub id, so the speculators export names it {name!r}, and "
            f"`vllm serve EXPORT` on another machine would look for that; pass --verifier HUB_ID (or the path "
            f"where the target is served)"]
