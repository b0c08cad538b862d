"""The runtime's memory and fixed-shape machinery at its edges, on the CPU:

- the pooled KV cache's runs of cells (runtime/kv_pool.py) and the memory plan
  (runtime/memory.py): a state of exactly the budget, the numbers a refusal names when
  even one request does not fit (a pooled refusal advising whole cells), the weights' bytes
  with their buffers, a state that costs nothing per token, and a run of no cells refused.
- host memory (runtime/host_memory.py): every malloc setting of the environment is the
  user's, both thresholds must be taken, and only Linux's C library is asked.
- CUDA-graph bookkeeping (runtime/graphs.py): the batch buckets of a few slots, a last
  chunk that fills its token bucket exactly, the padding rows of a batched prefill, the
  draft head after an eager draft, and the garbage collector around a capture. Stand-in
  graphs record their replays, as in test_graphs.py.
- tensor parallelism (runtime/tensor_parallel.py): a group of one process, a launch
  without torchrun's RANK (or with one that is not a number) refused in one line, the
  process that leads, the device of a rank off CUDA, and which size a plan names first.
- the host-to-device copies (runtime/transfer.py) and the per-slot state
  (runtime/state.py): the dtype asked for, numbers past int64, and a slot placed in a
  pooled cache.
"""

from __future__ import annotations

import gc
import re
from dataclasses import replace

import pytest
import torch
from torch import nn

from reference_engine.bench.shapes import TARGET_SHAPES
from reference_engine.config import TargetConfig
from reference_engine.errors import ConfigError, RequestError
from reference_engine.models import expected_shapes
from reference_engine.runtime import host_memory
from reference_engine.runtime.forwards import DraftHidden, Logits, Proposals
from reference_engine.runtime.graphs import EngineGraphs, _Graph, buckets_up_to, collector_paused, padded_end
from reference_engine.runtime.kv_pool import CellAllocator, PoolLayout
from reference_engine.runtime.memory import GiB, StateCost, plan_memory, weight_bytes
from reference_engine.runtime.state import TargetState
from reference_engine.runtime.tensor_parallel import (
    VOCAB_PARALLEL,
    TensorParallel,
    init_tensor_parallel,
    leads,
    rank_device,
    shard_plan,
)
from reference_engine.runtime.transfer import int64_tensor, to_device

PAD = 9


# ----------------------------------------------------------------------------- memory plan
def plan(**overrides):
    """A card of 100 GiB at F = 1, 16 GiB of weights and 2 of activations: 82 GiB of budget,
    1 KiB a token."""
    args = {
        "total": 100 * GiB,
        "utilization": 1.0,
        "weights": 16 * GiB,
        "activations": 2 * GiB,
        "cost": StateCost(per_token=1024, per_slot=0),
        "slots": 4,
        "room": 1000,
        "max_num_seqs": 3,
        "max_model_len": 984,
    }
    return plan_memory(**{**args, **overrides})


def refusal(**overrides) -> str:
    with pytest.raises(ConfigError) as info:
        plan(**overrides)
    return str(info.value)


def test_slots_of_exactly_the_budget_fit_and_one_token_more_is_refused() -> None:
    """Without a pool: 4 slots whose rooms take the whole 82 GiB are accepted, a room of one
    token more is not."""
    room = 82 * GiB // 1024 // 4
    exact = plan(room=room, max_model_len=room - 16)
    assert exact.state == exact.budget == 82 * GiB
    assert "max_num_seqs 3 x max_model_len" in refusal(room=room + 1, max_model_len=room - 15)


def test_the_pooled_refusal_names_the_states_slots_and_never_a_negative_pool() -> None:
    """A pooled state that does not fit names the slots it was sized for and its per-slot
    cost; a budget that holds less than the spare room advises at most 0 tokens, not a
    negative count."""
    cost = StateCost(per_token=GiB, per_slot=1000)
    message = refusal(cost=cost, slots=65, room=100, pool_rows=200)
    assert "(+ 1000 per slot for 65 slots)" in message
    assert "holds 81 tokens" in message and "lower --kv-cache-tokens (at most 0 fits" in message


def test_the_refusal_advises_no_negative_context_when_a_slot_holds_less_than_a_block() -> None:
    """When the budget spread over the slots is less than one block, the largest context
    that fits is 0, not a negative number."""
    cost = StateCost(per_token=GiB, per_slot=0)
    message = refusal(cost=cost, slots=17, room=16 + 100, max_num_seqs=16, max_model_len=100)
    assert "holds 82 tokens over 17 slots" in message
    assert "(at most 0 fits)" in message and "-" not in message.split("at most")[1].split("fits")[0]


def test_a_state_with_no_per_token_cost_is_weighed_by_its_slots() -> None:
    """A state that costs nothing per token (no KV cache) but whose slots pass the budget is
    refused as holding 0 tokens, not by a division by zero."""
    cost = StateCost(per_token=0, per_slot=30 * GiB)
    assert "holds 0 tokens over 4 slots" in refusal(cost=cost)
    assert plan(cost=StateCost(per_token=0, per_slot=GiB)).tokens_that_fit == 0


def test_the_weights_bytes_count_the_modules_buffers_beside_their_parameters() -> None:
    """A module's buffers (rotary tables, norms kept as buffers) take device memory as its
    parameters do."""
    module = nn.Linear(4, 3, bias=False)
    module.register_buffer("table", torch.zeros(10, dtype=torch.float64))
    assert weight_bytes(module) == 4 * 3 * 4 + 10 * 8
    assert weight_bytes(None, module) == weight_bytes(module)


def test_the_kv_cache_tokens_a_pooled_refusal_advises_fit() -> None:
    """Taking the refusal's advice (at most N tokens, laid out in whole cells of 256) gives a
    pool that fits the budget."""
    big = PoolLayout.for_tokens(10**8, 256, 1000)
    message = refusal(pool_rows=big.rows, cell_tokens=256)
    advised = int(re.search(r"at most (\d+) fits", message).group(1))
    assert advised > 0 and advised % 256 == 0
    layout = PoolLayout.for_tokens(advised, 256, 1000)
    plan(pool_rows=layout.rows, cell_tokens=256)
    # a cell more than the advice does not fit
    refusal(pool_rows=PoolLayout.for_tokens(advised + 1, 256, 1000).rows, cell_tokens=256)


# ----------------------------------------------------------------------------- KV pool
def test_a_run_of_no_cells_is_refused_and_leaves_the_live_runs_alone() -> None:
    cells = CellAllocator(8)
    assert cells.allocate(4) == 0
    with pytest.raises(ValueError):
        cells.allocate(0)
    assert cells.runs == {0: 4} and cells.free_cells == 4


# ----------------------------------------------------------------------------- host memory
class AnsweringLibc:
    """glibc's mallopt, answering `answers[param]` (1: taken) and recording each call."""

    def __init__(self, answers: dict[int, int]) -> None:
        self.answers, self.calls = answers, []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answers.get(param, 1)


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch):
    """keep_freed_memory as if not called yet, no malloc setting in the environment."""
    monkeypatch.setattr(host_memory, "_applied", None)
    for name in host_memory.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)

    def with_libc(answers: dict[int, int]) -> AnsweringLibc:
        libc = AnsweringLibc(answers)
        monkeypatch.setattr(host_memory, "glibc", lambda: libc)
        return libc

    return with_libc


def test_an_mmap_threshold_in_the_environment_leaves_malloc_alone(fresh_process, monkeypatch) -> None:
    libc = fresh_process({})
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host_memory.keep_freed_memory() is False and libc.calls == []


def test_a_trim_threshold_glibc_refuses_reports_the_settings_as_not_applied(fresh_process) -> None:
    """Both thresholds must be taken: the mmap threshold taken and the trim threshold
    refused is not applied."""
    libc = fresh_process({host_memory.M_TRIM_THRESHOLD: 0})
    assert host_memory.keep_freed_memory() is False
    assert [param for param, _ in libc.calls] == [host_memory.M_MMAP_THRESHOLD, host_memory.M_TRIM_THRESHOLD]


def test_only_linuxs_c_library_is_taken_for_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    """On another system a C library with a gnu_get_libc_version is still not glibc."""
    import ctypes

    class LooksLikeGlibc:
        gnu_get_libc_version = staticmethod(lambda: b"2.35")

    monkeypatch.setattr(ctypes, "CDLL", lambda name: LooksLikeGlibc())
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")
    assert host_memory.glibc() is None
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    assert isinstance(host_memory.glibc(), LooksLikeGlibc)


# ----------------------------------------------------------------------------- graphs
class Recorded:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(self.name)


def bare_graphs(buckets: tuple[int, ...], block_size: int = 4, max_len: int = 64) -> EngineGraphs:
    """An EngineGraphs with no graph captured yet, on the CPU, its spare slot PAD."""
    g = EngineGraphs.__new__(EngineGraphs)
    g.pad_slot, g.device, g.buckets, g.block_size = PAD, torch.device("cpu"), buckets, block_size
    g._paddings = {}
    g.decode_graphs, g.draft_graphs, g.draft_head_graphs, g.verify_graphs = {}, {}, {}, {}
    g.prefill_graphs = {}
    g.verified = g.accepted = g.drafted = None
    g.state = type("State", (), {"max_len": max_len})()
    g.draft = None
    return g


@pytest.mark.parametrize(
    ("slots", "buckets"),
    [(2, (1, 2)), (3, (1, 2, 3)), (5, (1, 2, 4, 5)), (64, (1, 2, 4, 8, 16, 32, 64))],
)
def test_the_buckets_of_a_few_slots_end_at_the_slots(slots: int, buckets: tuple[int, ...]) -> None:
    """Every power of two below the slots, then the slots themselves."""
    assert buckets_up_to(slots) == buckets
    assert buckets_up_to(100) == (1, 2, 4, 8, 16, 32, 64, 100)


def test_a_last_chunk_that_fills_its_token_bucket_is_not_padded_further() -> None:
    """A last chunk of exactly 16 or 32 tokens takes the bucket of its own size."""
    assert padded_end(80, 64, 200) == 80
    assert padded_end(96, 64, 200) == 96
    assert padded_end(16, 64, 200) == 16


def test_the_padding_rows_of_a_batched_prefill_sit_on_the_spare_slot_from_position_zero() -> None:
    """One chunk in a bucket of 2 rows x 16 tokens: its row padded to 16 tokens, and the
    padding row all zeros, at positions 0..15, on the spare slot with one valid token."""
    log: list[str] = []
    g = bare_graphs((1, 2))
    inputs = g.static_inputs(2, 16)
    g.prefill_graphs = {(2, 16): _Graph(Recorded("prefill", log), inputs, Logits(torch.zeros(2, 5)))}
    out = g.prefill([([4, 5, 6], 7, 3)])
    assert log == ["prefill"] and out.logits.shape == (1, 5)
    assert inputs.ids.tolist() == [[4, 5, 6, *[0] * 13], [0] * 16]
    assert inputs.positions.tolist() == [list(range(7, 23)), list(range(16))]
    assert inputs.slots.tolist() == [3, PAD] and inputs.valid.tolist() == [3, 1]


def test_an_eager_draft_leaves_no_captured_head_to_replay() -> None:
    """After a draft replayed in bucket 4, a draft of a block no graph holds runs eagerly:
    the bucket's head graph, which reads the earlier draft's output, is not replayed."""
    log: list[str] = []
    g = bare_graphs((4,))
    inputs = g.static_inputs(4, 4)
    g.draft_graphs[4, 4] = _Graph(Recorded("draft", log), inputs, DraftHidden(torch.zeros(4, 4, 2)))
    head = Proposals(torch.zeros(4, 2, 3), torch.zeros(4, 2, dtype=torch.int64))
    g.draft_head_graphs[4, 2] = _Graph(Recorded("head", log), inputs, head)
    ids = torch.ones(3, 4, dtype=torch.int64)
    assert g.propose(ids, ids, torch.arange(3), torch.full((3,), 4), width=2) is not None
    assert g.drafted == 4 and log == ["draft", "head"]
    short = ids[:, :3]
    assert g.propose(short, short, torch.arange(3), torch.full((3,), 3), width=2) is None
    assert g.drafted is None and g.draft_head(3, 2) is None and log == ["draft", "head"]


def test_a_capture_leaves_a_disabled_collector_disabled() -> None:
    """The collector is paused around a capture and given back as it was: one the caller
    had disabled stays disabled."""
    enabled = gc.isenabled()
    try:
        gc.disable()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
        gc.enable()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
    finally:
        (gc.enable if enabled else gc.disable)()


# ----------------------------------------------------------------------------- tensor parallelism
def test_a_size_of_one_in_a_group_of_several_processes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started two processes for a size of 1: refused, not run twice as two engines."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RequestError, match="--tensor-parallel-size 1 needs 1 processes"):
        init_tensor_parallel(1, torch.device("cpu"), "exact", "generate")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_tensor_parallel(1, torch.device("cpu"), "exact", "generate") is None


def test_a_group_without_a_rank_in_the_environment_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RequestError, match="RANK is not set in the environment; launch with `torchrun"):
        init_tensor_parallel(2, torch.device("cpu"), "exact", "generate")
    monkeypatch.setenv("RANK", "first")
    with pytest.raises(RequestError, match="RANK is 'first', not a whole number"):
        init_tensor_parallel(2, torch.device("cpu"), "exact", "generate")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RequestError, match="WORLD_SIZE is 'two'"):
        init_tensor_parallel(2, torch.device("cpu"), "exact", "generate")


def test_a_process_on_its_own_leads_and_a_cpu_rank_stays_on_the_cpu() -> None:
    """Without a process group the process prints and serves; a rank's device off CUDA is
    the device asked for."""
    assert leads() is True
    cpu = torch.device("cpu")
    assert rank_device(cpu, TensorParallel(1, 2, "exact")) == cpu
    assert rank_device(cpu, None) == cpu


def test_a_plan_names_the_layers_sizes_before_the_vocabularys() -> None:
    """A target whose heads and vocabulary both fail to divide over 3 ranks is refused for
    its heads; the plan itself lists the vocabulary-parallel tensors last."""
    config = TargetConfig.from_hf(TARGET_SHAPES["qwen3.5-4b"])
    odd = replace(config, vocab_size=config.vocab_size + 1)
    with pytest.raises(ConfigError) as info:
        shard_plan(odd, expected_shapes(odd), TensorParallel(0, 3, "exact"))
    assert "is not a multiple of --tensor-parallel-size 3" in str(info.value)
    assert "vocab_size" not in str(info.value)
    names = list(shard_plan(config, expected_shapes(config), TensorParallel(0, 2, "exact")))
    vocab = [name for name in names if name in VOCAB_PARALLEL]
    assert vocab and names[-len(vocab) :] == vocab


# ----------------------------------------------------------------------------- transfer and state
def test_values_reach_the_device_in_the_dtype_asked_for() -> None:
    """Ints asked for as floats come as floats (the int64 fast way is for int64 alone)."""
    t = to_device([1, 2, 3], "cpu", torch.float32)
    assert t.dtype == torch.float32 and t.tolist() == [1.0, 2.0, 3.0]
    assert to_device([[1, 2]], "cpu", torch.int32).dtype == torch.int32


def test_a_number_past_int64_is_left_to_torch() -> None:
    """The fast way takes no number past int64: it gives None for torch.tensor to judge."""
    assert int64_tensor([2**63]) is None and int64_tensor([1, -(2**63) - 1]) is None
    assert int64_tensor([]) is None and int64_tensor([2**63 - 1]).tolist() == [2**63 - 1]


def test_a_slot_placed_in_a_pooled_cache_must_be_one_of_the_states(qwen3_checkpoint) -> None:
    """Placing a slot the state does not have is refused by name, and moves no other slot."""
    from reference_engine.checkpoint import load_target

    config = load_target(qwen3_checkpoint, dtype=torch.float32).config
    pool = PoolLayout(cells=4, cell_tokens=16, room=32)
    state = TargetState(config, 2, 32, torch.float32, "cpu", pool=pool)
    state.place(1, 2)
    assert state.cell_of.tolist() == [4, 2]
    for slot in (2, -1):
        with pytest.raises(RequestError, match=rf"slot {slot} out of range \[0, 2\)"):
            state.place(slot, 0)
    assert state.cell_of.tolist() == [4, 2]
    assert state.cache_rows(torch.tensor([1, 0])).tolist() == [2, 4]
