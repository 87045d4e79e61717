"""The torchtitan config of the README's integration (tools/stacks/titan_cfg.py) with a
self-kill for tests (``--module tests.helpers.titan.cudasnap_cfg --config
llama3_debugmodel_cudasnap``). ``TT_KILL_STEP``/``TT_KILL_RANK``: that rank SIGKILLs itself
once that step's snapshot is COMPLETE, in the first attempt only."""
from __future__ import annotations

import os
import signal
import time

import torch

from tests.helpers import parts
from tools.stacks.titan_cfg import llama3_debugmodel_cudasnap

__all__ = ["llama3_debugmodel_cudasnap"]

_save = parts.titan_save()


def _save_then_maybe_die(self, curr_step: int, last_step: bool = False) -> bool:
    done = _save(self, curr_step, last_step)
    first = os.environ.get("CUDASNAP_RESTART", "0") == "0" and \
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first and str(curr_step) == os.environ.get("TT_KILL_STEP") and \
            str(torch.distributed.get_rank()) == os.environ.get("TT_KILL_RANK"):
        self.snap.wait()
        print(f"KILL step={curr_step} rank={torch.distributed.get_rank()} at={time.time():.3f}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return done


parts.set_titan_save(_save_then_maybe_die)
