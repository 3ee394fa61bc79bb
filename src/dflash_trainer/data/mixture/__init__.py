"""A prompt mixture for on-policy regeneration, built only from data that installs offline from
PyPI and never from the eval suites (docs/data.md).

    dflash-train mixture --spec configs/mixture-smollm2.yaml --out prompts.jsonl
    dflash-train regenerate --data prompts.jsonl --out regenerated.jsonl   # the target answers

Sources (one module each): sharegpt + chat files (chatfiles.py), math (maths.py, math_worker.py),
chitchat (chitchat.py), code (code_prompts.py). The spec (spec.py: `load_spec`), the record rule
and report (records.py), the eval-leak check (leaks.py: `find_eval_leaks`), licences
(licences.py), the build (build.py: `build_mixture`, `write_mixture`), the command (cli/mixture.py), the
source weights `prepare --spec` applies (weights.py) and the prompts `regenerate --spec` builds
and caches (prompt_cache.py). This file imports nothing, so `prepare` can read the licence table
without the rest.

Record convention (one JSON object per line of the output):

    {"id": "<source>/<n>", "source": "<name>", "messages": [{"role": ..., "content": ...}, ...]}

  * `source` is the spec's source name (sharegpt | math | chitchat | code | evals | the chat file's path);
    `n` is the item's index in that source's own order (for sharegpt: the usable-conversation
    index in the file, always below the held-out start).
  * `messages` may start with one system message. Then either
      - user/assistant pairs ending with an assistant turn: a conversation with its original
        answers (sharegpt, chat files); `prepare` can train on them as they are and `regenerate`
        replaces every assistant turn with the target's own; or
      - one or more user turns and nothing else: a prompt-only record (math, chitchat, code).
        Consecutive user turns are separate turns of one conversation, not one message: the
        regenerator inserts the target's answer after each of them, in order.
  * Every content is a non-empty string. Nothing else is in a record.
"""

