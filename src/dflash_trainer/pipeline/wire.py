"""The wire contract between a target and a drafter: one micro-batch = one header + two or three
tensors, with shapes fixed for the whole run.

Shapes: R = rows per micro-batch, T = packed tokens per row, F = k·H feature width, H = hidden size.

  header    int64 [8 + R]   control channel (CPU, gloo)
            [MAGIC, VERSION, unit, step, epoch, num_valid_rows, flags, 0, row_index × R]
            row_index −1 marks a padding row (all unsupervised; contributes nothing)
  ids       int32 [P,R,T]   data channel; planes: input_ids, position_ids, loss_mask (0/1),
                            then the target's argmax when FLAG_ARGMAX (P = 3 or 4)
  features  [R,T,F]         data channel, the target's dtype (bf16 on GPU, fp32 on CPU)
  last_hidden [R,T,H]       data channel, only when FLAG_LAST_HIDDEN (KL term or CAT weights)

Both sides derive a `WireSpec` from the config, so receive buffers are allocated once and every
message has a known size; the header repeats what the receiver must check (unit and step) and says
which optional parts are present. Token ids, positions and argmax must fit int32 (V < 2^31).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAGIC = 0x44464C53  # "DFLS"
VERSION = 1
HEADER_FIXED = 8
FLAG_ARGMAX = 1
FLAG_LAST_HIDDEN = 2
FLAG_ZERO_FEATURES = 4  # every row is padding: features are zeros and were not computed


class ProtocolError(RuntimeError):
    """A message that does not follow the wire contract (wrong magic/version, unit or step)."""


@dataclass(frozen=True)
class WireSpec:
    """Fixed sizes of one micro-batch on the wire."""

    rows: int  # R
    seq_len: int  # T
    feature_width: int  # F = k·H
    hidden_size: int  # H
    feature_dtype: torch.dtype
    need_argmax: bool
    need_last_hidden: bool

    @property
    def header_numel(self) -> int:
        return HEADER_FIXED + self.rows

    @property
    def id_planes(self) -> int:
        return 4 if self.need_argmax else 3

    @property
    def flags(self) -> int:
        return (FLAG_ARGMAX if self.need_argmax else 0) | (FLAG_LAST_HIDDEN if self.need_last_hidden else 0)

    def payload_bytes(self) -> int:
        """Bytes of the data-channel tensors of one micro-batch."""
        el = torch.empty((), dtype=self.feature_dtype).element_size()
        n = self.id_planes * self.rows * self.seq_len * 4 + self.rows * self.seq_len * self.feature_width * el
        if self.need_last_hidden:
            n += self.rows * self.seq_len * self.hidden_size * el
        return n


@dataclass
class TransferBatch:
    """One micro-batch, on the sender after the target forward or on the receiver after arrival.

    ids [P,R,T] int32, features [R,T,F], last_hidden [R,T,H] or None, row_index [R] int64 (CPU).
    """

    unit: int
    step: int
    epoch: int
    row_index: torch.Tensor
    ids: torch.Tensor
    features: torch.Tensor
    last_hidden: torch.Tensor | None = None
    zero_features: bool = False

    @property
    def num_valid_rows(self) -> int:
        return int((self.row_index >= 0).sum())

    def rows(self) -> dict[str, torch.Tensor]:
        """input_ids / position_ids [R,T] int64 and loss_mask [R,T] bool, as `drafter_step` takes them."""
        return {"input_ids": self.ids[0].long(), "position_ids": self.ids[1].long(), "loss_mask": self.ids[2].bool()}

    def argmax(self) -> torch.Tensor | None:
        """The target's greedy labels [R,T] int64, or None when not sent."""
        return self.ids[3].long() if self.ids.shape[0] > 3 else None


def pack_header(batch: TransferBatch, spec: WireSpec) -> torch.Tensor:
    """The int64 [8 + R] CPU header of `batch`."""
    flags = spec.flags | (FLAG_ZERO_FEATURES if batch.zero_features else 0)
    head = torch.tensor([MAGIC, VERSION, batch.unit, batch.step, batch.epoch, batch.num_valid_rows, flags, 0],
                        dtype=torch.int64)
    return torch.cat([head, batch.row_index.to(torch.int64).cpu()])


def unpack_header(header: torch.Tensor, spec: WireSpec, *, unit: int, step: int, src: int) -> tuple[int, torch.Tensor, bool]:
    """Check a received header against the expected unit/step; returns (epoch, row_index [R], zero_features).

    Raises ProtocolError naming the sender rank `src` on any mismatch.
    """
    h = header.tolist()
    if h[0] != MAGIC or h[1] != VERSION:
        raise ProtocolError(f"rank {src} sent a header with magic {h[0]:#x} version {h[1]} "
                            f"(expected {MAGIC:#x} v{VERSION}): mixed program versions?")
    if h[2] != unit or h[3] != step:
        raise ProtocolError(f"rank {src} sent micro-batch {h[2]} of step {h[3]}, expected {unit} of step {step}: "
                            "the ranks disagree on the schedule (same config and data on every rank?)")
    if (h[6] & (FLAG_ARGMAX | FLAG_LAST_HIDDEN)) != spec.flags:
        raise ProtocolError(f"rank {src} sent flags {h[6]}, expected {spec.flags}: the ranks disagree on the objective")
    return int(h[4]), header[HEADER_FIXED:].clone(), bool(h[6] & FLAG_ZERO_FEATURES)


def pack_ids(rows: dict[str, torch.Tensor], argmax: torch.Tensor | None, spec: WireSpec) -> torch.Tensor:
    """Stack input_ids, position_ids, loss_mask (and argmax) into int32 [P,R,T] on their device."""
    planes = [rows["input_ids"], rows["position_ids"], rows["loss_mask"]]
    if spec.need_argmax:
        if argmax is None:
            raise ValueError("the wire spec carries target labels but no argmax was computed")
        planes.append(argmax)
    return torch.stack([p.to(torch.int32) for p in planes])


def allocate(spec: WireSpec, device: torch.device) -> TransferBatch:
    """Receive buffers for one micro-batch (unit/step/epoch filled in on arrival)."""
    R, T = spec.rows, spec.seq_len
    return TransferBatch(
        unit=-1, step=-1, epoch=-1, row_index=torch.full((R,), -1, dtype=torch.int64),
        ids=torch.zeros(spec.id_planes, R, T, dtype=torch.int32, device=device),
        features=torch.zeros(R, T, spec.feature_width, dtype=spec.feature_dtype, device=device),
        last_hidden=(torch.zeros(R, T, spec.hidden_size, dtype=spec.feature_dtype, device=device)
                     if spec.need_last_hidden else None))
