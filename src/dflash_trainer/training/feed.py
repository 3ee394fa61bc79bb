"""Co-located feature feed: target forward of the next batch overlapped with the drafter step.

In the co-located layout one device runs both models. On CUDA the feed queues the frozen target's
forward for batch i+1 on its own stream before it hands batch i to the drafter, so the two
overlap on the GPU (the target needs no gradients and the drafter step needs no target state);
the drafter's stream waits on an event, never the host. The lookahead is one batch: besides the
batch in training, one batch of features ([R,T,k·H] in the target dtype) and its rows are alive.
On CPU (or with overlap off) batches are processed in order on the current stream.
With a `FeatureCache` (training/feature_cache.py, `feature_cache_gib`) rows whose outputs are
stored are served from it instead of the target forward.

Results are the same as running the target forward inline: the same kernels on the same inputs,
only on another stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from dflash_trainer.drafter.weights import needs_target_hidden
from dflash_trainer.target_model.features import TargetFeatureExtractor, TargetOutput
from dflash_trainer.training.feature_cache import FeatureCache
from dflash_trainer.training.step import StepSettings

Rows = dict[str, torch.Tensor]


def padding_rows(rows: int, seq_len: int) -> dict[str, torch.Tensor]:
    """R all-unsupervised rows (one document each, pad id 0): what a −1 row index stands for."""
    pos = torch.arange(seq_len, dtype=torch.int64).expand(rows, seq_len).contiguous()
    return {"input_ids": torch.zeros(rows, seq_len, dtype=torch.int64), "position_ids": pos,
            "loss_mask": torch.zeros(rows, seq_len, dtype=torch.bool)}


def extract(extractor: TargetFeatureExtractor, rows: Rows, settings: StepSettings) -> TargetOutput:
    """Target forward for one batch: features [R,T,k·H], plus argmax labels [R,T] / final hidden
    states [R,T,H] as the objective needs (label_source="target" / loss kl, ce_kl or weights cat)."""
    return extractor(rows["input_ids"], rows["position_ids"], need_argmax=settings.label_source == "target",
                     need_last_hidden=needs_target_hidden(settings.loss, settings.position_weights))


def rows_to(batch: Rows, device: torch.device) -> Rows:
    """input_ids / loss_mask / position_ids [R,T] of a host batch copied to `device` (pinned and
    non-blocking on CUDA)."""
    pin = device.type == "cuda"
    out = {}
    for k in ("input_ids", "loss_mask", "position_ids"):
        t = batch[k]
        out[k] = (t.pin_memory() if pin else t).to(device, non_blocking=pin)
    return out


def fetch_rows(rows_ds, row_index, seq_len: int) -> dict[str, torch.Tensor]:
    """input_ids / position_ids [R,T] int64 and loss_mask [R,T] bool of dataset rows; −1 = padding row."""
    out = padding_rows(len(row_index), seq_len)
    keep = [i for i, r in enumerate(row_index) if r >= 0]
    if keep:
        got = rows_ds[[int(row_index[i]) for i in keep]]
        for name, dtype in (("input_ids", torch.int64), ("position_ids", torch.int64), ("loss_mask", torch.bool)):
            col = got[name]
            col = torch.stack(list(col)) if isinstance(col, (list, tuple)) else torch.as_tensor(col)
            out[name][keep] = col.to(dtype)
    return out


@dataclass
class _InFlight:
    rows: Rows
    out: TargetOutput
    ready: torch.cuda.Event | None


class TargetFeed:
    """Turns host batches into (device rows, target outputs) pairs, one batch ahead on CUDA.

    forward: rows → TargetOutput (e.g. `feed.extract` bound to an extractor). overlap:
    run it on a side CUDA stream one batch ahead (ignored off CUDA). cache: a FeatureCache that
    serves stored rows (host batches then carry "row_index" [R] int64, −1 = padding). Abandoning
    the iterator early (stop request) discards at most the one prefetched batch; the caller's data
    position counts only the batches it received.
    """

    def __init__(self, forward: Callable[[Rows], TargetOutput], device: torch.device, overlap: bool = True,
                 cache: FeatureCache | None = None):
        self.forward = forward
        self.device = device
        self.overlap = overlap and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.overlap else None
        self.cache = cache

    def _outputs(self, batch: Rows, rows: Rows) -> TargetOutput:
        if self.cache is None:
            return self.forward(rows)
        return self.cache.outputs(batch["row_index"], rows, self.forward)

    def __call__(self, batches: Iterable[Rows]) -> Iterator[tuple[Rows, TargetOutput]]:
        if not self.overlap:
            for batch in batches:
                rows = rows_to(batch, self.device)
                yield rows, self._outputs(batch, rows)
            return
        main = torch.cuda.current_stream(self.device)
        it = iter(batches)
        nxt = self._launch(next(it, None))
        while nxt is not None:
            cur = nxt
            nxt = self._launch(next(it, None))  # the next forward is queued before this step's kernels
            main.wait_event(cur.ready)
            for t in (*cur.rows.values(), cur.out.features, cur.out.argmax, cur.out.last_hidden):
                if t is not None:
                    t.record_stream(main)  # memory made on the side stream, freed after main's use
            yield cur.rows, cur.out

    def _launch(self, batch: Rows | None) -> _InFlight | None:
        if batch is None:
            return None
        # Work queued on the main stream so far (weights loaded or initialized there, the step
        # before the one this batch overlaps) is finished before the side stream reads anything.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            rows = rows_to(batch, self.device)
            out = self._outputs(batch, rows)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return _InFlight(rows, out, ready)
