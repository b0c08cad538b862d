"""Every planted fault, and the GPU tier's wrappers of the speculative step, take every
argument the engine passes to what they replace. A replacement with a narrower signature
fails with TypeError wherever it is planted, so its gate fails for that reason and not for
the fault it plants; the GPU tier's gates skip without CUDA, so there it would first show on
a GPU. (A change of the engine's signature must carry the replacements along.)"""

from __future__ import annotations

import inspect

import pytest

from reference_engine.runtime.speculative_step import SpeculativeStep

from . import exact
from .faults import FAULTS

P = inspect.Parameter


def takes_every_argument(correct, replacement, drop_first: bool = False) -> str | None:
    """None when `replacement` binds every way of calling `correct` (each parameter given
    positionally where it may be, and by keyword); else the binding's error. `drop_first`:
    `correct` is a method and `replacement` the bound function (no `self`)."""
    params = list(inspect.signature(correct).parameters.values())[int(drop_first) :]
    positional = [object() for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keyword_only = {p.name: object() for p in params if p.kind == P.KEYWORD_ONLY}
    by_keyword = {p.name: object() for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    leading = [object() for p in params if p.kind == P.POSITIONAL_ONLY]
    signature = inspect.signature(replacement)
    try:
        signature.bind(*positional, **keyword_only)
        signature.bind(*leading, **by_keyword)
    except TypeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_planted_fault_takes_every_argument_of_what_it_replaces(name: str) -> None:
    fault = FAULTS[name]
    correct = getattr(fault.owner, fault.method)
    problem = takes_every_argument(correct, fault.wrap(correct))
    assert problem is None, f"{name} replaces {fault.method}: {problem}"


def test_the_gpu_tiers_wrappers_take_every_argument_of_the_verify() -> None:
    correct = SpeculativeStep.verify
    with exact.verify_with():
        assert takes_every_argument(correct, SpeculativeStep.verify) is None

    class Step:  # what VerifyLogitCheck wraps: the engine's bound speculative step
        verify = staticmethod(lambda rows, block, record=True: None)

    class Engine:
        speculative_step = Step()

    exact.VerifyLogitCheck(Engine(), {}, {}, {})
    assert takes_every_argument(correct, Engine.speculative_step.verify, drop_first=True) is None


def test_the_check_sees_a_narrower_replacement() -> None:
    """The check's own fault: a replacement that drops the last parameter is reported."""

    def correct(self, rows, block, record=True):
        return None

    def narrow(self, rows, block):
        return None

    assert takes_every_argument(correct, narrow) is not None
    assert takes_every_argument(correct, lambda self, *args, **kwargs: None) is None
