"""Acceptance metrics from Prometheus counter differences, in each server family's format."""

from __future__ import annotations

import pytest

from harness.client import RequestRecord
from harness.prometheus import acceptance_from_counters, acceptance_from_requests, parse


def counters(
    prefix: str, drafts: float, draft_tokens: float, accepted: float, per_pos: list[float], labels: str
) -> str:
    lines = [
        f"# TYPE {prefix}spec_decode_num_drafts counter",
        f"{prefix}spec_decode_num_drafts_total{{{labels}}} {drafts}",
        f"# TYPE {prefix}spec_decode_num_draft_tokens counter",
        f"{prefix}spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}",
        f"# TYPE {prefix}spec_decode_num_accepted_tokens counter",
        f"{prefix}spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
        f"# TYPE {prefix}spec_decode_num_accepted_tokens_per_pos counter",
    ]
    lines += [
        f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{k}"}} {v}'
        for k, v in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "prefix,labels",
    [
        ("vllm:", 'engine="0",model_name="Qwen/Qwen3-8B"'),
        ("lmdeploy:", 'model_name="qwen"'),
        ("dflash:", 'server="ref"'),
    ],
)
def test_differences_give_acceptance_length_rate_and_per_position(prefix, labels) -> None:
    # lifetime totals before the run must not leak into the result
    before = parse(counters(prefix, 1000, 15000, 4000, [900, 700, 500], labels))
    after = parse(counters(prefix, 1100, 16500, 4450, [990, 770, 550], labels))
    got = acceptance_from_counters(before, after)
    assert got["acceptance_length"] == pytest.approx(1 + 450 / 100)
    assert got["acceptance_rate"] == pytest.approx(450 / 1500)
    # vLLM numbers positions from 0; ours from 1: either way the first is position one
    assert got["acceptance_per_position"] == pytest.approx([0.9, 0.7, 0.5])
    assert got["acceptance_source"] == "prometheus"


def test_label_sets_are_summed() -> None:
    text = (
        counters("vllm:", 10, 100, 30, [8], 'engine="0"').replace(
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n", ""
        )
        + counters("vllm:", 20, 200, 60, [16], 'engine="1"').split("\n", 1)[1]
    )
    snap = parse(text)
    assert snap["drafts"] == 30 and snap["accepted"] == 90


def test_sglang_gauges_and_meta_info() -> None:
    text = (
        '# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{model_name="m"} 3.2\n'
        '# TYPE sglang:spec_accept_rate gauge\nsglang:spec_accept_rate{model_name="m"} 0.4\n'
    )
    got = acceptance_from_counters(parse(""), parse(text))
    assert got["acceptance_length"] == pytest.approx(3.2)
    assert "not differenced" in got["acceptance_source"]
    records = [
        RequestRecord(0, 0.0, success=True, meta_info={"spec_verify_ct": 10, "completion_tokens": 35}),
        RequestRecord(1, 0.0, success=True, meta_info={"spec_verify_ct": 5, "completion_tokens": 10}),
    ]
    assert acceptance_from_requests(records)["acceptance_length"] == pytest.approx(45 / 15)


def test_our_per_request_statistics_give_the_histogram() -> None:
    spec = {"steps": 3, "proposed": 21, "accepted": 6, "acceptance_lengths": [4, 1, 4]}
    got = acceptance_from_requests([RequestRecord(0, 0.0, success=True, spec_decode=spec)])
    assert got["acceptance_histogram"] == {1: 1, 4: 2}
    assert got["acceptance_length"] == pytest.approx(3.0)


def test_no_metrics_no_acceptance() -> None:
    assert acceptance_from_counters(None, None) == {}
    assert acceptance_from_counters(parse(""), parse("")) == {}


def test_a_page_with_the_same_counts_under_two_names_is_read_once() -> None:
    # our server with --metrics-names dflash,vllm: dflash numbers positions from 1, vllm from 0
    dflash = counters("dflash:", 10, 70, 30, [], 'server="ref"')
    dflash += 'dflash:spec_decode_num_accepted_tokens_per_pos_total{server="ref",position="1"} 8\n'
    vllm = counters("vllm:", 10, 70, 30, [8], 'model="m"')
    snap = parse(dflash + vllm)
    assert snap["drafts"] == 10 and snap["accepted"] == 30
    assert snap["pos:1"] == 8 and "pos:0" not in snap


def test_vllm_positions_are_read_as_the_first_draft_token() -> None:
    snap = parse(counters("vllm:", 10, 70, 30, [8, 6], 'engine="0"'))
    assert (snap["pos:1"], snap["pos:2"]) == (8, 6) and "pos:0" not in snap


def test_a_position_that_accepted_nothing_in_the_run_keeps_its_place() -> None:
    """Per-position acceptance is indexed by position: one whose counter did not move during
    the run reads 0 there, and the positions after it stay where they are."""
    before = parse(counters("vllm:", 100, 300, 50, [50, 20, 5], 'engine="0"'))
    after = parse(counters("vllm:", 110, 330, 64, [59, 20, 10], 'engine="0"'))
    got = acceptance_from_counters(before, after)
    assert got["acceptance_per_position"] == pytest.approx([0.9, 0.0, 0.5])


def test_per_position_acceptance_is_in_position_order_past_nine() -> None:
    """A block of 16 has 15 draft positions: the tenth comes after the ninth (not after the
    first, as text sorts them)."""
    falling = [float(100 - 5 * k) for k in range(15)]
    before = parse(counters("dflash:", 0, 0, 0, [0.0] * 15, 'server="ref"'))
    after = parse(counters("dflash:", 100, 1500, sum(falling), falling, 'server="ref"'))
    got = acceptance_from_counters(before, after)
    assert got["acceptance_per_position"] == pytest.approx([v / 100 for v in falling])


def test_per_request_acceptance_counts_completed_requests_only() -> None:
    done = {"steps": 2, "proposed": 14, "accepted": 6, "acceptance_lengths": [4, 4]}
    cut = {"steps": 5, "proposed": 35, "accepted": 0, "acceptance_lengths": [1, 1, 1, 1, 1]}
    got = acceptance_from_requests(
        [
            RequestRecord(0, 0.0, success=True, spec_decode=done),
            RequestRecord(1, 0.0, success=False, error="cut", spec_decode=cut),
        ]
    )
    assert got["acceptance_length"] == pytest.approx(4.0) and got["acceptance_histogram"] == {4: 2}


def test_the_servers_cpu_shares_come_from_its_cpu_counters_differences() -> None:
    from harness.prometheus import server_cpu

    page = """# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total {server}
# TYPE dflash:engine_cpu_seconds_total counter
dflash:engine_cpu_seconds_total {engine}
"""
    before = parse(page.format(server=10.0, engine=100.0))
    after = parse(page.format(server=11.5, engine=103.8))
    assert server_cpu(before, after, 2.0) == {"server_cpu": 0.75, "engine_cpu": 1.9}
    # a server that exports only its process's counter (vLLM's page), or none
    plain = parse("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3\n")
    assert server_cpu(
        plain, parse("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 4\n"), 4.0
    ) == {"server_cpu": 0.25}
    assert server_cpu(parse(""), parse(""), 1.0) == {} and server_cpu(None, after, 1.0) == {}
    assert "acceptance_length" not in acceptance_from_counters(before, after)  # CPU is not acceptance


def test_a_server_restarted_between_the_scrapes_gives_no_counter_acceptance() -> None:
    """Counters that went down between the snapshots (the server restarted and counts from
    zero again) say nothing about the run: their differences are negative, and a ratio of two
    negative differences must not pass for an acceptance length."""
    before = parse(counters("vllm:", 1000, 15000, 4000, [900, 700, 500], 'engine="0"'))
    after = parse(counters("vllm:", 100, 1500, 450, [90, 70, 50], 'engine="0"'))
    assert acceptance_from_counters(before, after) == {}


def test_created_timestamps_beside_the_counters_are_not_counted() -> None:
    """prometheus_client writes a `_created` sample (a Unix time) beside each counter unless
    told not to, as vLLM's page has them: only the `_total` samples are counts."""

    def page(drafts: float, draft_tokens: float, accepted: float) -> str:
        lines = []
        for name, value in (
            ("spec_decode_num_drafts", drafts),
            ("spec_decode_num_draft_tokens", draft_tokens),
            ("spec_decode_num_accepted_tokens", accepted),
        ):
            lines += [
                f"# HELP vllm:{name} {name}",
                f"# TYPE vllm:{name} counter",
                f'vllm:{name}_total{{engine="0",model_name="m"}} {value}',
                f'vllm:{name}_created{{engine="0",model_name="m"}} 1.7171717171e+09',
            ]
        return "\n".join(lines) + "\n"

    before, after = parse(page(1000, 15000, 4000)), parse(page(1100, 16500, 4450))
    assert after["drafts"] == 1100 and after["accepted"] == 4450
    got = acceptance_from_counters(before, after)
    assert got["acceptance_length"] == pytest.approx(1 + 450 / 100)
    assert got["acceptance_rate"] == pytest.approx(450 / 1500)


def test_sglang_gauges_are_read_after_the_run_not_differenced() -> None:
    """A gauge is a level, not a count: the value after the run is the figure, whatever the
    page said before it."""

    def page(length: float) -> str:
        name = "sglang:spec_accept_length"
        return f'# TYPE {name} gauge\n{name}{{model_name="m"}} {length}\n'

    got = acceptance_from_counters(parse(page(2.5)), parse(page(3.2)))
    assert got["acceptance_length"] == pytest.approx(3.2)


def test_sglang_gauges_of_several_schedulers_are_averaged_not_summed() -> None:
    """SGLang exposes one acceptance gauge a scheduler (a data-parallel rank each): each is
    already a per-step figure, so two ranks at 3.0 and 4.0 read as 3.5, not 7.0; one label
    set reads as itself."""
    name = "sglang:spec_accept_length"
    page = (
        f"# TYPE {name} gauge\n"
        f'{name}{{model_name="m",dp_rank="0"}} 3.0\n'
        f'{name}{{model_name="m",dp_rank="1"}} 4.0\n'
        "# TYPE sglang:spec_accept_rate gauge\n"
        'sglang:spec_accept_rate{model_name="m",dp_rank="0"} 0.25\n'
        'sglang:spec_accept_rate{model_name="m",dp_rank="1"} 0.35\n'
    )
    got = acceptance_from_counters(parse(""), parse(page))
    assert got["acceptance_length"] == pytest.approx(3.5)
    assert got["acceptance_rate"] == pytest.approx(0.3)
    single = f'# TYPE {name} gauge\n{name}{{model_name="m",dp_rank="0"}} 3.0\n'
    assert acceptance_from_counters(parse(""), parse(single))["acceptance_length"] == pytest.approx(3.0)


def streamed(*outputs: int, failed: int = 0) -> list[RequestRecord]:
    """Completed requests that streamed `outputs` tokens each (a first token, then the rest),
    and `failed` requests cut after 2 tokens."""
    records = [
        RequestRecord(i, 0.0, success=True, chunk_tokens=[1, n - 1] if n > 1 else [1])
        for i, n in enumerate(outputs)
    ]
    return records + [RequestRecord(len(records) + i, 0.0, chunk_tokens=[1, 1]) for i in range(failed)]


def test_counters_that_agree_with_the_tokens_streamed_pass_and_each_contradiction_is_named() -> None:
    """Two requests of 33 tokens: 8 drafts of 7 tokens that accept 28 commit the 64 tokens after
    the first ones. Accepted past drafted, a position past the drafts or past the one before,
    and committed tokens past the streamed ones plus a block a request are each named."""
    from harness.prometheus import counter_contradictions

    def check(drafts, draft_tokens, accepted, per_pos, records=None):
        before = parse(counters("vllm:", 10, 70, 20, [9, 6, 5], 'engine="0"'))
        after = parse(
            counters(
                "vllm:",
                10 + drafts,
                70 + draft_tokens,
                20 + accepted,
                [a + b for a, b in zip([9, 6, 5], per_pos)],
                'engine="0"',
            )
        )
        return counter_contradictions(before, after, streamed(33, 33) if records is None else records)

    assert check(8, 56, 56, [8, 8, 8]) == ""  # every draft token accepted: 64 committed
    assert check(8, 56, 57, [8, 8, 8]).startswith("57 accepted tokens of 56 drafted")
    assert check(8, 56, 20, [9, 8, 3]) == "position 1 accepted 9 times, more than the 8 drafts"
    assert check(8, 56, 20, [8, 5, 6]) == "position 3 accepted 6 times, more than the 5 position 2's"
    # 8 drafts + 72 accepted = 80 committed, against 66 - 2 + 2 x 10 = 84 at most (blocks of 9 + 1)
    assert check(8, 72, 72, [8, 8, 8]) == ""
    over = check(8, 80, 80, [8, 8, 8])
    assert over.startswith("the drafted steps committed 88 tokens (8 drafts, 80 accepted), more than the 66 ")
    assert "66 tokens streamed to 2 requests allow (86: all but each first token, and a block of 11" in over
    # a run with a failed stream is not held to its streamed tokens (the server may have gone on)
    assert check(8, 80, 80, [8, 8, 8], streamed(33, 33, failed=1)) == ""
    assert (
        counter_contradictions(None, parse(counters("vllm:", 1, 7, 1, [1], 'engine="0"')), streamed(3)) == ""
    )
    assert check(0, 0, 0, [0, 0, 0]) == ""  # no drafted step in the run
