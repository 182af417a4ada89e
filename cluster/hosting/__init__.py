"""Where a process runs: this node's address and cores, a replica's rank and threads, node preparation, sockets."""
