"""What stands in front of engines for one served model, without Ray: the ingress's settings
(``IngressSettings``) and its ``Generation`` and ``Admission`` (``front_door``). The Serve ingress
(``cluster/ingress/deployment.py``), ``kvmesh engine`` and ``kvmesh router`` all build theirs here; only the
first imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.cluster.ingress.admission import Admission
from kvmesh.cluster.ingress.generation import LOCAL_HANDLE_ERRORS, Generation, HandleErrors, ModelLimits
from kvmesh.cluster.monitoring import metrics
from kvmesh.core.limits import prompt_byte_limit, request_body_limit
from kvmesh.core.model_files import load_tokenizer, max_context, max_token_bytes, resolve_model_dir, vocab_size
from kvmesh.core.sampling_params import MAX_N


@dataclass
class IngressSettings:
    """What the ingress must agree on with the engines (hash seed, block size) and what it serves as."""

    model: str
    """The model id the engines were configured with: it seeds the block hashes."""
    served_model_name: str
    block_size: int
    max_model_len: int | None = None
    max_n: int = MAX_N
    """The most choices a request may ask for: fewer than ``MAX_N`` when a replica runs fewer sequences at once
    (its ``max_num_seqs``), since a request's choices run together on one replica."""
    redis_url: str | None = None
    """The index's Redis; None reads ``$KVMESH_REDIS_URL`` (how ``kvmesh serve`` and Kubernetes pass it, so
    the password never travels in deployment arguments)."""
    deployment: str = "kvmesh"
    policy: str = "kv_aware"
    api_key_digests: list[str] = field(default_factory=list)
    max_inflight_requests: int = 0
    max_request_bytes: int | None = None
    """Largest request body (HTTP and gRPC); None derives it from the context length."""
    grpc_host: str | None = None
    grpc_port: int | None = None
    """Where this ingress serves gRPC itself (``kvmesh serve``); None: not at all (Ray's gRPC proxy may)."""
    share_prefix_cache: bool = False
    """With API keys, each key's requests hash into a prefix cache of their own unless this is set."""
    enable_docs: bool = False
    no_replica_timeout_s: float = 5.0
    """How long a request waits while no engine replica is alive before its 503."""
    enable_lora: bool = False
    """The engines serve LoRA adapters: a request's ``model`` may name one, and the load and unload routes work."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """Adapters served from the start, name -> PEFT directory (the engines were given the same)."""
    lora_roots: list[str] = field(default_factory=list)
    """The directories ``POST /v1/load_lora_adapter`` may load adapters from (none given: it loads nothing)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")


def front_door(
    s: IngressSettings, engine_handle, errors: HandleErrors = LOCAL_HANDLE_ERRORS
) -> tuple[Generation, Admission]:
    """The ``Generation`` over ``engine_handle`` and the ``Admission`` limits of one served model: what an
    ingress and a single-engine server (``cluster/engines/engine_server.py``) put in front of engines.
    ``errors``: what ``engine_handle`` raises when a replica fails or every one is busy."""
    model_dir = resolve_model_dir(s.model, weights=False)  # tokenizer and config only
    tokenizer = load_tokenizer(model_dir)
    max_model_len = s.max_model_len or max_context(model_dir)
    token_bytes = max_token_bytes(tokenizer)
    limits = ModelLimits(
        names={s.served_model_name, s.model},
        served_name=s.served_model_name,
        vocab_size=vocab_size(model_dir),
        max_model_len=max_model_len,
        max_prompt_bytes=prompt_byte_limit(max_model_len, token_bytes),
        max_n=s.max_n,
    )
    generation = Generation(
        engine_handle, tokenizer, s.model, s.block_size, limits, s.share_prefix_cache, s.no_replica_timeout_s, errors
    )
    generation.adapters.update(s.lora_modules)
    admission = Admission(
        s.api_key_digests,
        s.max_inflight_requests,
        s.max_request_bytes or request_body_limit(max_model_len, token_bytes),
        on_refused=lambda reason: metrics.REFUSED.labels(reason).inc(),
        enable_docs=s.enable_docs,
    )
    return generation, admission
