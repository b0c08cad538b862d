"""The engine's configuration: one frozen dataclass, validated when built."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from ..errors import ConfigError
from ..kernels import NUMERICS
from ..models import CausalLM
from ..models.dflash import DFlashDraft
from .commit import check_strategy
from .verify_width import VERIFY_WIDTHS

ADMISSION_POLICIES = ("wait", "reject")
DRAFT_SPANS = ("block", "verify")


# the settings that count something: whole numbers (or None where None is allowed)
_COUNTS = (
    "max_num_seqs",
    "prefill_chunk",
    "max_num_batched_tokens",
    "block_size",
    "fallback_after_steps",
    "max_waiting",
    "kv_cache_tokens",
    "kv_cell_tokens",
    "checkpoint_every",
    "steps_per_turn",
    "max_model_len",
)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # slots, preallocated
    max_model_len: int | None = None  # default: the target's max_position_embeddings
    block_size: int | None = None  # DFlash block size; None with a draft: the draft's
    commit_strategy: str = "replay"
    prefill_chunk: int = 2048
    # target tokens a step may run (vLLM's name): the running requests' decode and verify tokens
    # plus the prefill chunks that fit beside them (scheduler.py); None: every prefilling
    # request runs one chunk per step. The oldest prefilling request's chunk always runs.
    max_num_batched_tokens: int | None = None
    # "wait": queue; "reject": refuse a request that would wait (no free slot, or with a
    # pooled KV cache no free run of cells for it)
    admission: str = "wait"
    max_waiting: int = 1024  # queued requests beyond the free slots
    # fallback to plain decode when a request's mean acceptance length stays below this
    # after `fallback_after_steps` steps; None disables it (the default, as in the gates)
    fallback_min_acceptance: float | None = None
    fallback_after_steps: int = 8
    # kernels: "exact" (batch- and verify-invariant, bit-exact DFlash in bf16 on CUDA) or
    # "fast" (cuBLAS GEMMs, kernels/triton_ops.VENDOR); None: exact on CUDA. On the CPU the
    # PyTorch references run.
    numerics: str | None = None
    # run every forward eagerly; by default the decode, draft, verify and commit of both
    # numerics on CUDA replay CUDA graphs captured at start-up (graphs.py)
    enforce_eager: bool = False
    # CUDA: the share of the device's memory the engine may use (vLLM's meaning; memory.py):
    # a state that does not fit is refused at start; None allocates the state unchecked (and
    # on the CPU it is never checked)
    gpu_memory_utilization: float | None = None
    # how many draft tokens a step verifies (verify_width.py): "auto" picks the width with the
    # most committed tokens per second from the requests' acceptance and the measured step
    # costs; "fixed" verifies all B-1. Output is the same either way.
    verify_width: str = "auto"
    # without CUDA graphs (the CPU, enforce_eager), time whole speculative steps at start-up
    # so that verify_width "auto" weighs real costs (with graphs they are always
    # measured); off, every width costs the same there and "auto" verifies the full block
    measure_step_costs: bool = False
    # a pooled KV cache (kv_pool.py): tokens of KV cache all requests share, in cells of
    # kv_cell_tokens; a request takes the cells its prompt, max_tokens and one block need.
    # None: every slot holds the whole room (max_model_len + one block), as without a pool
    kv_cache_tokens: int | None = None
    kv_cell_tokens: int = 256
    # the `per_token` commit's checkpoints (state.py): a verify keeps the Gated DeltaNet state
    # every this many block tokens and the commit runs a row on from one over fewer than that;
    # None: state.checkpoint_every (8 on the Triton path; none on the references, whose verify
    # keeps the rows each token writes and whose commit makes the state from them, recompute's
    # bits; one given there still gives plain greedy's output but no longer recompute's bits)
    checkpoint_every: int | None = None
    # on CUDA, time each phase on the device as well (two CUDA events a phase, read once they
    # complete: stats()["phases"]' device_s_*); off, the phases are timed on the host alone.
    # The events are host work every step (about 8% of a DFlash server's engine-process
    # profile samples at c16 on the demo pair, on an H100), so the server leaves them off
    # unless asked (--device-phase-times)
    device_phase_times: bool = True
    # speculative steps of the same rows a turn queues before the host reads their results
    # (SpeculativeStep.turn; docs/engine.md, "Steps per turn"): a request that ends in a turn
    # leaves its row idle to the turn's end, and one that arrives joins at the next turn.
    # Output is the same at any count; 1 (the default) reads every step's results
    steps_per_turn: int = 1
    # the positions a draft forward runs (DRAFT_SPANS): "block", the anchor and all B-1 mask
    # tokens, as DFlash drafts are trained; "verify", the anchor and only as many mask tokens
    # as the step's verify checks (verify_width), a smaller forward whose proposals differ
    # (its block attention sees fewer positions), for drafts trained on shorter blocks too.
    # Output is the same either way. Eager forwards only: the captured drafts run whole blocks
    draft_span: str = "block"

    def __post_init__(self) -> None:
        for name in _COUNTS:  # a fraction would fail later, inside a step, as a slice's TypeError
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise ConfigError(f"{name} must be a whole number, got {value!r}")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.prefill_chunk <= 0:
            raise ConfigError(f"prefill_chunk must be positive, got {self.prefill_chunk}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.prefill_chunk:
            raise ConfigError(
                f"max_num_batched_tokens must be at least prefill_chunk ({self.prefill_chunk}), got "
                f"{self.max_num_batched_tokens}: a step runs whole chunks"
            )
        if self.admission not in ADMISSION_POLICIES:
            raise ConfigError(
                f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}"
            )
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"block size must be >= 2, got {self.block_size}")
        check_strategy(self.commit_strategy)
        if self.verify_width not in VERIFY_WIDTHS:
            raise ConfigError(
                f"verify_width must be one of {', '.join(VERIFY_WIDTHS)}, got {self.verify_width!r}"
            )
        if self.fallback_after_steps <= 0:
            raise ConfigError(f"fallback_after_steps must be positive, got {self.fallback_after_steps}")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.numerics is not None and self.numerics not in NUMERICS:
            raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens <= 0:
            raise ConfigError(f"kv_cache_tokens must be positive, got {self.kv_cache_tokens}")
        if self.kv_cell_tokens <= 0:
            raise ConfigError(f"kv_cell_tokens must be positive, got {self.kv_cell_tokens}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.draft_span not in DRAFT_SPANS:
            raise ConfigError(f"draft_span must be one of {', '.join(DRAFT_SPANS)}, got {self.draft_span!r}")
        if self.steps_per_turn < 1:
            raise ConfigError(f"steps_per_turn must be >= 1, got {self.steps_per_turn}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def block_size_for(self, target: CausalLM, draft: DFlashDraft | None) -> int:
        """The DFlash block size with this draft (0 without one): the configured one, else
        the draft's; the draft must fit the target."""
        if draft is None:
            return 0
        draft.config.check_target(target.config)
        block_size = self.block_size or draft.config.block_size
        if block_size > draft.config.block_size:
            raise ConfigError(
                f"block size {block_size} is larger than the draft supports ({draft.config.block_size})"
            )
        return block_size
