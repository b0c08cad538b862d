"""Deliberate engine faults, for testing only."""

# Deliberate faults, for testing only: each gate is shown to catch one of them. Never set
# outside tests; an engine with a fault is wrong by construction.
FAULTS = {
    "skip_state_rollback": "hybrid: keep the Gated DeltaNet state of the whole verified block",
    "skip_length_rollback": "keep every verified position as committed, rejected ones too",
    "feature_off_by_one": "feed the draft, for each committed position, the next one's features",
    "wrong_bonus_position": "take the bonus from the target's choice one slot too far",
    "never_accept_full_block": "reject the last draft token even when it matches",
    "bonus_ignores_residual": "sampling: draw a rejected slot's replacement from p, not p - q",
    "commit_wrong_slot": "engine: commit each row's state into the next row's slot",
    "shared_positions": "engine: give every row of a batched step the first row's positions",
}
