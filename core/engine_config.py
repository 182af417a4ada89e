"""Engine configuration with the defaults a laptop (CPU) and a GPU replica both start well with."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.defaults import DEFAULT_BLOCK_SIZE
from kvmesh.core.kv_dtype import KV_CACHE_DTYPES
from kvmesh.core.model_files import DEFAULT_MODEL
from kvmesh.core.step_timing import StepTiming

DEFAULT_CPU_KV_BYTES = 1 << 30
"""KV budget per replica on CPU: 1 GiB is ~23k tokens of SmolLM2, enough for chat, small enough for 4 replicas."""
PREEMPTION_MODES = ("auto", "swap", "recompute")
MAX_DEFAULT_SWAP_BYTES = 4 << 30
DEFAULT_HOST_CACHE_FRACTION = 2.0
"""On CUDA, the host prefix tier's default size as a multiple of the device KV pool's bytes."""
MAX_DEFAULT_HOST_CACHE_BYTES = 16 << 30
DEFAULT_DISK_CACHE_BYTES = 16 << 30
GPU_KV_FRACTION = 0.85
"""Share of the GPU memory still free after loading weights that goes to the KV pool."""


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    """Exact pool size; ``None`` sizes it from ``kv_cache_bytes`` (or the free GPU memory)."""
    kv_cache_bytes: int | None = None
    swap_space_bytes: int | None = None
    """Host memory for swapped-out sequences' KV; ``None``: half the KV pool, at most 4 GiB; 0: no swapping."""
    host_cache_bytes: int | None = None
    """Host memory that keeps prefix blocks evicted from the device pool, loaded back on a hit when that
    beats recomputing them (``replica/swap.py``); ``None``: on CUDA ``DEFAULT_HOST_CACHE_FRACTION`` of the
    KV pool's bytes, at most 16 GiB; on the CPU off (there it is a second pool in the same memory); 0: off."""
    disk_cache_dir: str | None = None
    """A directory for the disk tier under the host tier (``replica/disk_tier.py``): blocks the host
    tier evicts are kept in files, loaded back on a hit, and adopted by a replica restarted on it. Needs a
    host tier. ``None``: no disk tier."""
    disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES
    """The disk tier's size (files of the least recently used blocks are deleted past it)."""
    preemption_mode: str = "auto"
    """``auto`` (swap a preempted sequence when that is cheaper than recomputing it), ``swap`` (whenever
    the swap space has room) or ``recompute``."""
    kv_cache_dtype: str = "auto"
    """KV storage: ``auto`` (the model dtype), ``fp8_e4m3``/``fp8_e5m2`` (per-head scales), ``int8`` or
    ``int4`` (per-token scales; int4 two per byte, rotated); fp8 holds twice the tokens of a 16-bit cache in
    the same bytes, int4 ``2 * head_dim / (head_dim / 2 + 2)`` times (3.76x at head_dim 64)
    (``kernels/quant.py``)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    """Token budget of one step; prompts longer than this are prefilled in chunks."""
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    """Context limit; ``None`` takes the model's ``max_position_embeddings``."""
    device: str | None = None
    """``None`` picks CUDA when available, else CPU."""
    dtype: str | None = None
    """``float32``/``float16``/``bfloat16``; ``None`` is fp32 on CPU, bf16 on GPU."""
    torch_threads: int | None = None
    """Intra-op threads for this engine; set it when several replicas share a machine's cores."""
    async_scheduling: bool = True
    """Schedule and prepare the next step, and turn the last one's tokens into outputs, while the device runs
    the current one. False runs each step start to end before the next (``LLMEngine.step``)."""
    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs (``replica/cuda_graphs.py``; they capture decode steps on CUDA)."""
    cuda_graph_sizes: list[int] | None = None
    """Decode batch sizes captured as CUDA graphs (a batch runs in the smallest that holds it); None: 1, 2, 4,
    8, then steps of 8 to 64, 16 to 256, 32 beyond, up to ``max_num_seqs``."""
    device_thread: bool = False
    """On the CPU, with ``async_scheduling``, run each step's forward pass in a worker thread so the host's
    work overlaps it. Off by default: the two threads contend for the GIL, which costs more than it saves
    unless a step's forward pass is long next to the host's work (``benchmarks/results/README.md``)."""

    enable_lora: bool = False
    """Serve LoRA adapters of the model beside it (``replica/lora.py``): ``lora_modules`` at start, more loaded
    while running (``LLMEngine.load_lora``); a request names one as its model."""
    lora_modules: dict[str, str] | None = None
    """Adapters to load at start: name -> PEFT directory."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted."""
    max_cpu_loras: int = 8
    """Adapters whose weights are kept in memory (the least recently used are read again when next used)."""
    max_loras: int | None = None
    """Most distinct adapters one step runs (waiting requests on others wait for a running adapter's requests
    to finish; the base model does not count); None: no cap. Fewer adapters per step, faster steps."""

    simulate: StepTiming | None = None
    """Run no model (``replica/simulated.py``): each step sleeps for what this timing model says it costs and
    yields deterministic tokens, over the real scheduler, KV cache manager (device pool; no host tier: preempted
    sequences are recomputed), events and server; for routers
    and autoscalers exercised against many engines without GPUs. A config file may give the timing's fields
    as a mapping, or ``default``."""

    def __post_init__(self) -> None:
        if isinstance(self.simulate, str | dict):
            self.simulate = (
                StepTiming.parse(self.simulate) if isinstance(self.simulate, str) else StepTiming(**self.simulate)
            )
        if self.simulate is not None:
            if self.enable_lora or self.disk_cache_dir is not None or self.host_cache_bytes or self.swap_space_bytes:
                raise ValueError("a simulated engine has no host or disk tier and serves no LoRA adapters")
            self.device, self.swap_space_bytes, self.host_cache_bytes = self.device or "cpu", 0, 0
            self.device_thread = True  # a step's sleep overlaps the host's work, as a GPU's compute does
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            dtypes = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {dtypes}, got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            modes = ", ".join(PREEMPTION_MODES)
            raise ValueError(f"preemption_mode must be one of {modes}, got {self.preemption_mode!r}")
        if self.swap_space_bytes is not None and self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.host_cache_bytes is not None and self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.disk_cache_bytes <= 0:
            raise ValueError(f"disk_cache_bytes must be > 0, got {self.disk_cache_bytes}")
        if self.disk_cache_dir is not None and self.host_cache_bytes == 0:
            raise ValueError("disk_cache_dir needs a host tier (host_cache_bytes > 0): its blocks go through it")
        bs = self.block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two, got {bs}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        for name in ("max_model_len", "torch_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive (or unset for the default), got {value}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_lora_rank < 1 or self.max_cpu_loras < 1 or (self.max_loras is not None and self.max_loras < 1):
            raise ValueError("max_lora_rank, max_cpu_loras and max_loras must be positive")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.cuda_graph_sizes is not None and not all(isinstance(s, int) and s >= 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive integers, got {self.cuda_graph_sizes}")
