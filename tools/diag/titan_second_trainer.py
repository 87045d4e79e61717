"""Why torchtitan 0.3.0 jobs do not restart in place (issue 46): a second ``Trainer`` built in
the same process, on a new process group, refuses its own model.

    PYTHONPATH=build/titan-site:. python -m torch.distributed.run --standalone \
        --nproc-per-node 2 tools/diag/titan_second_trainer.py --module llama3 \
        --config llama3_debugmodel --hf_assets_path ASSETS/tokenizer \
        --dataloader.dataset_path ASSETS/c4_test --dump_folder /tmp/tt \
        --parallelism.data_parallel_shard_degree 2 --training.steps 2 \
        --training.mixed_precision_param float32 --training.seq_len 128 \
        --training.local_batch_size 2

(ASSETS: ``tools.stacks.killer.setup``'s ``titan-assets``.) Each rank builds a Trainer on
group 0, closes it, drops the group as the in-process restart does
(cudasnap.distributed.groups.drop_groups), forms a new one on a fresh store prefix and builds
a second Trainer from a freshly parsed config. On torchtitan 0.3.0 with torch 2.14 the second
build fails in ``fully_shard`` ("Expected param's DTensor mesh to be the same mesh passed to
fully_shard, but got different mesh objects"): the rebuilt model's ``tok_embeddings.weight``
arrives as a DTensor on the first Trainer's ``dp_shard`` mesh, process-global state of the
first build (not torch.compile's: ``torch._dynamo.reset()`` between the two builds changes
nothing; ``--parallelism.spmd_backend partial_dtensor`` fails alike, on the first group's
name). Prints ``second trainer: built`` or ``second trainer: <error>``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stacks"))
import titan_cpu  # noqa: E402,F401  (torchtitan on CPU)
import torch.distributed as dist  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

from cudasnap.distributed.groups import drop_groups  # noqa: E402


def main() -> int:
    argv = sys.argv[1:]
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 7,
                          is_master=rank == 0, wait_for_workers=False)
    for gen in range(2):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"g{gen}", store), rank=rank,
                                world_size=int(os.environ["WORLD_SIZE"]))
        try:
            trainer = ConfigManager().parse_args(argv).build()
        except Exception as e:  # noqa: BLE001 - what this script reports
            print(f"rank {rank}: second trainer: {type(e).__name__}: {e}", flush=True)
            return 1
        print(f"rank {rank}: {'first' if gen == 0 else 'second'} trainer: built", flush=True)
        trainer.close()
        drop_groups()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
