"""Multi-rank jobs on torch.distributed: agreed flush step, global commit, replica restore.

torch.distributed (the c10d store of the default process group) and torchrun's
elastic restart are the engine; cudasnap adds no launcher or rendezvous. The
store must outlive any one rank: torchrun's agent store, or a FileStore
(``init_method="file://..."``, one file per restart attempt; see
tests/dist/ddp_train.py for why with torch 2.14.1 + gloo). A TCPStore hosted
by rank 0's own process dies with rank 0, and with it the coordination.

Liveness. Per rank, every ``heartbeat_s`` a monitor thread publishes
``hb/<rank> = seq:last_step:complete_steps`` in the store (a clone of the
default store: its own connection) and reads the others'. A peer is dead when
its heartbeat stops for ``peer_timeout_s`` (``CUDASNAP_PEER_TIMEOUT_S``; a
SIGSTOPped or otherwise frozen process) or, for a peer in this pid namespace
of this boot, at once when its process is gone or a zombie. A peer that never
sent a heartbeat is not timed out (it may still be starting). Newly dead
peers trigger ``peer_failure`` on the survivors (default policy: flush, exit
79). Flushes requested by the monitor run on a separate action thread, so
heartbeats continue during a flush.

Flush round ``g`` (any trigger on any rank; the others join when they see
``flush/<g>/request``):
  1. agree: each live rank publishes the steps COMPLETE in its arena
     (``have/<rank>``); the ranks that publish nothing before the agreement
     deadline (``peer_timeout_s`` + slack) form the dead set D. A dead rank
     counts with the steps in its arena, read directly by a live rank on its
     host (``left/<rank>``); with no arena left it counts with its last
     heartbeat, or not at all when a live rank replicates its state. The
     newest step COMPLETE everywhere and D are proposed with compare_set;
     the first proposal wins for every rank;
  2. each live rank writes ``DIR/step-N/rank-RRRRR/`` and sets ``done/<rank>``;
     the lowest live rank on a host also flushes the arena of each rank of D
     on that host and sets its ``done`` marker;
  3. the lowest rank not in D waits for the markers (a rank of D with no live
     rank on its host is not waited for), then writes ``DIR/step-N/COMMIT``
     (JSON, fsync'd) and ``latest``. A rank that dies during the round (not in
     D, no marker) makes the round fail: the step is not committed and restore
     uses shared memory or the previous committed step. Every wait of a round
     ends within ``flush_timeout_s`` (``CUDASNAP_FLUSH_TIMEOUT_S``, default
     25 s: inside torchrun's 30 s SIGTERM grace).
A trigger that finds the last round of this epoch finished and no newer step
COMPLETE returns that round's result at once (e.g. torchrun's SIGTERM after a
``peer_failure`` flush): a second round would wait for ranks that have exited.

Restore: ranks agree (through the store) on the newest step that every rank
can load, from its own shared-memory slot, its own files, or (replicated
state, e.g. DDP) a replica's files of the same step. Sharded state with a
missing shard is an error naming the rank and step (raised on every rank),
never a partial restore. The shared filesystem must show every rank the same
``DIR``. Keys are namespaced by job and by ``TORCHELASTIC_RESTART_COUNT``.

Modules: kv (store client), liveness (heartbeats, dead peers), flush_round
(agree, write, commit), restore_vote, events, local (the LocalSnapshots protocol), coordinator (wires them).
The step layout and the COMMIT marker are cudasnap.format.paths and
cudasnap.storage.posix (write_commit, read_commit), shared with one-rank snapshots.

Events (flush_start, agreed, written, committed, restore_start, restored) are
appended with wall-clock times to ``DIR/dist-log.jsonl``.
"""
