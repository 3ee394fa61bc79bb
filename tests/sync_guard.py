"""A CPU stand-in for `torch.cuda.set_sync_debug_mode("error")`, shared by the host-sync tests."""

import torch


class SyncGuard(torch.overrides.TorchFunctionMode):
    """Raises on the Python-visible host syncs (CPU stand-in for
    torch.cuda.set_sync_debug_mode): .item/.tolist/bool(), nonzero, masked_select, boolean
    indexing, repeat_interleave without output_size."""

    BANNED = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.nonzero,
              torch.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.Tensor.cpu, torch.Tensor.numpy}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.BANNED:
            raise AssertionError(f"host sync: {func.__name__}")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
                raise AssertionError("host sync: boolean indexing")
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs:
            raise AssertionError("host sync: repeat_interleave without output_size")
        return func(*args, **kwargs)
