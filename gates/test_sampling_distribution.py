"""Gate: at temperature > 0 speculative sampling is lossless in distribution.

1. The pure acceptance rule, in the spirit of vLLM's rejection-sampler test: for random
   target p and draft q, the first committed token's empirical distribution converges to p
   as samples grow (total variation shrinks roughly as 1/sqrt(N)), and stays far from a
   perturbed reference.
2. The engine over the grid: temperature {0.25, 0.7, 1.0, 1.5} x top_k {0, 20} x top_p
   {1.0, 0.5}, on a tiny float64 target with a 32-token vocabulary (so that top-k 20 cuts)
   and block size 4. Per cell, 200 sampled requests of 17 tokens (longer than a block) in
   one batch with mixed prompts, half on the real draft, half on a close proposer that has
   whole blocks accepted (at least 100 full blocks per cell, asserted, so the bonus after a
   full block is drawn and checked). Checked against a reference written in the gate
   (gates/sampling_reference.py): the draft's q and its proposals, every accepted proposal,
   replacement and bonus, every output token and its top-k/top-p support
   (gates/sampling_checks.py).

False alarms: each cell runs TESTS_PER_CELL statistical tests at alpha = 1e-3 / (16 x
TESTS_PER_CELL) each, so a correct engine fails the grid with probability at most 1e-3
(Bonferroni; each test's chi-square or normal bound is conservative or asymptotically
exact). Seeds are fixed, so the gate is deterministic: 1e-3 is the chance that a choice of
seeds would fail a correct engine.
"""

from __future__ import annotations

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.sampling import accept_sampled
from reference_engine.runtime.verify_width import StepCosts

from .conftest import SMALL_VOCAB as VOCAB
from .sampling_checks import TESTS_PER_CELL, CellRun, assert_sampling_lossless, run_cell
from .sampling_reference import Cell

TEMPERATURES = (0.25, 0.7, 1.0, 1.5)
TOP_KS = (0, 20)
TOP_PS = (1.0, 0.5)
GRID = tuple(Cell(t, k, p) for t in TEMPERATURES for k in TOP_KS for p in TOP_PS)
ALPHA = 1e-3 / (len(GRID) * TESTS_PER_CELL)  # per test; the grid's false-alarm rate is 1e-3
GRID_VOCAB = 32
BLOCK_SIZE = 4
ROWS = 200  # sampled requests per cell, one batch
MAX_TOKENS = 17  # output tokens per request: up to four full blocks
MIN_FULL_BLOCKS = 100  # per cell: the bonus after a full block is really drawn
PROMPTS = ((3,), (1, 5), (7, 2, 9, 4, 11), (13, 8, 2))  # ids below both vocabularies


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def empirical_first_token(p, q, n_samples: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = q.shape[0]
    draft = torch.multinomial(q.expand(n_samples, n, VOCAB).reshape(-1, VOCAB), 1, generator=gen).reshape(
        n_samples, n
    )
    accepted, bonus = accept_sampled(
        draft, q.expand(n_samples, n, VOCAB), p.expand(n_samples, n + 1, VOCAB), gen
    )
    first = torch.where(accepted > 0, draft[:, 0], bonus)
    return torch.bincount(first, minlength=VOCAB).double() / n_samples


def test_acceptance_rule_converges_to_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, VOCAB, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(3, VOCAB, generator=gen, dtype=torch.float64) * 2, -1)
    perturbed = torch.softmax(p[0].log() * 0.8, -1)
    distances = [tv(empirical_first_token(p, q, n, seed=1), p[0]) for n in (1000, 10000, 100000)]
    assert distances[0] > distances[1] > distances[2]
    assert distances[2] < 0.01
    assert tv(empirical_first_token(p, q, 100000, seed=2), perturbed) > 5 * distances[2]


@pytest.fixture(scope="module")
def grid_pair(tiny_pair):
    target_dir, draft_dir = tiny_pair(
        "qwen3",
        block_size=BLOCK_SIZE,
        draft_layers=1,
        draft_seed=5,
        seed=3,
        layers=2,
        vocab=GRID_VOCAB,
        with_tokenizer=False,
    )
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


@pytest.fixture(scope="module")
def grid_dflash2_pair(tiny_pair):
    """The grid's target with a DFlash2 draft (K = 8 candidates of the 32 tokens)."""
    target_dir, draft_dir = tiny_pair(
        "qwen3",
        block_size=BLOCK_SIZE,
        draft_layers=1,
        draft_seed=5,
        draft_arch="dflash2",
        seed=3,
        layers=2,
        vocab=GRID_VOCAB,
        with_tokenizer=False,
    )
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


# a DFlash2 draft on the grid's corners and middle: its q lives on the selector's K candidates
DFLASH2_CELLS = (Cell(0.25, 0, 1.0), Cell(0.7, 20, 0.5), Cell(1.0, 0, 1.0), Cell(1.5, 20, 1.0))


def cell_id(cell: Cell) -> str:
    return f"T{cell.temperature}-k{cell.top_k}-p{cell.top_p}"


@pytest.mark.parametrize("cell", GRID, ids=cell_id)
def test_speculative_sampling_is_lossless_over_the_grid(grid_pair, cell: Cell) -> None:
    target, draft = grid_pair
    run = run_cell(target, draft, cell, PROMPTS, ROWS, MAX_TOKENS, BLOCK_SIZE, seed=GRID.index(cell) + 1)
    assert_sampling_lossless(run, ALPHA, MIN_FULL_BLOCKS)


@pytest.mark.parametrize("cell", DFLASH2_CELLS, ids=cell_id)
def test_speculative_sampling_is_lossless_with_a_dflash2_draft(grid_dflash2_pair, cell: Cell) -> None:
    target, draft = grid_dflash2_pair
    run = run_cell(target, draft, cell, PROMPTS, ROWS, MAX_TOKENS, BLOCK_SIZE, seed=GRID.index(cell) + 1)
    assert_sampling_lossless(run, ALPHA, MIN_FULL_BLOCKS)


def test_sampling_gate_catches_a_dflash2_walk_that_draws_from_the_wrong_row(grid_dflash2_pair) -> None:
    target, draft = grid_dflash2_pair
    cell = Cell(1.0, 0, 1.0)
    fault = "dflash2_sampled_walk_ignores_predecessor"
    run = run_cell(
        target, draft, cell, PROMPTS, ROWS, MAX_TOKENS, BLOCK_SIZE, seed=GRID.index(cell) + 1, fault=fault
    )
    with pytest.raises(AssertionError, match="the draft's q differs"):
        assert_sampling_lossless(run, ALPHA, MIN_FULL_BLOCKS)


ENGINE_CELL = Cell(1.0, 6, 1.0)  # the cell run on other pairs and engine settings


def engine_cell(target, draft, seed: int, fault: str | None = None, **engine) -> CellRun:
    """ENGINE_CELL's run on another pair (the small-vocabulary pair of gates/conftest.py,
    block size 4), with `engine`'s settings for run_cell (step costs, greedy neighbours)."""
    return run_cell(
        target, draft, ENGINE_CELL, PROMPTS, ROWS, MAX_TOKENS, BLOCK_SIZE, seed=seed, fault=fault, **engine
    )


def assert_engine_sampling_lossless(target, draft, fault: str | None = None) -> None:
    """ENGINE_CELL (T = 1, top-k 6) with the grid's checks on another pair."""
    assert_sampling_lossless(engine_cell(target, draft, len(GRID) + 1, fault), ALPHA, MIN_FULL_BLOCKS)


def test_engine_speculative_sampling_matches_plain_sampling(small_vocab_pair) -> None:
    target, draft = small_vocab_pair
    assert_engine_sampling_lossless(target, draft)


# verify widths where a plain step (width 0) mostly wins
PLAIN_MOSTLY = StepCosts({(1, 0): 1.0, (1, 1): 1.8, (1, 3): 3.3}, measured=True)
GREEDY_NEIGHBOURS = 40


def assert_sampled_rows_lossless_beside_greedy_rows(target, draft, fault: str | None = None) -> None:
    """ENGINE_CELL (T = 1, top-k 6) with greedy requests in the batch and step costs under which
    the engine takes plain steps (width 0) and drafts now and then: the sampled rows' tokens
    of plain steps, of narrowed verifies and of full ones follow the target's distribution."""
    run = engine_cell(
        target, draft, len(GRID) + 2, fault, step_costs=PLAIN_MOSTLY, greedy_rows=GREEDY_NEIGHBOURS
    )
    widths = run.verify_widths
    # not vacuous: mostly plain steps, a narrowed verify and a full one ({0: 31, 1: 1, 3: 1} here)
    assert {0, 1, 3} <= set(widths) and widths[0] >= 20, widths
    assert_sampling_lossless(run, ALPHA, min_full_blocks=0)


def test_sampled_rows_are_lossless_through_plain_steps_beside_greedy_rows(small_vocab_pair) -> None:
    target, draft = small_vocab_pair
    assert_sampled_rows_lossless_beside_greedy_rows(target, draft)


@pytest.mark.parametrize(
    ("fault", "check"),
    [
        ("plain_step_for_any_greedy_row", "output tokens"),
        # lossless: the steps' records (acceptance statistics) are what it breaks
        ("plain_steps_counted_as_speculative", "speculative steps but drafted"),
    ],
)
def test_sampling_gate_catches_faults_of_plain_steps_beside_greedy_rows(
    small_vocab_pair, fault: str, check: str
) -> None:
    target, draft = small_vocab_pair
    with pytest.raises(AssertionError, match=check):
        assert_sampled_rows_lossless_beside_greedy_rows(target, draft, fault)


CATCHES = (
    "plain_step_for_any_greedy_row",
    "plain_steps_counted_as_speculative",
    "full_block_bonus_from_last_draft_slot",
    "draft_q_at_temperature_one",
    "bonus_ignores_residual",
    "dflash2_sampled_walk_ignores_predecessor",
)


@pytest.mark.parametrize(
    ("fault", "cell", "check"),
    [
        pytest.param(
            "full_block_bonus_from_last_draft_slot",
            Cell(1.0, 0, 1.0),
            "joint distribution",
            id="full_block_bonus_from_last_draft_slot",
        ),
        # lossless (output, bonuses, replacements and acceptance pass): only the draft checks see it
        pytest.param(
            "draft_q_at_temperature_one",
            Cell(0.7, 20, 0.5),
            "the draft's q differs",
            id="draft_q_at_temperature_one",
        ),
        pytest.param(
            "bonus_ignores_residual", Cell(1.5, 0, 1.0), "joint distribution", id="bonus_ignores_residual"
        ),
    ],
)
def test_sampling_gate_catches_planted_faults(grid_pair, fault: str, cell: Cell, check: str) -> None:
    target, draft = grid_pair
    run = run_cell(
        target, draft, cell, PROMPTS, ROWS, MAX_TOKENS, BLOCK_SIZE, seed=GRID.index(cell) + 1, fault=fault
    )
    with pytest.raises(AssertionError, match=check):
        assert_sampling_lossless(run, ALPHA, MIN_FULL_BLOCKS)
