"""The boundary watch between host reads (kernelguard.runtime.segments.signals_disagree_on_device) on a GPU: it must
never make the host wait for the device (that would cost every guarded step a sync). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kernelguard.runtime.segments import signals_disagree_on_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_device_watch_never_syncs_and_still_sees_a_stale_split() -> None:
    lengths = [300, 140, 200, 60]
    cu = torch.tensor([0, 300, 440, 640, 700], dtype=torch.int32, device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    seq_idx = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), torch.tensor(lengths))[None].cuda()
    stale = cu.clone()
    stale[1] += 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host wait in the watch raises
    try:
        good = signals_disagree_on_device(positions, {"cu_seq_lens_q": cu, "seq_idx": seq_idx}, None)
        bad = signals_disagree_on_device(positions, {"cu_seq_lens_q": stale, "seq_idx": seq_idx}, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not bool(good) and bool(bad)
