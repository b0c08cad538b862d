"""CUDA runs of the engine (skipped without a GPU): lossless speculative decoding on the
device in float64, batched, and a bfloat16 real-shaped smoke run."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.commit import COMMIT_STRATEGIES
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.verify_width import StepCosts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("strategy", COMMIT_STRATEGIES)
def test_batched_dflash_on_cuda_equals_plain_greedy(tiny_pair, arch: str, strategy: str) -> None:
    target_dir, draft_dir = tiny_pair(arch, block_size=8)
    target = load_target(target_dir, dtype=torch.float64, device="cuda")
    draft = load_draft(draft_dir, target)
    rng = random.Random(0)
    requests = [
        (
            [rng.randrange(400) for _ in range(rng.randint(1, 90))],
            SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True),
        )
        for _ in range(12)
    ]
    refs = [generate_plain(target, p, sp).output_ids for p, sp in requests]
    engine = Engine(target, draft, EngineConfig(max_num_seqs=8, commit_strategy=strategy))
    for i, ((prompt, params), ref) in enumerate(zip(requests, refs)):
        schedule = [rng.randrange(8) for _ in range(5)]
        engine.add_request(
            str(i), prompt, params, oracle=OracleProposer(ref, schedule, 512) if i % 2 else None
        )
    while engine.has_unfinished():
        engine.step()
    for i, ref in enumerate(refs):
        assert engine.collect(str(i)).output_ids == ref
    assert engine.stats()["phases"]["device_s_verify"] > 0


def test_real_shaped_bfloat16_pair_runs_on_cuda() -> None:
    from reference_engine.bench.shapes import random_pair

    target, draft = random_pair("qwen3.5-4b", "cuda", torch.bfloat16)
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, max_model_len=256))
    engine.add_request("a", list(range(100, 164)), SamplingParams(max_tokens=32, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.collect("a").output_ids) == 32


class HostRegistrations:
    """Another thread registering and unregistering a host buffer with CUDA in a loop, a call
    that is unsafe during a stream capture (each one reaches the driver: no cache serves it)."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        self.stop, self.calls = threading.Event(), 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        cudart = torch.cuda.cudart()
        while not self.stop.is_set():
            cudart.cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            cudart.cudaHostUnregister(self.buffer.data_ptr())
            self.calls += 1

    def __enter__(self) -> HostRegistrations:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def capture_pair(tiny_pair):
    """The tiny hybrid pair in bfloat16 on the GPU, for the capture tests."""
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=8)
    target = load_target(target_dir, dtype=torch.bfloat16, device="cuda")
    return target, load_draft(draft_dir, target)


def assert_plain_greedy(engine: Engine, target) -> None:
    """One request through `engine` gives plain greedy decode's output."""
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=24, ignore_eos=True)
    engine.add_request("a", prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.collect("a").output_ids == generate_plain(target, prompt, params).output_ids


def test_graph_capture_survives_cuda_calls_from_another_thread(tiny_pair) -> None:
    """While the engine captures its CUDA graphs, another thread of the process makes CUDA
    calls that are unsafe during a capture: the captures complete and the output is plain
    greedy's. The control: the same thread's calls break a capture in CUDA's global error mode
    (the engine's before it captured in the thread-local one), else the test proves nothing."""
    target, draft = capture_pair(tiny_pair)
    x = torch.zeros(1024, device="cuda")
    with HostRegistrations() as other:
        started = time.monotonic()
        while other.calls < 10:  # the thread is under way
            assert other.thread.is_alive() and time.monotonic() - started < 30, "the other thread stopped"
            time.sleep(0.001)
        broken = False
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="global"):
                for _ in range(4000):
                    x.add_(1.0)
        except RuntimeError:
            broken = True
        assert broken, "the other thread's calls did not break a global-mode capture"
        torch.cuda.synchronize()
        engine = Engine(target, draft, EngineConfig(max_num_seqs=4, max_model_len=128))
        assert engine.runner.graphs is not None
    assert_plain_greedy(engine, target)


def engine_freed_only_by_the_collector(target, draft) -> None:
    """An engine with CUDA graphs, dropped inside a reference cycle: its graphs are freed when
    the garbage collector next runs, not before."""
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, max_model_len=128))
    assert engine.runner.graphs is not None
    cycle: list = [engine]
    cycle.append(cycle)


def test_captures_run_with_the_garbage_collector_paused(tiny_pair, monkeypatch) -> None:
    """The engine captures its graphs with Python's garbage collector paused, and resumes it
    after: an automatic collection inside a capture can free an earlier engine's graphs,
    which breaks the capture. The control: a collection inside a plain capture, with an
    earlier engine's graphs due, breaks it, else the pause guards against nothing."""
    import gc

    from reference_engine.runtime.graphs import EngineGraphs

    target, draft = capture_pair(tiny_pair)
    x = torch.zeros(1024, device="cuda")
    gc.collect()
    engine_freed_only_by_the_collector(target, draft)
    broken = False
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            x.add_(1.0)
            gc.collect()
            x.add_(1.0)
    except RuntimeError:
        broken = True
    torch.cuda.synchronize()
    assert broken, "freeing an engine's graphs inside a capture did not break it"
    enabled: list[bool] = []  # the collector's state at each run of a decode body
    decode_body = EngineGraphs._decode_body

    def recording(self, inputs):
        enabled.append(gc.isenabled())
        return decode_body(self, inputs)

    monkeypatch.setattr(EngineGraphs, "_decode_body", recording)
    engine = Engine(target, draft, EngineConfig(max_num_seqs=4, max_model_len=128))
    assert engine.runner.graphs is not None and gc.isenabled()
    # the collector paused for each decode graph's captured run alone
    assert enabled.count(False) == len(engine.runner.graphs.decode_graphs) > 0, enabled
    assert_plain_greedy(engine, target)


def test_step_inputs_are_copied_without_waiting_for_queued_work() -> None:
    """runtime/transfer.to_device queues its copy behind the work already on the stream and
    returns; `torch.tensor(..., device="cuda")` waits for that work first (the probe that the
    stream can be seen busy)."""
    from reference_engine.runtime.transfer import to_device

    def queue_work() -> None:  # several milliseconds of matrix products
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(50):
            a = (a @ a) * 1e-3

    stream = torch.cuda.current_stream()
    queue_work()
    copied = to_device([[1, 2], [3, 4]], "cuda")
    assert not stream.query(), "the host waited for the queued work"
    torch.cuda.synchronize()
    assert copied.tolist() == [[1, 2], [3, 4]] and copied.device.type == "cuda"
    queue_work()
    torch.tensor([1, 2], device="cuda")
    assert stream.query()  # the pageable copy synchronized the stream


def test_a_first_token_left_on_the_device_changes_no_output_on_cuda(tiny_pair) -> None:
    """On CUDA with graphs (prefills batched, the step's inputs from captured buffers) a greedy
    request's first token stays on the device after its prefill (the default there): plain and
    DFlash engines give plain greedy output for requests arriving while others run, and the
    same streams as with the token read at once."""
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=8)
    target = load_target(target_dir, dtype=torch.float64, device="cuda")
    draft = load_draft(draft_dir, target)
    rng = random.Random(3)
    requests = [
        ([rng.randrange(400) for _ in range(rng.randint(1, 60))], rng.choice([1, 2, 9, 24]))
        for _ in range(10)
    ]
    for spec in (None, draft):
        streams = []
        for defer in (False, True):
            engine = Engine(target, spec, EngineConfig(max_num_seqs=4, commit_strategy="per_token"))
            assert engine.prefill.defer_first
            engine.prefill.defer_first = defer
            got: dict[str, list] = {}
            for step in range(400):
                if step < len(requests):  # one arrives each step
                    prompt, n = requests[step]
                    engine.add_request(str(step), prompt, SamplingParams(max_tokens=n, ignore_eos=True))
                for out in engine.step():
                    got.setdefault(out.request_id, []).append((step, out.new_token_ids, out.finish_reason))
                if step >= len(requests) and not engine.has_unfinished():
                    break
            for i, (prompt, n) in enumerate(requests):
                want = generate_plain(
                    target, prompt, SamplingParams(max_tokens=n, ignore_eos=True)
                ).output_ids
                assert engine.collect(str(i)).output_ids == want, (spec is not None, defer, i)
            streams.append(got)
        assert streams[0] == streams[1]


def test_the_step_result_reaches_the_host_without_waiting_for_work_queued_after_it() -> None:
    """runtime/transfer.HostCopy queues its copy and returns; work queued after it (the
    captured commit) is still running when `tolist` has the values."""
    from reference_engine.runtime.transfer import HostCopy

    a = torch.randn(4096, 4096, device="cuda")
    values = torch.arange(6, device="cuda") * 2
    pending = HostCopy(values)
    for _ in range(50):  # several milliseconds queued behind the copy
        a = (a @ a) * 1e-3
    assert pending.tolist() == [0, 2, 4, 6, 8, 10]
    assert not torch.cuda.current_stream().query(), "tolist waited for the work queued after the copy"
    torch.cuda.synchronize()


def test_the_host_reader_keeps_a_buffer_per_shape_and_dtype() -> None:
    """runtime/transfer.HostReader reuses its pinned buffers from step to step: results of one
    shape in two dtypes (a step's token ids and its float scores) each come back in their own
    dtype and values, read after the other's copy was made; and a reused buffer gives the new
    step's values, not the last one's."""
    from reference_engine.runtime.transfer import HostReader

    reader = HostReader()
    ids = torch.tensor([[3, 1 << 40], [7, -2]], device="cuda", dtype=torch.int64)
    scores = torch.tensor([[0.5, -1.25], [2.0, 3.5]], device="cuda", dtype=torch.float32)
    assert reader.copy(ids).tolist() == [[3, 1 << 40], [7, -2]]
    assert reader.copy(scores).tolist() == [[0.5, -1.25], [2.0, 3.5]]
    again = reader.copy(ids + 1).tolist()
    assert again == [[4, (1 << 40) + 1], [8, -1]]
    assert all(isinstance(v, int) for row in again for v in row)


def test_the_phase_timer_times_each_phase_on_the_device_and_reuses_its_events() -> None:
    """runtime/stats.PhaseTimer: a phase's device time is its own (a phase that queues ~1 ms
    of work against one that queues none), and events read by `flush` are recorded again,
    so a long run creates a few events, not four a step."""
    from reference_engine.runtime.stats import PhaseTimer

    timer = PhaseTimer(torch.device("cuda"))
    steps = 200
    for _ in range(steps):
        with timer.phase("busy"):
            torch.cuda._sleep(1_000_000)  # about half a millisecond or more of device time
        with timer.phase("idle"):
            pass
        timer.flush()  # what each engine step does: no wait
        torch.cuda.synchronize()  # and the step's result read back, as a step ends
    timer.flush(wait=True)
    assert timer.calls == {"busy": steps, "idle": steps}
    assert timer.device_s["busy"] > 20 * timer.device_s["idle"] >= 0
    assert timer.device_s["busy"] > steps * 1e-4
    assert not timer._pending and len(timer._free) <= 16  # not 4 a step: each recorded many times


def test_an_engine_told_not_to_time_the_device_keeps_host_phase_times_only(tiny_pair) -> None:
    """EngineConfig(device_phase_times=False), what the server runs by default: a DFlash
    engine's steps record no CUDA event, its phases carry host seconds alone, and the server's
    totals say so (the metric then counts host seconds)."""
    from reference_engine.serving.async_engine import EngineTotals

    target_dir, draft_dir = tiny_pair("qwen3", block_size=8)
    target = load_target(target_dir, dtype=torch.float32, device="cuda")
    draft = load_draft(draft_dir, target)
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, device_phase_times=False))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=9, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    phases = engine.stats()["phases"]
    assert phases["host_s_verify"] > 0 and not [k for k in phases if k.startswith("device_s_")]
    assert not engine.timer._pending and not engine.timer._free
    assert EngineTotals.of(engine).device_phases is False


def spec_run(
    engine: Engine,
    prompts: dict[str, list[int]],
    max_tokens: int,
    truths: dict[str, list[int]] | None = None,
    schedule: tuple[int, ...] = (7, 0, 3, 7, 2, 5),
) -> dict:
    """Each request's output and its speculative steps (proposed, accepted, drafted). With
    `truths` (each request's plain greedy output), its proposals come from an oracle that
    follows it and accepts `schedule`'s counts (a random tiny draft accepts next to nothing)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.target.config.vocab_size
    for rid, prompt in prompts.items():
        oracle = None if truths is None else OracleProposer(truths[rid], schedule, vocab)
        engine.add_request(rid, prompt, params, oracle=oracle)
    while engine.has_unfinished():
        engine.step()
    return {rid: (engine.get(rid).output_ids, engine.get(rid).steps) for rid in prompts}


def widths_setup(tiny_pair, seed: int, requests: int):
    """The capture pair, `requests` random prompts, a 4-slot engine config of block 8, and one
    cost table for every engine of a test (measured ones differ run to run, and so would the
    widths chosen), dearer with width, so that narrow widths are chosen too."""
    target, draft = capture_pair(tiny_pair)
    rng = random.Random(seed)
    prompts = {f"r{i}": [rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for i in range(requests)}
    config = EngineConfig(max_num_seqs=4, max_model_len=160, block_size=8)
    widths = Engine(target, draft, config).verify_width.costs.seconds
    costs = StepCosts({(r, w): 1.0 + 0.3 * w for r, w in widths}, measured=True)
    return target, draft, prompts, config, costs


def test_the_captured_accept_decides_as_the_eager_accept(tiny_pair, monkeypatch) -> None:
    """runtime/speculative_step.accept_replayed: the greedy accept replayed from its graph
    (the step's table and the commit's `processed` in one replay) commits what the eager
    accept commits, step by step, at every verify width the engine chooses; it is taken on
    graphs; and a replaced accept method (a planted fault) turns it off, so the gates see
    the replaced method run."""
    from gates.faults import planted
    from reference_engine.runtime.model_runner import ModelRunner
    from reference_engine.runtime.speculative_step import SpeculativeStep

    target, draft, prompts, config, costs = widths_setup(tiny_pair, seed=3, requests=6)
    tables = []
    accept = ModelRunner.accept

    def counted(self, rows):
        table = accept(self, rows)
        tables.append(None if table is None else table[:, 0].tolist())  # accepted, a row each
        return table

    plain = {
        rid: generate_plain(target, p, SamplingParams(max_tokens=48, ignore_eos=True)).output_ids
        for rid, p in prompts.items()
    }
    monkeypatch.setattr(ModelRunner, "accept", counted)
    engine = Engine(target, draft, config, step_costs=costs)
    replayed = spec_run(engine, prompts, 48, plain)
    assert tables and None not in tables, "the captured accept did not replay every step"
    assert len([w for w in engine.verify_widths if w > 0]) > 1, engine.verify_widths  # several widths
    accepted = {a for table in tables for a in table}
    assert 0 in accepted and len(accepted - {0}) >= 2, accepted  # not vacuous: tokens accepted
    with monkeypatch.context() as m:
        m.setattr(SpeculativeStep, "accept_replayed", lambda self, rows: None)
        eager = spec_run(Engine(target, draft, config, step_costs=costs), prompts, 48, plain)
    assert replayed == eager
    assert {rid: out for rid, (out, _) in replayed.items()} == plain
    tables.clear()
    with planted("never_accept_full_block"):
        spec_run(Engine(target, draft, config, step_costs=costs), prompts, 48, plain)
    assert tables == [], "a replaced accept method still ran the captured accept"


def test_a_draft_queued_ahead_from_captured_inputs_proposes_what_a_fresh_draft_would(
    tiny_pair, monkeypatch
) -> None:
    """graphs.capture_ahead: behind a replayed accept, the next draft's inputs come from a graph
    of their own (SpeculativeStep.ahead_body, the bucket's padding rows put back to the
    padding's): it is taken at every drafted step, and every output and drafted block equal an
    engine's that drafts afresh at each step, with three rows in a bucket of four. Inputs whose
    blocks hold another row's anchors propose other blocks (outputs stay lossless)."""
    from dataclasses import replace

    from reference_engine.runtime.graphs import EngineGraphs
    from reference_engine.runtime.speculative_step import SpeculativeStep

    target, draft, prompts, config, costs = widths_setup(tiny_pair, seed=5, requests=3)
    taken = []
    propose_ahead = EngineGraphs.propose_ahead

    def counted(self, remaining, width):
        out = propose_ahead(self, remaining, width)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(EngineGraphs, "propose_ahead", counted)
    queued = spec_run(Engine(target, draft, config, step_costs=costs), prompts, 40)
    assert len(taken) > 5 and all(taken), taken
    fresh_engine = Engine(target, draft, config, step_costs=costs)
    fresh_engine.speculative_step.draft_ahead = False
    fresh = spec_run(fresh_engine, prompts, 40)
    assert queued == fresh

    ahead_body = SpeculativeStep.ahead_body

    def swapped(self, x, table, remaining):
        nxt = ahead_body(self, x, table, remaining)
        return replace(nxt, ids=nxt.ids.roll(1, dims=0))

    monkeypatch.setattr(SpeculativeStep, "ahead_body", swapped)
    faulty = spec_run(Engine(target, draft, config, step_costs=costs), prompts, 40)
    drafted = {rid: [s.drafted for s in steps] for rid, (_, steps) in fresh.items()}
    assert {rid: [s.drafted for s in steps] for rid, (_, steps) in faulty.items()} != drafted
    assert {rid: out for rid, (out, _) in faulty.items()} == {rid: out for rid, (out, _) in fresh.items()}


@pytest.mark.parametrize("feature", ["raw", "final_norm"])
def test_captured_forwards_hand_the_draft_its_last_layer_as_its_config_says(feature: str) -> None:
    """The shipped demo draft lists the target's last layer. Read as its config says (raw)
    or after the final norm, a CUDA-graph engine's steps accept exactly as an eager engine's
    (the captured prefill and verify give the same features), output equals plain greedy,
    and the two readings accept differently (the setting reaches the captured forwards)."""
    import dataclasses

    from reference_engine.demo import DEMO_DRAFT, DEMO_TARGET, demo_prompts

    target = load_target(DEMO_TARGET, dtype=torch.float32, device="cuda")
    prompts = [row["prompt_ids"] for row in demo_prompts()[:8]]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    refs = [generate_plain(target, p, params).output_ids for p in prompts]

    def histogram(last_layer_feature: str, eager: bool) -> dict:
        draft = load_draft(DEMO_DRAFT, target)
        draft.config = dataclasses.replace(draft.config, last_layer_feature=last_layer_feature)
        # every step verifies the whole block: an adaptive width follows each engine's own
        # measured step costs, which differ between captured and eager forwards
        config = EngineConfig(
            max_num_seqs=8, block_size=8, enforce_eager=eager, max_model_len=256, verify_width="fixed"
        )
        engine = Engine(target, draft, config)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished():
            engine.step()
        assert [engine.collect(str(i)).output_ids for i in range(len(prompts))] == refs
        return engine.stats()["spec"]["acceptance_length_histogram"]

    other = "final_norm" if feature == "raw" else "raw"
    captured = histogram(feature, eager=False)
    assert captured == histogram(feature, eager=True)
    assert captured != histogram(other, eager=False)


@pytest.mark.parametrize("steps_per_turn", [1, 3], ids=["draft-ahead", "turns"])
def test_a_row_whose_logits_turn_nan_fails_alone_on_captured_graphs(tiny_pair, steps_per_turn: int) -> None:
    """A request whose token X (mid-output) has NaN embeddings: the logits after it are NaN,
    the device's greedy gives `vocab`, and that bonus feeds the next draft queued ahead from
    captured inputs (one step a turn) or the next step of the turn. Neither may index the
    embeddings with it (on the GPU an out-of-range index is a device assert that ends the
    process): the request ends in error after X, as plain decode's tokens up to it, and the
    requests beside it, which never see X in their prompts or outputs, give plain greedy's;
    so do the requests that take the slots next, the failed one's too."""
    target, draft = capture_pair(tiny_pair)
    rng = random.Random(11)
    prompts = {f"r{i}": [rng.randrange(3, 500) for _ in range(rng.randrange(5, 30))] for i in range(4)}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = {rid: generate_plain(target, p, params).output_ids for rid, p in prompts.items()}
    others = {t for rid, p in prompts.items() if rid != "r0" for t in p + plain[rid]}
    out = plain["r0"]
    own = [g for g in range(8, 30) if out[g] not in others and out[g] not in prompts["r0"] + out[:g]]
    at = next((g for g in own if out[g] != draft.config.mask_token_id), None)  # every draft reads it
    assert at is not None, "no token of r0's output is its own"
    assert not target.config.tie_word_embeddings  # the output head keeps its own weights
    embeddings = target.model.embed_tokens.weight
    kept = embeddings[out[at]].clone()
    with torch.no_grad():
        embeddings[out[at]] = float("nan")
    config = EngineConfig(max_num_seqs=4, max_model_len=160, block_size=8, steps_per_turn=steps_per_turn)
    engine = Engine(target, draft, config)
    assert engine.runner.graphs is not None
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
    bad = engine.collect("r0")
    assert bad.finish_reason == "error" and "not finite" in bad.error, bad.error
    assert bad.output_ids == out[: at + 1]
    assert {rid: engine.collect(rid).output_ids for rid in prompts if rid != "r0"} == {
        rid: plain[rid] for rid in prompts if rid != "r0"
    }
    torch.cuda.synchronize()  # an out-of-range index would surface here at the latest
    # the failed request's cells hold NaN keys, values and states past where the requests
    # that take its slot next write: none of it may reach them
    with torch.no_grad():
        embeddings[out[at]] = kept
    short = {f"n{i}": prompt[:4] for i, prompt in enumerate(prompts.values())}
    for rid, prompt in short.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert {rid: engine.collect(rid).output_ids for rid in short} == {
        rid: generate_plain(target, p, params).output_ids for rid, p in short.items()
    }
