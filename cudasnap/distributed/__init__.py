"""Multi-rank jobs on torch.distributed: agreed flush step, global commit, replica restore.

torch.distributed (the c10d store of the default process group) and torchrun's
elastic restart are the engine; cudasnap adds no launcher or rendezvous. The
store must outlive any one rank: torchrun's agent store, or a FileStore
(``init_method="file://..."``, one file per restart attempt: torchrun's shared
store keeps the previous attempt's process-group keys, pytorch#135712, see
``kv.restarts_share_the_store``). A TCPStore hosted by rank 0's own process dies
with rank 0, and with it the coordination (``kv.store_lost``).

Liveness. Per rank, every ``heartbeat_s`` a monitor thread publishes
``hb/<rank> = seq:last_step:complete_steps`` in the store (a clone of the
default store: its own connection) and reads the others'. A peer is dead when
its heartbeat stops for ``peer_timeout_s`` (``CUDASNAP_PEER_TIMEOUT_S``; a
SIGSTOPped or otherwise frozen process) or, once its heartbeat lags, at once when
its presence port refuses a connection (its process is gone, on any node, in any pid
namespace: see liveness). A peer that never
sent a heartbeat is not timed out (it may still be starting). Newly dead
peers trigger ``peer_failure`` on the survivors (default policy: flush, exit
79). Flushes requested by the monitor run on a separate action thread, so
heartbeats continue during a flush.

Flush round ``g``: agree on the newest step COMPLETE on every rank (dead ranks counted
with their arenas), write the per-rank files, commit; the protocol is described once, in
:mod:`cudasnap.distributed.flush_round`. Restore: every rank loads the same step (its own
shared-memory slot, its files, or a replica's files), or none does: see
:mod:`cudasnap.distributed.restore_vote`. The shared filesystem must show every rank the same
``DIR``. Keys are namespaced by job and by ``TORCHELASTIC_RESTART_COUNT``.

Modules: kv (store client), liveness (heartbeats, presence ports, dead peers), flush_round
(agree, write, commit), rank_files (a rank's directory from a slot), held_copies (a round
writes a lost node's ranks from the copies a survivor holds), restore_vote, events, local (the
LocalSnapshots protocol), coordinator (wires them), replica / replica_store / replica_wire
(node-loss replication into a partner node's memory), parity / parity_rounds /
parity_rebuild (``node_replica="xor:K"``: XOR parity across groups of K nodes instead).
The step layout and the COMMIT marker are cudasnap.format.paths and
cudasnap.storage.posix (write_commit) and .listing (read_commit), shared with one-rank snapshots.

Events (flush_start, agreed, written, committed, restore_start, restored) are
appended with wall-clock times to ``DIR/dist-log.jsonl``.
"""
