"""The mixture's one data spec: a YAML file → `MixtureSpec` (unknown keys fail, errors name the
field and the fix).

    seed: 0                 # order of the whole mixture and every seeded choice
    dedupe: true            # drop a record whose system + user turns repeat an earlier record's
    sources:
      - name: sharegpt      # sharegpt | math | chitchat | code | evals | path of a JSON/JSONL chat file
        count: null         # at most this many records (null = all; math needs a number)
      - name: math
        count: 28000
        weight: 1.0         # copies of each record in `prepare --spec` (0 drops the source, 2 doubles it)
        options: {workers: 2}   # per-kind options, below

`weight` (default 1.0) does not change what is built: `prepare --spec` applies it to the
regenerated file (data/mixture/weights.py), so one regeneration serves every weighting;
`MixtureSpec.build_sha256()` covers everything but the weights.

Options by kind (all optional): sharegpt none; file `keep_assistant`; math `templates`, `modules`,
`workers`; chitchat `speaker`, `min_user_turns`, `max_user_turns`, `joiner`; code `packages`,
`templates`, `method_templates`, `methods`, `min_description_chars`, `max_description_chars`,
`max_signature_chars`; evals `per_eval`, `evals`, `exclude`, `max_user_turns`, `min_chars`, `max_chars`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

SOURCE_KINDS = ("sharegpt", "math", "chitchat", "code", "evals")

DEFAULT_MATH_TEMPLATES = [
    "{question}",
    "{question} Solve it step by step.",
    "Solve the following problem step by step and give the final answer at the end.\n\n{question}",
    "{question}\nShow your reasoning, then state the answer.",
]
DEFAULT_CODE_TEMPLATES = [
    "Write a Python function `{name}({signature})` that does the following: {description}\n\n"
    "Include a docstring and a short usage example.",
    "Implement `{name}({signature})` in Python.\n\nSpecification: {description}",
    "I need a Python function with this signature:\n\n```python\ndef {name}({signature}):\n```\n\n"
    "What it should do: {description}\nPlease include a docstring and briefly explain how it works.",
    "Can you write `{name}` in Python? Signature: `{name}({signature})`. {description} "
    "Add a small example of calling it.",
]
DEFAULT_METHOD_TEMPLATES = [
    "Write the method `{name}({signature})` of a Python class `{cls}`. It should do the following: "
    "{description}\n\nShow the class with this method and a short usage example.",
    "Implement `{cls}.{name}({signature})` in Python.\n\nSpecification: {description}",
]


MAX_WORKERS = 16  # math generator processes a spec may ask for (and the recipe gives the mixture stage)

# The eval-leak rules the records were built under (data/mixture/leaks.py); 2 = exact and near against
# MT-Bench, HumanEval and held-out ShareGPT turns, records cut before a leaking turn.
LEAK_RULES_VERSION = 3  # 3: eval turns under 4 words are generic and match nothing

class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShareGPTOptions(_Options):
    """The packaged ShareGPT file, every usable conversation before the held-out tail, with its
    original assistant turns. No options."""


class FileOptions(_Options):
    """A chat file (data/chat.py rules)."""

    keep_assistant: bool = Field(True, description="Keep the file's assistant turns (False: user turns only).")


def _check_templates(templates: list[str], allowed: tuple[str, ...], required: tuple[str, ...]) -> list[str]:
    if not templates:
        raise ValueError("give at least one template")
    dummy = {k: "x" for k in allowed}
    for i, t in enumerate(templates):
        try:
            t.format(**dummy)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"template {i} {t[:40]!r}: bad placeholder {e}; use "
                             f"{', '.join('{' + k + '}' for k in allowed)} (write {{{{ }}}} for a brace)") from None
        missing = [k for k in required if "{" + k + "}" not in t]
        if missing:
            raise ValueError(f"template {i} {t[:40]!r} lacks {', '.join('{' + k + '}' for k in missing)}")
    return templates


class MathOptions(_Options):
    """DeepMind mathematics_dataset questions as user prompts."""

    templates: list[str] = Field(default_factory=lambda: list(DEFAULT_MATH_TEMPLATES),
                                 description="User-turn templates with {question}; one is picked per record by seed.")
    modules: list[str] | None = Field(None, description="Module names or prefixes (e.g. algebra, "
                                                        "arithmetic__mul); None = every module.")
    workers: int = Field(1, ge=1, le=MAX_WORKERS, description="Generator processes (the output does not depend on it).")

    @field_validator("templates")
    @classmethod
    def _templates(cls, v: list[str]) -> list[str]:
        return _check_templates(v, ("question",), ("question",))


class ChitchatOptions(_Options):
    """chitchat-dataset conversations: one speaker's messages become the user turns."""

    speaker: Literal["first", "second"] = Field("first", description="Whose messages become user turns.")
    min_user_turns: int = Field(1, ge=1, description="Skip conversations with fewer user turns.")
    max_user_turns: int | None = Field(None, ge=1, description="Keep at most this many user turns (None = all).")
    joiner: str = Field("\n", description="Joins the lines of one message.")


class CodeOptions(_Options):
    """'Implement X' requests built from docstrings of installed packages."""

    packages: list[str] = Field(default_factory=lambda: ["stdlib"],
                                description="Import names of installed packages; 'stdlib' = the standard library.")
    templates: list[str] = Field(default_factory=lambda: list(DEFAULT_CODE_TEMPLATES),
                                 description="Function templates with {name}, {signature}, {description}.")
    method_templates: list[str] = Field(default_factory=lambda: list(DEFAULT_METHOD_TEMPLATES),
                                        description="Method templates; may also use {cls}.")
    methods: bool = Field(True, description="Also use public methods of public classes.")
    min_description_chars: int = Field(30, ge=1)
    max_description_chars: int = Field(500, ge=1)
    max_signature_chars: int = Field(160, ge=1)

    @field_validator("templates")
    @classmethod
    def _templates(cls, v: list[str]) -> list[str]:
        return _check_templates(v, ("name", "signature", "description"), ("name", "description"))

    @field_validator("method_templates")
    @classmethod
    def _method_templates(cls, v: list[str]) -> list[str]:
        return _check_templates(v, ("name", "signature", "description", "cls"), ("name", "description"))

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("list at least one package (e.g. [stdlib, numpy])")
        if len(set(v)) != len(v):
            raise ValueError(f"{v}: a package is listed twice")
        return v


class EvalsOptions(_Options):
    """Task prompts of the OpenAI Evals registry (data/mixture/evals_registry.py): a seeded sample of each eval."""

    per_eval: int = Field(200, ge=1, description="Samples drawn from each eval at most (the registry is skewed: "
                                                 "two of its 470 evals hold half the lines).")
    evals: list[str] | None = Field(None, min_length=1, description="Only these evals (folder names under "
                                                                     "registry/data); None = all.")
    exclude: list[str] = Field(default_factory=list, description="Evals left out.")
    max_user_turns: int = Field(3, ge=1, description="Keep the last N user turns of a sample (few-shot examples "
                                                     "come first, the question last).")
    min_chars: int = Field(16, ge=1, description="Skip a sample whose system and user text is shorter.")
    max_chars: int = Field(6000, ge=1, description="Skip a sample whose system and user text is longer.")


OPTIONS: dict[str, type[_Options]] = {"sharegpt": ShareGPTOptions, "math": MathOptions, "chitchat": ChitchatOptions,
                                      "code": CodeOptions, "evals": EvalsOptions, "file": FileOptions}


def _messages(errors: list[Any], prefix: str, model: type[BaseModel]) -> list[str]:
    """One 'field: problem; fix' line per pydantic error, with a did-you-mean for unknown fields."""
    out = []
    for err in errors:
        loc = prefix + ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            key = str(err["loc"][-1])
            close = difflib.get_close_matches(key, model.model_fields, n=1, cutoff=0.6)
            fields = ", ".join(model.model_fields) or "none"
            hint = f"did you mean {close[0]!r}?" if close else f"the fields here are: {fields}"
            out.append(f"{loc}: unknown field; {hint}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            head, sep, rest = msg.partition(": ")  # a validator's "field: problem" joins the location
            if sep and err["type"] == "value_error" and head.replace(".", "").replace("_", "").isalnum():
                loc, msg = f"{loc}.{head}" if loc else head, rest
            out.append(f"{loc}: {msg}")
    return out


class SourceSpec(BaseModel):
    """One source of the mixture: `name` (a kind or a chat file path), `count`, `options`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="sharegpt | math | chitchat | code | evals | path of a JSON/JSONL chat file.")
    count: int | None = Field(None, gt=0, description="At most this many records (None = all the source has).")
    weight: float = Field(1.0, ge=0, allow_inf_nan=False,
                          description="Times each record enters `prepare --spec`'s rows: 0 drops the source, 2 "
                                      "repeats each record, 0.5 keeps a seeded half (data/mixture/weights.py).")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of this kind (module docstring).")
    _parsed: _Options = PrivateAttr()

    @property
    def kind(self) -> str:
        """sharegpt | math | chitchat | code | evals | file."""
        return self.name if self.name in SOURCE_KINDS else "file"

    @property
    def parsed(self) -> Any:
        """The validated options of this kind (an instance of OPTIONS[kind])."""
        return self._parsed

    @model_validator(mode="after")
    def _check(self) -> "SourceSpec":
        if self.kind == "file":
            path = Path(self.name)
            if not path.is_file():
                raise ValueError(f"name: {self.name!r} is neither a source ({' | '.join(SOURCE_KINDS)}) nor an existing "
                                 "chat file; fix the name, or the path (relative to the current directory)")
            from dflash_trainer.data.sources import is_packaged_sharegpt

            if is_packaged_sharegpt(path):
                raise ValueError(f"name: {self.name!r} is the packaged ShareGPT file; use `name: sharegpt`, which "
                                 "leaves out the held-out tail")
        if self.kind == "math" and self.count is None:
            raise ValueError("count: math is a generator without an end; give a count (e.g. 28000)")
        model = OPTIONS[self.kind]
        try:
            self._parsed = model.model_validate(self.options)
        except ValidationError as e:
            raise ValueError("; ".join(_messages(e.errors(), "options.", model))) from None
        return self


class MixtureSpec(BaseModel):
    """A prompt mixture: sources in order, the seed of every choice and of the final order."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description="Seeds the final interleaving and every per-source choice.")
    dedupe: bool = Field(True, description="Drop a record whose system + user turns repeat an earlier one's.")
    sources: list[SourceSpec] = Field(min_length=1, description="The sources, each named once.")

    @model_validator(mode="after")
    def _unique(self) -> "MixtureSpec":
        seen: set[str] = set()
        for i, s in enumerate(self.sources):
            if s.name in seen:
                raise ValueError(f"sources.{i}.name: {s.name!r} is listed twice; use one entry per source "
                                 "(its count sets how many records it gives)")
            seen.add(s.name)
        if all(s.weight == 0 for s in self.sources):
            raise ValueError("sources: every weight is 0, so `prepare` would keep nothing; give at least one source "
                             "a weight > 0")
        return self

    def build_sha256(self) -> str:
        """sha256 of what decides the built records: seed, dedupe and each source's name, count and
        options as written (canonical JSON), and LEAK_RULES_VERSION (prompts built under older
        eval-leak rules are rebuilt). Weights, comments and YAML layout leave it unchanged, so
        `regenerate --spec` reuses its prompts across weightings (data/mixture/prompt_cache.py)."""
        data = self.model_dump(mode="json")
        data["leak_rules"] = LEAK_RULES_VERSION
        for s in data["sources"]:
            del s["weight"]
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def parse_spec(data: Any, where: str = "mixture spec") -> MixtureSpec:
    """Validate a spec mapping. Raises ValueError naming each bad field (e.g. `sources.1.count`)
    and how to fix it."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping with `sources:` (and optionally `seed:`, `dedupe:`)")
    try:
        return MixtureSpec.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = err["loc"]
            model: type[BaseModel] = SourceSpec if len(loc) >= 3 and loc[0] == "sources" else MixtureSpec
            lines += _messages([err], "", model)
        raise ValueError(f"invalid {where}: " + "; ".join(lines)) from None


def load_spec(path: str | Path) -> MixtureSpec:
    """Read a YAML spec file. Raises FileNotFoundError for a missing file, ValueError for bad YAML
    or fields."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--spec {p}: file not found (e.g. configs/mixture-smollm2.yaml)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"--spec {p}: not valid YAML ({e})") from None
    return parse_spec(data, f"mixture spec {p}")
