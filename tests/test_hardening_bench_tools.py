"""The engine-side benchmark and measurement tools, checked against hand computations and
with stand-ins for the external tools they drive.

The floors (`reference_engine/bench/floor.py`): the bytes a decode step of the `qwen3-small`
shape streams and the FLOPs of its prefill, worked out by hand from the shape's config; the
median, range and repeats of the weight floor under a scripted clock; a sliding-window layer's
prefill arithmetic and the products it runs past its window.

The named shapes (`reference_engine/bench/shapes.py`): the published configs' scalars, the
drafts the module docstring names, and `random_draft` as `random_pair`'s draft alone.

The engine benchmark (`reference_engine/bench/__init__.py`): a random shape's defaults
(float32 on the CPU, a block-16 draft), the CSV's documented columns and units, the CSV
written after every concurrency, the floor table's cache figure in GB, the prompts file's line
numbers, refused repetitions, the spread hint; a prompts row whose ids are not a list and an
--out in a missing folder are one error line, the latter before anything is measured.

The soak (`reference_engine/bench/soak.py`): the first differing position, the random prompt
pool, a random shape's block-16 draft and the summary's fields; a soak of no request, or of
a random shape beside a named model, is refused.

`scripts/profile.sh` under a stand-in nsys (no GPU, no Nsight Systems): every mode and
concurrency profiled in its own process with the documented options, a failing step fails the
script, a stale report is never taken for a new one, and the nvtx package is asked for.
`scripts/bench_gpu_suite.sh` under stand-ins for python and timeout: each part's time limit,
skipped parts, exit statuses and time-outs reported, the last table of a log printed. The
Makefile's `profile` and `bench` command lines, and `scripts/eval_demo_drafts.py`'s JSON and its
one error line for a device that is not there.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reference_engine import bench
from reference_engine.bench import floor, soak
from reference_engine.bench.shapes import DRAFT_HEADS, TARGET_SHAPES, random_draft, random_pair
from reference_engine.checkpoint import load_target
from reference_engine.demo import DEMO_DRAFT
from reference_engine.errors import ReferenceEngineError

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "nsys"
PROFILE = ROOT / "scripts" / "profile.sh"
SUITE = ROOT / "scripts" / "bench_gpu_suite.sh"

# the qwen3-small shape by hand: hidden 256, 4 query and 2 kv heads of 64, MLP 512, 6 layers,
# an untied LM head over 4096 tokens
SMALL = TARGET_SHAPES["qwen3-small"]
SMALL_LAYER = (
    256 * 256  # q: 4 heads x 64
    + 2 * 128 * 256  # k and v: 2 heads x 64
    + 256 * 256  # o
    + 2 * 512 * 256  # gate and up
    + 256 * 512  # down
)
SMALL_HEAD = 4096 * 256


@pytest.fixture(scope="module")
def small_target():
    target, _ = random_pair("qwen3-small", "cpu", torch.float32)
    return target


# ---------------------------------------------------------------------------------------------
# bench/floor.py


def test_the_small_shapes_floor_reads_its_weights_and_caches_as_worked_out_by_hand(small_target) -> None:
    """6 layers of 589,824 weights and a 4096 x 256 head (the input embedding not read: the
    head is untied), float32; 3 requests seeing 10 positions read 2 x 3 x 10 keys and values
    of 2 x 64 floats a layer."""
    assert SMALL["num_hidden_layers"] == 6 and not SMALL["tie_word_embeddings"]
    weights = 4 * (6 * SMALL_LAYER + SMALL_HEAD)
    cache = 6 * 2 * 3 * 10 * 128 * 4
    got = floor.weight_streaming_floor(small_target, repeats=1, rows=3, context=10)
    assert (got.bytes, got.cache_bytes) == (weights + cache, cache)
    assert floor.weight_streaming_floor(small_target, repeats=1).bytes == weights


def test_the_small_shapes_prefill_flops_are_worked_out_by_hand(small_target) -> None:
    """12 prompt tokens: 2 x 12 FLOPs per weight of the body, the LM head over the last row
    only, and per layer half of 4 x 12^2 x 4 heads x 64 for the causal attention."""
    got = floor.prefill_compute_floor(small_target, 12, repeats=1)
    want = 2.0 * 12 * 6 * SMALL_LAYER + 2.0 * SMALL_HEAD + 6 * 2.0 * 12 * 12 * 4 * 64
    assert got.flops == want and got.tokens == 12


def test_the_weight_floor_is_the_median_and_range_of_its_repeats(small_target, monkeypatch) -> None:
    """A scripted clock: three timed repeats of 1, 10 and 2 ms (the warm-up is not timed)."""
    ticks = iter([0.0, 0.001, 10.0, 10.010, 20.0, 20.002])
    monkeypatch.setattr(floor, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    got = floor.weight_streaming_floor(small_target, repeats=3)
    assert (got.ms_median, got.ms_min, got.ms_max, got.repeats) == pytest.approx((2.0, 1.0, 10.0, 3))
    assert got.gb_per_s == pytest.approx(got.bytes / 2e-3 / 1e9)  # bytes per second, in GB


def windowed(tiny_checkpoint):
    overrides = (("use_sliding_window", True), ("sliding_window", 8), ("max_window_layers", 1))
    return load_target(tiny_checkpoint("qwen3", config_overrides=overrides), dtype=torch.float32)


def test_a_sliding_window_layers_prefill_flops_are_a_causal_window_then_the_window_per_query(
    tiny_checkpoint,
) -> None:
    """20 tokens through a window of 8: the first 8 causal (2 x 8^2 H D) and each of the 12
    later queries against 8 keys (4 x 8 H D), against 2 x 20^2 H D of full causal attention."""
    model = windowed(tiny_checkpoint)
    full = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    c = model.config
    sliding = sum(kind == "sliding_attention" for kind in c.layer_types)
    assert 0 < sliding < c.num_hidden_layers
    hd = c.num_attention_heads * c.head_dim
    per_layer = (2.0 * 8 * 8 + 4.0 * 12 * 8) * hd - 2.0 * 20 * 20 * hd
    got = floor.prefill_compute_floor(model, 20, repeats=1).flops
    assert got - floor.prefill_compute_floor(full, 20, repeats=1).flops == sliding * per_layer


def test_the_prefill_floor_runs_the_queries_past_a_window_against_it(tiny_checkpoint, monkeypatch) -> None:
    """9 tokens, a window of 8: the window runs causal and the ninth query runs unmasked against
    the window's 8 keys; a full layer runs the 9 causal."""
    model = windowed(tiny_checkpoint)
    real = torch.nn.functional.scaled_dot_product_attention
    seen = set()

    def spy(q, k, v, *args, is_causal=False, **kwargs):
        seen.add((q.shape[2], k.shape[2], is_causal))
        return real(q, k, v, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    floor.prefill_compute_floor(model, 9, repeats=1)
    assert seen == {(8, 8, True), (1, 8, False), (9, 9, True)}


# ---------------------------------------------------------------------------------------------
# bench/shapes.py

# the scalars of the published configs (Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B-Instruct,
# Qwen/Qwen3-30B-A3B)
PUBLISHED = {
    "qwen3-8b": {
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "eos_token_id": 151645,
    },
    "llama3.1-8b": {
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "eos_token_id": [128001, 128008, 128009],
    },
    "qwen3-30b-a3b": {
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "eos_token_id": 151645,
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_named_shape_has_the_published_configs_norm_rope_context_and_tokens(name: str) -> None:
    shape = TARGET_SHAPES[name]
    assert {key: shape[key] for key in PUBLISHED[name]} == PUBLISHED[name]


def test_llamas_draft_has_the_targets_heads_and_the_moe_targets_share_one_draft() -> None:
    """The module docstring: for Llama the target's own heads and width, for both MoE targets
    the heads and width of z-lab's Qwen3.5-35B-A3B draft."""
    llama = TARGET_SHAPES["llama3.1-8b"]
    own = (llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"])
    assert DRAFT_HEADS["llama3.1-8b"] == (*own, llama["intermediate_size"])
    assert DRAFT_HEADS["qwen3-30b-a3b"] == DRAFT_HEADS["qwen3.5-35b-a3b"] == (32, 4, 128, 6144)


def test_random_draft_alone_is_random_pairs_draft_bit_for_bit() -> None:
    _, paired = random_pair("qwen3-small", "cpu", torch.float32, seed=3, block_size=8, draft_layers=2)
    alone = random_draft("qwen3-small", "cpu", torch.float32, seed=3, block_size=8, draft_layers=2)
    a, b = paired.state_dict(), alone.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# the engine benchmark

SMALL_RUN = ["--random-shape", "qwen3-small", "--device", "cpu", "--input-len", "8", "--output-len", "4"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory):
    """One benchmark of the qwen3-small shape at concurrency 2 with the floor, dtype and block
    size left to their defaults: (exit code, stdout, CSV rows, CSV path)."""
    out = tmp_path_factory.mktemp("small-run") / "bench.csv"
    argv = [*SMALL_RUN, "--concurrency", "2", "--repeats", "2", "--floor", "--out", str(out)]
    capture = tmp_path_factory.mktemp("small-run-stdout") / "stdout.txt"
    with open(capture, "w") as f, contextlib.redirect_stdout(f):
        code = bench.main(argv)
    return code, capture.read_text(), list(csv.DictReader(out.open())), out


def test_a_random_shape_runs_float32_on_the_cpu_with_a_block_16_draft(small_run) -> None:
    code, stdout, rows, out = small_run
    assert code == 0
    assert "dtype torch.float32, qwen3-small, draft DFlashDraft" in stdout
    (spec,) = [r for r in rows if r["mode"] == "dflash"]
    assert spec["verify_widths"] == f"15:{spec['steps']}"  # the CPU verifies the whole block of 16
    assert stdout.rstrip().endswith(f"wrote {out}")


def test_the_csv_has_the_documented_columns_in_their_units(small_run) -> None:
    """Medians with their `_min` and `_max`, phase times and counts, the host clock, and the
    floor's GB/s: the bytes it read (weights by hand, and the cache of 2 requests at a mean
    context of 8 + 4 / 2 positions) over its milliseconds."""
    _, _, rows, _ = small_run
    documented = ["output_tokens_per_s", "mean_acceptance_length", "ms_step", "steps", "ms_per_step"]
    documented += ["ms_per_decode_step", "floor_ms", "floor_ms_min", "floor_ms_max", "floor_gb_per_s"]
    documented += ["over_floor", "floor_cache_bytes", "floor_prefill_ms", "prefill_over_floor", "repeats"]
    documented += ["ms_prefill", "n_prefill", "ms_decode", "n_decode", "ms_verify", "n_verify", "phase_clock"]
    documented += ["output_tokens_per_s_min", "output_tokens_per_s_max", "ms_per_step_min", "ms_per_step_max"]
    for row in rows:
        assert set(documented) <= set(row), set(documented) - set(row)
        assert row["phase_clock"] == "host" and row["repeats"] == "2" and row["concurrency"] == "2"
        cache = 6 * 2 * 2 * 10 * 128 * 4
        assert int(row["floor_cache_bytes"]) == cache
        read = float(row["floor_gb_per_s"]) * 1e9 * float(row["floor_ms"]) / 1000
        assert read == pytest.approx(4 * (6 * SMALL_LAYER + SMALL_HEAD) + cache)
        low, high = float(row["ms_per_step_min"]), float(row["ms_per_step_max"])
        assert low <= float(row["ms_per_step"]) <= high


def test_the_csv_keeps_every_concurrency_measured_before_a_later_one_fails(
    tmp_path: Path, monkeypatch
) -> None:
    """The CSV is written after every concurrency: a run that fails at its second keeps the
    first's rows."""
    real, calls = bench.measure, []

    def measure(engines, prompts, args, concurrency, warm_outputs):
        calls.append(concurrency)
        if concurrency == 2:
            raise ReferenceEngineError("the second concurrency failed")
        return real(engines, prompts, args, concurrency, warm_outputs)

    monkeypatch.setattr(bench, "measure", measure)
    out = tmp_path / "bench.csv"
    argv = [*SMALL_RUN, "--concurrency", "1,2", "--repeats", "1", "--block-size", "4", "--out", str(out)]
    assert bench.main(argv) == 2
    assert calls == [1, 2]
    rows = list(csv.DictReader(out.open()))
    assert sorted(r["mode"] for r in rows) == ["dflash", "plain"] and {r["concurrency"] for r in rows} == {
        "1"
    }


def test_the_floor_table_gives_the_cache_in_gb(capsys) -> None:
    row = {
        "mode": "plain",
        "draft": None,
        "numerics": "exact",
        "concurrency": 4,
        "ms_per_decode_step": 3.0,
        "floor_ms": 2.0,
        "floor_ms_min": 1.5,
        "floor_ms_max": 2.5,
        "over_floor": 1.5,
        "floor_cache_bytes": 1_234_000_000,
        "floor_experts_per_layer": None,
        "ms_prefill": 8.0,
        "floor_prefill_ms": 4.0,
        "prefill_over_floor": 2.0,
    }
    bench.print_floor([row])
    assert "plain | exact | 4 | 3.00 | 2.00 [1.50, 2.50] | 1.50 | 1.234" in capsys.readouterr().out


def test_verify_widths_are_listed_narrowest_first() -> None:
    assert bench.widths_text({15: 2, 3: 5, 7: 1}) == "3:5;7:1;15:2"
    assert bench.widths_text({}) is None


def test_a_decode_step_is_the_sum_of_its_phases_per_call() -> None:
    """DFlash: draft + verify + accept + commit per verify; plain: decode per decode call."""
    phases = {"host_s_draft": 0.001, "host_s_verify": 0.002, "host_s_accept": 0.003, "host_s_commit": 0.004}
    phases["host_s_decode"] = 0.5
    assert bench.decode_step_ms(phases, {"verify": 2, "decode": 5}, "host_s_", True) == pytest.approx(5.0)
    assert bench.decode_step_ms(phases, {"verify": 2, "decode": 5}, "host_s_", False) == pytest.approx(100.0)
    assert bench.decode_step_ms({}, {"verify": 0, "decode": 0}, "host_s_", True) == 0.0


def test_a_prompts_files_blank_lines_are_skipped_and_errors_name_the_files_line(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('\n{"prompt_ids": [1, 2]}\n\n{"prompt_ids": [3]}\n')
    assert bench.read_prompts(str(prompts), None, 3) == [[1, 2], [3], [1, 2]]
    prompts.write_text('{"prompt_ids": [1]}\n\n{"prompt_ids": [2]}\nnot json\n')
    with pytest.raises(ReferenceEngineError, match=r"prompts\.jsonl:4: not valid JSON"):
        bench.read_prompts(str(prompts), None, 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--random-shape", "qwen3-small", "--draft-arch", "dflash,dflash"], "--draft-arch must be distinct"),
        (["--numerics", "exact,exact"], "--numerics must be distinct"),
    ],
    ids=["draft-arch-twice", "numerics-twice"],
)
def test_a_value_given_twice_is_refused(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        bench.BenchArgs.parse(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_a_spread_warning_ends_with_what_narrows_it(capsys) -> None:
    row = {"mode": "plain", "draft": None, "numerics": "exact", "concurrency": 1, "repeats": 2}
    row |= {"output_tokens_per_s": 10.0, "output_tokens_per_s_min": 5.0, "output_tokens_per_s_max": 15.0}
    row |= {"mean_acceptance_length": 1.0, "ms_per_step": 1.0}
    row |= {f"ms_{phase}": 0.0 for phase in bench.PHASES}
    bench.print_table([row])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("# warning: repeats disagree by more than 10%: plain c=1 output_tokens_per_s")
    assert lines[-1] == "# (a busy or throttled machine; more --repeats or a quieter machine narrow it)"


@pytest.mark.parametrize("row", ['{"prompt_ids": 5}', '{"prompt_ids": null}'])
def test_a_prompts_row_whose_ids_are_not_a_list_is_a_clear_error(row: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(row + "\n")
    with pytest.raises(ReferenceEngineError, match="prompt_ids"):
        bench.read_prompts(str(prompts), None, 1)


def test_an_out_file_in_a_missing_folder_is_one_error_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "missing" / "bench.csv"
    argv = [*SMALL_RUN, "--concurrency", "1", "--repeats", "1", "--block-size", "4", "--out", str(out)]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(out.parent) in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# the soak


def test_the_first_difference_of_an_output_that_stops_early_is_where_it_stops() -> None:
    assert soak.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert soak.first_difference([1, 2], [1, 2, 3]) == 2
    assert soak.first_difference([1, 2, 3, 4], [1, 2]) == 2
    assert soak.first_difference([], [5]) == 0


def test_the_random_prompt_pool_is_256_prompts_of_8_to_the_longest_tokens() -> None:
    import random

    pool = soak.random_prompts(random.Random(0), 50, 12)
    assert len(pool) == 256
    assert {len(p) for p in pool} == set(range(8, 13))
    assert all(0 <= t < 50 for p in pool for t in p)


def test_a_random_shapes_soak_runs_a_block_16_draft_and_sums_up_every_field(tmp_path: Path, capsys) -> None:
    out = tmp_path / "soak.json"
    argv = ["--random-shape", "qwen3-small", "--device", "cpu", "--concurrency", "4", "--requests", "6"]
    argv += ["--max-tokens", "8", "--prompt-len", "8", "--abort-share", "0", "--out", str(out)]
    assert soak.main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["verify_widths"]) == ["15"]  # the CPU verifies the whole block of 16
    assert (result["arrived"], result["finished"], result["aborted"]) == (6, 6, 0)
    assert result["errors"] == [] and result["mismatches"] == {} and result["output_tokens"] == 48
    sizes = [int(k) for k in result["batch_sizes"]]
    assert sizes == sorted(sizes) and max(sizes) <= 4
    assert sum(result["batch_sizes"].values()) == result["steps"]
    assert "soak PASS: 6 finished, 0 aborted, 0 errors, 0 mismatches" in capsys.readouterr().err


def test_a_soak_given_both_a_model_and_a_random_shape_is_refused(tmp_path: Path, capsys) -> None:
    argv = [
        "--random-shape",
        "qwen3-small",
        "--model",
        str(tmp_path / "none"),
        "--draft",
        str(tmp_path / "none"),
    ]
    argv += [
        "--device",
        "cpu",
        "--concurrency",
        "1",
        "--requests",
        "1",
        "--max-tokens",
        "8",
        "--prompt-len",
        "8",
    ]
    assert soak.main(argv) == 2
    assert "--random-shape" in capsys.readouterr().err


def test_a_soak_of_no_request_is_refused(capsys) -> None:
    argv = ["--random-shape", "qwen3-small", "--device", "cpu", "--concurrency", "1", "--requests", "0"]
    assert soak.main([*argv, "--max-tokens", "8", "--prompt-len", "8"]) == 2
    assert "--requests" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# scripts/profile.sh under a stand-in nsys


def profile_tools(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(a stand-in nsys, a python that has nvtx, the nsys call log). The nsys records each call
    with the DFLASH_NVTX and OMP_NUM_THREADS it was given; `profile` writes the report (none
    under FAKE_NO_REPORT, a .qdstrm under FAKE_QDSTRM) and the run's CSV and exits FAKE_RC;
    `stats` writes the fixture captures of the label."""
    log = tmp_path / "nsys.jsonl"
    nsys = tmp_path / "tools" / "nsys"
    nsys.parent.mkdir()
    record = (
        "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
        "'nvtx': os.environ.get('DFLASH_NVTX'), 'threads': os.environ.get('OMP_NUM_THREADS')}))"
    )
    nsys.write_text(
        "#!/bin/bash\n"
        f'"{sys.executable}" -c "{record}" "$@" >> "{log}"\n'
        "case $1 in\n"
        '  --version) echo "NVIDIA Nsight Systems version 2099.1.1"; exit 0 ;;\n'
        "  profile)\n"
        "    while (($#)); do [[ $1 == -o ]] && o=$2; shift; done\n"
        '    [[ -n ${FAKE_QDSTRM:-} ]] && : > "$o.qdstrm"\n'
        '    [[ -z ${FAKE_NO_REPORT:-} ]] && : > "$o.nsys-rep"\n'
        f'    cp "{FIXTURES}/${{o##*/}}.csv" "${{o%/*}}/"\n'
        "    exit ${FAKE_RC:-0} ;;\n"
        "  stats)\n"
        "    while (($#)); do [[ $1 == --output ]] && o=$2; shift; done\n"
        f'    cp "{FIXTURES}/${{o##*/}}"_*.csv "${{o%/*}}/" ;;\n'
        "esac\n"
    )
    python = tmp_path / "tools" / "python"
    python.write_text(
        "#!/bin/bash\n"
        "if [[ $1 == -c && $2 == 'import nvtx' ]]; then exit 0; fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    # an nsys on PATH that must not be used while NSYS names one
    wrong = tmp_path / "path" / "nsys"
    wrong.parent.mkdir()
    wrong.write_text("#!/bin/bash\necho 'the nsys on PATH ran' >&2\nexit 99\n")
    for tool in (nsys, python, wrong):
        tool.chmod(0o755)
    return nsys, python, log


def run_profile(tmp_path: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    tools = tmp_path / "tools"
    if not tools.exists():
        profile_tools(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PROFILE_", "NSYS", "FAKE_"))}
    base |= {"PATH": f"{tmp_path / 'path'}:{os.environ['PATH']}", "NSYS": str(tools / "nsys")}
    base |= {"PYTHON": str(tools / "python"), "MPLBACKEND": "Agg"}
    return subprocess.run(
        ["/bin/bash", str(PROFILE), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=base | env,
        timeout=120,
    )


def nsys_calls(tmp_path: Path, verb: str) -> list[dict]:
    log = tmp_path / "nsys.jsonl"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [c for c in calls if c["argv"][0] == verb]


def test_each_mode_and_concurrency_is_profiled_in_its_own_process_with_the_documented_options(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "commands.txt").write_text("a stale line of an earlier run\n")
    workload = ["--random-shape", "qwen3-small", "--prompts", "my prompts.jsonl"]
    done = run_profile(tmp_path, ["--out", str(out), "--concurrency", "1,8", "--threads", "2", *workload])
    assert done.returncode == 0, done.stderr
    labels = [(mode, c) for c in ("1", "8") for mode in ("plain", "dflash")]
    profiles = nsys_calls(tmp_path, "profile")
    assert [c["argv"][c["argv"].index("-o") + 1] for c in profiles] == [f"{out}/{m}-c{c}" for m, c in labels]
    for call, (mode, c) in zip(profiles, labels):
        argv = call["argv"]
        assert (call["nvtx"], call["threads"]) == ("1", "2")
        assert "--capture-range=cudaProfilerApi" in argv and "--capture-range-end=stop" in argv
        bench_argv = argv[argv.index("scripts/bench_engine.py") + 1 :]
        label = f"{mode}-c{c}"
        assert bench_argv == ["--modes", mode, "--concurrency", c, "--profile-capture"] + [
            "--out",
            f"{out}/{label}.csv",
            *workload,
        ]
    stats = nsys_calls(tmp_path, "stats")
    assert len(stats) == 4
    for call, (mode, c) in zip(stats, labels):
        argv = call["argv"]
        assert argv[argv.index("--report") + 1] == "nvtx_sum,nvtx_gpu_proj_sum,cuda_gpu_kern_sum"
        assert argv[argv.index("--output") + 1] == f"{out}/{mode}-c{c}"
        assert argv[-1] == f"{out}/{mode}-c{c}.nsys-rep"
    assert (out / "profile.md").is_file()
    commands = (out / "commands.txt").read_text()
    assert "stale" not in commands and commands.startswith("# OMP_NUM_THREADS=2 ")
    assert commands.count(r"my\ prompts.jsonl") == 4  # each profile command, quoted


def test_a_failing_nsys_run_fails_the_script_at_once(tmp_path: Path) -> None:
    """nsys exits 3 (after writing its report): the script stops there with that status; the
    concurrency is PROFILE_CONCURRENCY's."""
    out = tmp_path / "out"
    done = run_profile(
        tmp_path, ["--out", str(out), "--random-shape", "qwen3-small"], FAKE_RC="3", PROFILE_CONCURRENCY="8"
    )
    assert done.returncode == 3
    profiles = nsys_calls(tmp_path, "profile")
    assert [c["argv"][c["argv"].index("-o") + 1] for c in profiles] == [f"{out}/plain-c8"]
    assert not nsys_calls(tmp_path, "stats") and not (out / "profile.md").exists()


def test_a_stale_report_is_not_taken_for_the_new_one_and_a_failed_import_is_named(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "plain-c1.nsys-rep").write_text("an earlier run's report")
    done = run_profile(
        tmp_path, ["--out", str(out), "--concurrency", "1"], FAKE_NO_REPORT="1", FAKE_QDSTRM="1"
    )
    assert done.returncode == 2
    assert done.stderr == (
        f"error: nsys wrote no {out}/plain-c1.nsys-rep; plain-c1.qdstrm is there, so its import failed: "
        "the importer needs libdw.so.1 and libelf.so.1 (put them in a folder on LD_LIBRARY_PATH)\n"
    )
    assert not nsys_calls(tmp_path, "stats")


def test_without_the_nvtx_package_nsys_is_not_started(tmp_path: Path) -> None:
    if importlib.util.find_spec("nvtx") is not None:
        pytest.skip("nvtx is installed here")
    profile_tools(tmp_path)
    done = run_profile(tmp_path, ["--out", str(tmp_path / "out")], PYTHON=sys.executable)
    assert done.returncode == 2
    assert done.stderr.startswith(
        f"error: the nvtx Python package is missing for {sys.executable}: pip install nvtx"
    )
    assert not nsys_calls(tmp_path, "profile")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "0"], "error: --threads must be a whole number >= 1, got '0'\n"),
        (["--modes=dflash"], "error: --modes=dflash is set by scripts/profile.sh; "),
        (["--out=x"], "error: --out=x is set by scripts/profile.sh; "),
    ],
)
def test_the_script_refuses_what_it_sets_and_a_thread_count_below_one(
    tmp_path: Path, args: list[str], message: str
) -> None:
    done = run_profile(tmp_path, ["--out", str(tmp_path / "out"), *args])
    assert done.returncode == 2 and done.stderr.startswith(message)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# scripts/bench_gpu_suite.sh under stand-ins for python and timeout

LOG_TABLES = """\
draft | numerics | concurrency | DFlash/plain tok/s | DFlash/plain decode steps | DFlash step / plain step
dflash | exact | 16 | 1.11 | 1.11 | 1.11
draft | numerics | concurrency | DFlash/plain tok/s | DFlash/plain decode steps | DFlash step / plain step
dflash | exact | 16 | 2.22 | 2.22 | 2.22
mode | numerics | concurrency | ms per decode step | floor ms [min, max] | x floor | cache GB
plain | exact | 16 | 3.00 | 2.00 [1.90, 2.10] | 1.50 | 0.100
"""


def run_suite(tmp_path: Path, budget: str, rc: int = 0, **env: str) -> subprocess.CompletedProcess:
    """The suite with a python that says there is a GPU and otherwise prints LOG_TABLES and
    exits `rc`, and a timeout that logs its limit to timeout.log and runs the command."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    (tmp_path / "tables.txt").write_text(LOG_TABLES)
    python = tools / "python"
    python.write_text(
        "#!/bin/bash\n"
        'if [ "$1" = -c ]; then echo 1; exit 0; fi\n'
        f'echo "$@" >> "{tmp_path}/python.log"\n'
        f'cat "{tmp_path}/tables.txt"\n'
        f"exit {rc}\n"
    )
    timeout = tools / "timeout"
    timeout.write_text(f'#!/bin/bash\necho "$1" >> "{tmp_path}/timeout.log"\nshift\n"$@"\n')
    for tool in (python, timeout):
        tool.chmod(0o755)
    return subprocess.run(
        ["bash", str(SUITE), str(tmp_path / "out"), budget],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHON": str(python), "PATH": f"{tools}:/usr/bin:/bin", **env},
    )


def test_a_part_runs_under_what_is_left_of_the_budget_and_its_failure_and_last_table_are_shown(
    tmp_path: Path,
) -> None:
    """60 s left for the 4b part (usually 80): its limit is what is left; its benchmark exits 1;
    the last DFlash/plain table of its log is printed, up to the next table's header."""
    done = run_suite(tmp_path, "60", rc=1, PARTS="4b")
    assert done.returncode == 0, done.stderr
    (limit,) = (tmp_path / "timeout.log").read_text().split()
    assert 55 <= int(limit) <= 60
    out = tmp_path / "out"
    lines = done.stdout.splitlines()
    assert f"   exit status 1 (output: {out}/4b-c16.log)" in lines
    header = LOG_TABLES.splitlines()[2]
    assert lines[lines.index(header) + 1 :] == ["dflash | exact | 16 | 2.22 | 2.22 | 2.22", lines[-1]]
    assert lines[-1].startswith("== done at ")


def test_a_part_that_reaches_its_limit_says_so(tmp_path: Path) -> None:
    done = run_suite(tmp_path, "60", rc=124, PARTS="4b")
    (limit,) = (tmp_path / "timeout.log").read_text().split()
    out = tmp_path / "out"
    assert f"   timed out after {limit} s (partial output: {out}/4b-c16.log)" in done.stdout.splitlines()
    assert "exit status" not in done.stdout


def test_parts_that_do_not_fit_what_is_left_are_skipped_unrun(tmp_path: Path) -> None:
    done = run_suite(tmp_path, "40", PARTS="4b sweep")
    assert done.returncode == 0
    assert done.stdout.count("   skipped: under ") == 2 and "skipped: under 50 s left" in done.stdout
    assert not (tmp_path / "timeout.log").exists() and not (tmp_path / "python.log").exists()


@pytest.mark.parametrize(
    ("parts", "message"),
    [(" ", "PARTS names no part"), ("*", "unknown part '*'")],
    ids=["empty", "a-pattern"],
)
def test_parts_naming_nothing_or_a_pattern_are_refused(tmp_path: Path, parts: str, message: str) -> None:
    done = run_suite(tmp_path, "550", PARTS=parts)
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "python.log").exists()


def test_the_reach_part_runs_the_hybrid_moe_shape_per_token_and_the_others_replay(tmp_path: Path) -> None:
    done = run_suite(tmp_path, "100000", PARTS="reach", REACH_SHAPES="qwen3.5-35b-a3b qwen3-8b")
    assert done.returncode == 0, done.stderr
    runs = [line.split() for line in (tmp_path / "python.log").read_text().splitlines()]
    strategies = {r[r.index("--random-shape") + 1]: r[r.index("--commit-strategy") + 1] for r in runs}
    assert strategies == {"qwen3.5-35b-a3b": "per_token", "qwen3-8b": "replay"}


# ---------------------------------------------------------------------------------------------
# the Makefile's command lines (make -n: nothing runs)


def make_plan(target: str, *args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make on PATH")
    done = subprocess.run(
        ["make", "-s", "-n", target, f"PYTHON={sys.executable}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.replace("\\\n", " ").split())  # one line, single spaces


def test_make_profile_gives_the_script_its_threads_concurrency_and_workload() -> None:
    plan = make_plan("profile", "BENCH_DEVICE=cpu", "PROFILE_OUT=results/p")
    assert 'PROFILE_THREADS="1" bash scripts/profile.sh --out "results/p" --concurrency "1,8" ' in plan
    assert "--model reference_engine/assets/demo/target --draft reference_engine/assets/demo/draft" in plan
    assert 'PROFILE_THREADS="" bash' in make_plan("profile", "BENCH_DEVICE=cuda")


def test_make_bench_runs_both_servers_on_one_cpu_thread_and_forces_acceptance_on_side_b_only() -> None:
    plan = make_plan("bench", "BENCH_DEVICE=cpu", "BENCH_ACCEPTANCE=4")
    a, b = plan.split("--a-cmd", 1)[1].split("--b-cmd", 1)
    b, notes = b.split("--a-label", 1)
    assert "--threads 1 " in a and "--threads 1 " in b
    assert "--oracle-acceptance" not in a and "--oracle-acceptance 4 " in b
    assert "acceptance forced to 4 by the oracle proposer" in notes
    assert "--oracle-acceptance" not in make_plan("bench", "BENCH_DEVICE=cpu")


# ---------------------------------------------------------------------------------------------
# scripts/eval_demo_drafts.py


def eval_script():
    spec = importlib.util.spec_from_file_location(
        "eval_demo_drafts", ROOT / "scripts" / "eval_demo_drafts.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_acceptance_json_names_the_machine_torch_device_and_each_drafts_block_sizes(
    tmp_path: Path, monkeypatch
) -> None:
    script = eval_script()
    figures = {"mean_acceptance_length": 2.0, "acceptance_rate": 0.5, "mismatched_requests": 0}
    monkeypatch.setattr(
        script, "evaluate", lambda target, draft, prompts, sizes, tokens: dict.fromkeys(sizes, figures)
    )
    out = tmp_path / "acceptance.json"
    assert script.main([str(DEMO_DRAFT), "--block-sizes", "4,8", "--max-tokens", "2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got) == {"machine", "torch", "device", "acceptance"}
    assert (got["torch"], got["device"]) == (torch.__version__, "cpu")
    assert got["acceptance"] == {str(DEMO_DRAFT): {"4": figures, "8": figures}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_acceptance_script_on_a_device_that_is_not_there_is_one_error_line(capsys) -> None:
    assert eval_script().main([str(DEMO_DRAFT), "--device", "cuda", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eval_demo_drafts.py: ") and err.count("\n") == 1
