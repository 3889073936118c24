"""The earlier home of multi-process runs, kept so its names keep working: joining processes and agreeing on a
step's outcome are in `localleap_jax.processes`; the leader/follower protocol in `localleap_jax.dist.multihost`
and its messages in `localleap_jax.dist.messages`."""

from localleap_jax.dist.messages import BroadcastTransport, Message, pack, receive, send, unpack
from localleap_jax.dist.multihost import (Follower, Leader, follow, follow_until_stopped, leader, leading, load,
                                          mesh_for_run, mesh_shape)
from localleap_jax.processes import (EXIT_LOST, FLAGS, DistributedError, LostProcessError, Processes, all_succeed,
                                     exit_lost, initialize, is_follower, is_multiprocess, process_count, process_index,
                                     processes_from, signals_deferred)

__all__ = ["BroadcastTransport", "DistributedError", "EXIT_LOST", "FLAGS", "Follower", "Leader", "LostProcessError",
           "Message", "Processes", "all_succeed", "exit_lost", "follow", "follow_until_stopped", "initialize",
           "is_follower", "is_multiprocess", "leader", "leading", "load", "mesh_for_run", "mesh_shape", "pack",
           "process_count", "process_index", "processes_from", "receive", "send", "signals_deferred", "unpack"]
