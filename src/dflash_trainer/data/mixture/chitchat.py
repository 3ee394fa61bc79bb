"""Casual conversations from PyPI `chitchat-dataset==0.9.0` (MIT, BYU-PCCL Chit-Chat Challenge).

The wheel holds `chitchat_dataset/dataset.json` (40 MB): a mapping of conversation id →
`{"messages": [[{"text", "sender", "timestamp"}, ...], ...], "prompt", "start", "ratings"}`;
each inner list is one message (consecutive lines of one sender). The file is read directly
(located with importlib, the package is never imported).

One speaker's messages (the conversation's first sender by default) become the record's user
turns, in order and with nothing between them (the regenerator answers each); the other
speaker's messages are dropped, since the target's answers replace them. 3,150 of the 7,168
conversations have a single message from a single speaker (mostly "hello?"); `dedupe` in the
spec drops their repeats.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from dflash_trainer.data.mixture.licences import package_version
from dflash_trainer.data.mixture.records import Messages, SourceReport
from dflash_trainer.data.mixture.spec import SourceSpec
from dflash_trainer.files.packaged import package_file

CHITCHAT_PACKAGE = "chitchat_dataset"
CHITCHAT_FILE = "dataset.json"
CHITCHAT_INSTALL = "pip install --no-deps chitchat-dataset==0.9.0"


def _message_text(message: list, joiner: str) -> str | None:
    """The lines of one message joined, or None when the message is malformed."""
    if not isinstance(message, list) or not all(isinstance(u, dict) and isinstance(u.get("text"), str) for u in message):
        return None
    return joiner.join(u["text"].strip() for u in message if u["text"].strip())


def iter_chitchat(source: SourceSpec, report: SourceReport) -> Iterator[tuple[int, Messages]]:
    """(conversation index in the file, user turns) for each usable conversation, in file order.

    Skips (counted): `malformed` (not the layout above), `no_user_turn`, `too_few_user_turns`
    (under `min_user_turns`). Turns over `max_user_turns` are cut and counted in
    `details.user_turns_cut`; empty messages are dropped and counted in `details.empty_messages`.
    Raises FileNotFoundError naming the install command when the package is missing.
    """
    opts = source.parsed
    path = package_file(CHITCHAT_PACKAGE, CHITCHAT_FILE, CHITCHAT_INSTALL, why="the chitchat source needs ")
    report.package, report.version = "chitchat-dataset", package_version(CHITCHAT_PACKAGE)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of conversation id → conversation; reinstall with "
                         f"`{CHITCHAT_INSTALL}`")
    cut = empty = single = 0
    report.details.update(path=str(path), conversations=len(data), speaker=opts.speaker)
    try:
        for n, (conv_id, conv) in enumerate(data.items()):
            messages = conv.get("messages") if isinstance(conv, dict) else None
            if not isinstance(messages, list) or not messages:
                report.skip("malformed", conv_id)
                continue
            texts = [(m[0].get("sender") if m and isinstance(m[0], dict) else None, _message_text(m, opts.joiner))
                     for m in messages]
            if any(t is None for _, t in texts):
                report.skip("malformed", conv_id)
                continue
            senders = list(dict.fromkeys(s for s, _ in texts))
            single += len(senders) == 1
            if opts.speaker == "second" and len(senders) < 2:
                report.skip("no_user_turn", conv_id)
                continue
            user = senders[0 if opts.speaker == "first" else 1]
            turns = [t for s, t in texts if s == user]
            empty += sum(not t for t in turns)
            turns = [t for t in turns if t]
            if not turns:
                report.skip("no_user_turn", conv_id)
                continue
            if len(turns) < opts.min_user_turns:
                report.skip("too_few_user_turns", conv_id)
                continue
            if opts.max_user_turns is not None and len(turns) > opts.max_user_turns:
                cut += len(turns) - opts.max_user_turns
                turns = turns[: opts.max_user_turns]
            yield n, [{"role": "user", "content": t} for t in turns]
    finally:
        report.details.update(single_speaker_conversations=single, user_turns_cut=cut, empty_messages=empty)
