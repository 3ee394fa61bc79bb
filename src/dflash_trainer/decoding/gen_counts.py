"""Where a continuous-batching generator's decode steps go: counts kept by the host, no device sync.

Every decode step of `ContinuousGenerator` runs all R rows over one attended span (the longest
occupied row's position, rounded up to the span ladder). Its cost grows with R × span, while the
useful work is the rows that serve a sequence and the slots each of them needs. These counts say
how much of the step is useful, and how long prompts wait for a row:

  occupancy          = live_row_steps / row_steps            (rows still generating, per step; a row
                       that finished waits for the host's next look, up to `sync_every` steps, unused)
  span_efficiency    = needed_slot_steps / attended_slot_steps
                       (cache slots the serving rows need ÷ slots the step attends: R × span;
                       on the eager path R × the exact need)
  turn_wait_steps    decode steps a prompt waited in the queue before its prefill, as a histogram
                       (buckets: waited at most N steps; "more" past the last)
  device_wait_ms     milliseconds the host spent blocked at its looks, waiting for the device to
                       finish the launched decode steps (CUDA only; 0 on the CPU, which runs the steps
                       itself; prefill forwards not included). Near the generation's wall time: the
                       device sets the pace; far below it: the host does

All counts are plain integers so two runs' counts add up (a regeneration and its continuation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

WAIT_BUCKETS = (0, 16, 64, 256, 1024, 4096)  # decode steps; a wait above the last goes to "more"


@dataclass
class GenerationCounts:
    """Counters of one generator (all ints). `live_row_steps` / `needed_slot_steps` count only the
    steps in which a row was still generating (a row that finished between two looks of the host
    is taken back by `unlive` when the host sees it). `span_steps`: decode steps per ladder span
    (the graph path attends that span; the eager path attends exactly what it needs);
    `turn_wait_steps`: prompts per wait bucket (`WAIT_BUCKETS` as strings, then "more")."""

    decode_steps: int = 0
    row_steps: int = 0  # R per decode step
    live_row_steps: int = 0  # rows serving a sequence, per decode step
    attended_slot_steps: int = 0  # R × span per decode step
    needed_slot_steps: int = 0  # Σ over serving rows of (position bound + 1), per decode step
    prefill_forwards: int = 0
    prefill_rows: int = 0
    prefill_padded_tokens: int = 0  # rows × longest prompt of each prefill forward
    device_wait_ms: int = 0  # host time blocked at the looks (milliseconds, the rounded total; CUDA only)
    span_steps: dict[str, int] = field(default_factory=dict)
    turn_wait_steps: dict[str, int] = field(default_factory=dict)

    def step(self, rows: int, live_bounds: list[int], span: int, attended: int | None = None,
             attended_slots: int | None = None) -> None:
        """One decode step over `rows` rows at ladder span `span` (counted in `span_steps`), attending
        `attended` slots per row (default `span`; the eager step attends exactly what it needs), or
        `attended_slots` in all (row attention: each row its own slots); `live_bounds` holds each
        serving row's position bound (its needed slots are bound + 1)."""
        self.decode_steps += 1
        self.row_steps += rows
        self.live_row_steps += len(live_bounds)
        self.attended_slot_steps += (attended_slots if attended_slots is not None
                                     else rows * (span if attended is None else attended))
        self.needed_slot_steps += sum(live_bounds) + len(live_bounds)
        key = str(span)
        self.span_steps[key] = self.span_steps.get(key, 0) + 1

    def unlive(self, bounds: list[int]) -> None:
        """Take back steps `step` counted as live for a row that had already finished (the host learns
        of it only at its next look, up to `sync_every` steps later): one step per entry of `bounds`,
        the row's position bound at that step."""
        self.live_row_steps -= len(bounds)
        self.needed_slot_steps -= sum(bounds) + len(bounds)

    def prefill(self, rows: int, longest: int) -> None:
        """One prefill forward of `rows` prompts padded to `longest` tokens."""
        self.prefill_forwards += 1
        self.prefill_rows += rows
        self.prefill_padded_tokens += rows * longest

    def waited(self, steps: int) -> None:
        """A prompt left the queue after waiting `steps` decode steps (≥ 0)."""
        key = next((str(b) for b in WAIT_BUCKETS if steps <= b), "more")
        self.turn_wait_steps[key] = self.turn_wait_steps.get(key, 0) + 1

    def as_dict(self) -> dict[str, int | dict[str, int]]:
        """The counters, spans in ascending order, wait buckets in bucket order."""
        out: dict[str, int | dict[str, int]] = {k: v for k, v in self.__dict__.items() if isinstance(v, int)}
        out["span_steps"] = dict(sorted(self.span_steps.items(), key=lambda kv: int(kv[0])))
        order = [str(b) for b in WAIT_BUCKETS] + ["more"]
        out["turn_wait_steps"] = {k: self.turn_wait_steps[k] for k in order if k in self.turn_wait_steps}
        return out


def ratios(counts: dict[str, int | dict[str, int]]) -> dict[str, float]:
    """occupancy, span_efficiency, mean_span (slots), mean_live_rows and mean prefill rows from
    `GenerationCounts.as_dict()` (or the sum of several); {} when no decode step ran."""
    steps = int(counts.get("decode_steps", 0) or 0)
    if not steps:
        return {}
    rows = int(counts["row_steps"]) / steps
    return {
        "occupancy": round(int(counts["live_row_steps"]) / max(int(counts["row_steps"]), 1), 4),
        "span_efficiency": round(int(counts["needed_slot_steps"]) / max(int(counts["attended_slot_steps"]), 1), 4),
        "mean_span": round(int(counts["attended_slot_steps"]) / max(int(counts["row_steps"]), 1), 1),
        "mean_live_rows": round(int(counts["live_row_steps"]) / steps, 1),
        "rows": round(rows, 1),
        "mean_prefill_rows": round(int(counts.get("prefill_rows", 0)) / max(int(counts.get("prefill_forwards", 0)), 1), 1),
    }
