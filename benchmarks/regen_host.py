"""The host's work per turn in `dflash-train regenerate` (data/regenerate.py with data/responders.py
TargetResponder), the device left out: the generator is replaced by one that answers every prompt at once with
136 random token ids (the mixture's mean answer), so what is timed is reading records, rendering each turn's
prompt with the chat template, tokenizing it, decoding the answer and writing records.

    python benchmarks/regen_host.py --data PROMPTS.jsonl --out FILE.json [--records 3000] [--target smollm2-135m]

Also times the prompt tokenization alone on the same rendered prompts: one tokenizer call per prompt
(`prompt_ids`, how the responder tokenized before) against one call for each poll's prompts (`prompt_ids_batch`,
the tokenizer's threads). On a GPU host the device runs its decode steps meanwhile (with `--overlap`), so this
work bounds the regeneration's rate once it exceeds a stretch of steps. Writes FILE.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_trainer.data.regenerate import RegenerateSettings, regenerate_file  # noqa: E402
from dflash_trainer.data.responders import TargetResponder  # noqa: E402
from dflash_trainer.data.tokenize import prompt_ids, prompt_ids_batch, resolve_chat_template  # noqa: E402
from dflash_trainer.decoding.continuous import Finished  # noqa: E402
from dflash_trainer.target_model.load import load_target  # noqa: E402

ANSWER_TOKENS = 136  # recipe/plan.py ANSWER_TOKENS_PER_TURN
POLL_TURNS = 128  # turns a poll hands back (about what 1,024 rows finish in 16 steps)


class InstantGenerator:
    """The ContinuousGenerator interface answering at once: up to POLL_TURNS prompts a poll, random ids."""

    overlap = False

    def __init__(self, vocab: int):
        self.queue: deque = deque()
        self.rng = random.Random(0)
        self.vocab = vocab
        self.prompts: list[list[int]] = []  # every prompt submitted (for the tokenization-only timing)

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def submit(self, key, prompt: list[int]) -> None:
        self.queue.append(key)
        self.prompts.append(prompt)

    def poll(self) -> list[Finished]:
        take = [self.queue.popleft() for _ in range(min(len(self.queue), POLL_TURNS))]
        return [Finished(k, [self.rng.randrange(100, self.vocab) for _ in range(ANSWER_TOKENS)], False) for k in take]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="records (a mixture's prompts.jsonl)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--target", default="smollm2-135m")
    args = ap.parse_args()
    bundle = load_target(args.target, device=torch.device("cpu"), dtype=torch.float32)
    template = resolve_chat_template(bundle.tokenizer)
    respond = TargetResponder(bundle, template, max_new_tokens=512, slots=2, max_prompt_tokens=1536, loop_ngram=32,
                              shortest_first=True)
    respond.gen = gen = InstantGenerator(bundle.vocab_size)
    out = Path(args.out).with_suffix(".regen.jsonl")
    for f in out.parent.glob(out.name + "*"):
        f.unlink()
    settings = RegenerateSettings(data=args.data, out=str(out), target=args.target, max_new_tokens=512,
                                  batch_size=1024, max_prompt_tokens=1536, loop_ngram=32, lookahead=4,
                                  max_conversations=args.records)
    t0 = time.perf_counter()
    report = regenerate_file(settings, respond)
    loop_s = time.perf_counter() - t0
    texts = [bundle.tokenizer.decode(p) for p in gen.prompts]  # the rendered prompts again, as text
    t0 = time.perf_counter()
    single = [prompt_ids(bundle.tokenizer, t) for t in texts]
    single_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batched = [ids for i in range(0, len(texts), POLL_TURNS)
               for ids in prompt_ids_batch(bundle.tokenizer, texts[i:i + POLL_TURNS])]
    batch_s = time.perf_counter() - t0
    turns = report.regenerated_turns
    res = {"what": "regeneration host work per turn, device left out (benchmarks/regen_host.py)",
           "cpus": os.cpu_count(), "torch": torch.__version__, "target": args.target, "records": args.records,
           "turns": turns, "mean_prompt_tokens": sum(map(len, gen.prompts)) / max(len(gen.prompts), 1),
           "loop_ms_per_turn": 1e3 * loop_s / max(turns, 1),
           "tokenize_one_call_each_ms_per_turn": 1e3 * single_s / max(len(texts), 1),
           "tokenize_batched_per_poll_ms_per_turn": 1e3 * batch_s / max(len(texts), 1),
           "same_ids": single == batched}
    for f in out.parent.glob(out.name + "*"):
        f.unlink()
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
