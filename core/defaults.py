"""Defaults that more than one part of kvmesh relies on, defined once (torch-free)."""

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block: the engine's pages, the prefix hashes' unit and the index's granularity."""
DEFAULT_PREFILL_TOK_S = 2000.0
"""A replica's prefill rate before it has measured one (its load report and the routers' pricing)."""
DEFAULT_STEP_S = 0.02
"""A replica's decode step time before it has measured one."""
DEFAULT_MEAN_OUTPUT_TOKENS = 128.0
"""Output tokens a request is expected to generate before a replica has seen any finish."""
PREDICT_TTL_S = 2.0
"""How long a routing decision stands as a prediction of where its blocks will be, until the replica's KV
events reach the index (the serve router's ``p:`` keys; the simulator's predictions, on trace time)."""
ROUTER_LOAD_PERIOD_S = 1.0
"""How long ``kvmesh router`` goes without a worker's load report before it reads one (``GET /load``); a
``kvmesh engine`` sends one with each response, so a busy worker is read far more often. Between two reports a
router sees only the requests it sent itself (and, with ``--redis-url``, those the others sent)."""
