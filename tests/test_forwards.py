"""The typed outputs of the engine's forwards (runtime/forwards.py): a bucket's first rows."""

from __future__ import annotations

import torch

from reference_engine.runtime.forwards import Logits, Proposals, Verified


def outputs(rows: int) -> list:
    return [
        Logits(torch.randn(rows, 11), torch.arange(rows)),
        Logits(torch.randn(rows, 11)),  # no tokens: left None
        Proposals(torch.randn(rows, 3, 11), torch.randint(0, 11, (rows, 3))),
        Verified(torch.randn(rows, 4, 11), torch.randn(rows, 4, 6), torch.randint(0, 11, (rows, 4))),
    ]


def test_head_keeps_the_first_rows_of_every_tensor_and_is_the_output_itself_when_full() -> None:
    for out in outputs(8):
        assert out.head(8) is out  # a full bucket: nothing to cut
        for rows in (1, 3, 7):
            head = out.head(rows)
            assert type(head) is type(out) and head is not out
            for name, value in vars(out).items():
                kept = getattr(head, name)
                if isinstance(value, torch.Tensor):
                    assert torch.equal(kept, value[:rows]), name
                else:
                    assert kept is value, name


def test_rows_picks_the_rows_asked_for_in_their_order() -> None:
    at = torch.tensor([5, 0, 2])
    for out in outputs(8):
        picked = out.rows(at)
        for name, value in vars(out).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(picked, name), value[at]), name
