"""Expert-parallel dispatch against the single-process expert block, including a rank that receives no tokens."""

from __future__ import annotations

import pytest

from moeckpt.trainer.local_world import run_local_world

from ..train_workers import expert_dispatch_check

pytestmark = pytest.mark.slow  # multi-process


def test_expert_dispatch_matches_one_process_forward_and_backward():
    run_local_world(expert_dispatch_check, 2, ("random", "rank0"), timeout_s=120)
