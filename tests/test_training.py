"""The demo-pair training code: the chunked Gated DeltaNet equals the engine's recurrence,
training forwards compute what the engine computes, and the recipe runs end to end (tiny
settings) into checkpoints the engine loads, reproducibly from the seed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.kernels.reference import gated_delta_chunked, gated_delta_recurrent
from reference_engine.kernels.reference import l2_norm as l2_normalize
from reference_engine.models.dflash import DraftState
from reference_engine.runtime.decode import generate_plain, new_state, prefill
from reference_engine.runtime.request import SamplingParams
from reference_engine.training.corpus import Corpus, CorpusError, fetch, read_lock
from reference_engine.training.loops import (
    Checkpoint,
    Interrupted,
    block_labels,
    block_logits,
    block_loss,
    greedy_continue,
    optimise,
    sequence_forward,
    target_views,
)

from .together import Results, together

ROOT = Path(__file__).resolve().parent.parent


def delta_inputs(T: int, seed: int = 0, heads: int = 3, k_dim: int = 8, v_dim: int = 5):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = l2_normalize(randn(2, T, heads, k_dim)) * k_dim**-0.5
    k = l2_normalize(randn(2, T, heads, k_dim))
    g = -torch.rand(2, T, heads, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(2, T, heads, generator=gen, dtype=torch.float64)
    return q, k, randn(2, T, heads, v_dim), g, beta, randn(2, heads, k_dim, v_dim)


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (64, 16), (100, 32), (33, 64)])
def test_chunked_delta_rule_equals_the_token_by_token_recurrence(T: int, chunk: int) -> None:
    inputs = delta_inputs(T)
    out, final = gated_delta_recurrent(*inputs)
    chunked_out, chunked_final = gated_delta_chunked(*inputs, chunk=chunk)
    torch.testing.assert_close(chunked_out, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(chunked_final, final, rtol=0, atol=1e-12)


def test_chunked_delta_rule_has_the_recurrences_gradients() -> None:
    inputs = [t.requires_grad_() for t in delta_inputs(20, seed=1)]
    weights = torch.randn(2, 20, 3, 5, dtype=torch.float64)
    grads = []
    for fn in (gated_delta_recurrent, lambda *a: gated_delta_chunked(*a, chunk=8)):
        out, final = fn(*inputs)
        grads.append(torch.autograd.grad((out * weights).sum() + final.sum(), inputs))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_one_token_chunks_and_a_changed_input_are_told_apart() -> None:
    """One-token chunks (a trivially diagonal system) are exact too, and the comparison is
    sharp enough to see a 10% change in the keys."""
    q, k, v, g, beta, s0 = delta_inputs(16, seed=2)
    out, _ = gated_delta_recurrent(q, k, v, g, beta, s0)
    single, _ = gated_delta_chunked(q, k, v, g, beta, s0, chunk=1)
    torch.testing.assert_close(single, out, rtol=0, atol=1e-12)
    wrong, _ = gated_delta_chunked(q, k * 0.9, v, g, beta, s0, chunk=8)
    assert (wrong - out).abs().max() > 1e-3


@pytest.fixture(scope="module")
def hybrid_pair(tiny_pair):
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=4, layers=3, hidden=64)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def test_sequence_forward_gives_the_engines_prefill_logits_and_features(hybrid_pair) -> None:
    target, draft = hybrid_pair
    ids = torch.randint(0, 500, (2, 70), generator=torch.Generator().manual_seed(0))
    layers = draft.config.target_layer_ids
    out = sequence_forward(target, ids, layers)
    for row in range(2):
        state = new_state(target, 70)
        positions = torch.arange(70)[None]
        ref = target(ids[row : row + 1], positions, torch.tensor([0]), state, 70, layers)
        torch.testing.assert_close(out.logits[row], ref.logits[0], rtol=0, atol=1e-9)
        torch.testing.assert_close(out.features[row], ref.features[0], rtol=0, atol=1e-9)


def test_greedy_continue_equals_plain_greedy_decode(hybrid_pair) -> None:
    target, _ = hybrid_pair
    prompts = torch.randint(0, 500, (3, 9), generator=torch.Generator().manual_seed(1))
    rows = greedy_continue(target, prompts, 12)
    for prompt, row in zip(prompts.tolist(), rows.tolist()):
        plain = generate_plain(target, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        assert row == prompt + plain.output_ids


def draft_in_the_engine(target, draft, seq: torch.Tensor, p: int, length: int) -> torch.Tensor:
    """The draft's logits for the block at anchor p, computed the way the engine does:
    prefill of the prefix (context features), then one block of `length` tokens."""
    cfg = draft.config
    state = new_state(target, len(seq))
    _, features = prefill(target, state, 0, seq[:p].tolist(), cfg.target_layer_ids)
    dstate = DraftState(cfg, 1, len(seq), torch.float64)
    draft.append_context(features[None], torch.arange(p)[None], torch.tensor([0]), dstate)
    block = torch.tensor([[seq[p].item()] + [cfg.mask_token_id] * (length - 1)])
    hidden = draft(
        target.embed(block) * cfg.input_embedding_scale,
        torch.arange(p, p + length)[None],
        torch.tensor([0]),
        dstate,
        p + length,
    )
    return draft.logits(hidden[:, 1:], target.lm_head_weight)[0]  # [length-1, vocab]


def test_block_logits_and_labels_are_what_the_engine_drafts_and_verifies(hybrid_pair) -> None:
    """Training sees what serving sees: context = target features before the anchor, block
    = anchor + masks at the anchor's positions (shorter blocks too), labels = the target's
    greedy choices."""
    target, draft = hybrid_pair
    B = draft.config.block_size
    seqs = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[5, 30], [17, 36]])
    lengths = torch.tensor([B, 2, 3, B])
    layers = draft.config.target_layer_ids
    features, greedy = target_views(target, seqs, layers, draft.config.raw_last_layer, batch=1)
    logits = block_logits(draft, target, seqs, features, anchors, lengths)
    labels = block_labels(greedy, anchors, B)
    for i, (row, p) in enumerate([(0, 5), (0, 30), (1, 17), (1, 36)]):
        n = lengths[i].item() - 1
        ref = draft_in_the_engine(target, draft, seqs[row], p, n + 1)
        torch.testing.assert_close(logits[i, :n], ref, rtol=0, atol=1e-9)
        plain = generate_plain(
            target, seqs[row, : p + 1].tolist(), SamplingParams(max_tokens=1, ignore_eos=True)
        )
        assert labels[i, 0].item() == plain.output_ids[0]
        full = target(
            seqs[row : row + 1], torch.arange(40)[None], torch.tensor([0]), new_state(target, 40), 40
        ).logits[0]
        assert labels[i].tolist() == full[p : p + B - 1].argmax(-1).tolist()


def test_block_loss_weights_early_slots_and_ignores_slots_past_a_blocks_length() -> None:
    labels = torch.tensor([[1, 2, 3], [1, 2, 3]])
    right = torch.nn.functional.one_hot(labels, 5).double() * 50
    wrong_last = right.clone()
    wrong_last[1, 2] = right[1, 2].roll(1)
    lengths = torch.tensor([4, 3])  # row 1 has slots 1..2 only: its slot 3 does not count
    assert block_loss(wrong_last, labels, lengths, 2.0) < 1e-12
    assert block_loss(wrong_last, labels, None, 2.0) > 1.0
    early, late = right.clone(), right.clone()
    early[0, 0], late[0, 2] = right[0, 0].roll(1), right[0, 2].roll(1)
    assert block_loss(early, labels, None, 2.0) > block_loss(late, labels, None, 2.0)


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def make_wheel_corpus(
    folder: Path, packages=("json", "email", "http", "logging", "xml"), heldout=("http",)
) -> tuple[Path, Path]:
    """Wheels built here from standard-library packages (plus a vendored copy of the held-out
    one inside the first), served from file:// URLs, and their lock. Returns (lock, source)."""
    source = folder / "index"
    source.mkdir(parents=True)
    rows = []
    for i, name in enumerate(packages):
        filename = f"{name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(source / filename, "w") as archive:
            for path in sorted((STDLIB / name).rglob("*.py")):
                archive.write(path, f"{name}/{path.relative_to(STDLIB / name).as_posix()}")
            if i == 0 and name not in heldout:
                vendored = next((STDLIB / heldout[0]).glob("*.py"))
                archive.writestr(f"{name}/_vendor/{heldout[0]}/{vendored.name}", vendored.read_text())
            archive.writestr(f"{name}-1.0.dist-info/METADATA", "Name: x\n")
        data = (source / filename).read_bytes()
        rows.append(
            {
                "name": name,
                "version": "1.0",
                "filename": filename,
                "url": (source / filename).as_uri(),
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "heldout": name in heldout,
            }
        )
    lock = folder / "lock.json"
    lock.write_text(json.dumps({"cutoff": "2026-01-01", "index": "test", "wheels": rows}))
    return lock, source


def test_the_corpus_is_the_locked_wheels_split_by_package(tmp_path: Path) -> None:
    lock, _ = make_wheel_corpus(tmp_path)
    logs = []
    corpus = Corpus.from_lock(tmp_path / "cache", lock, log=logs.append)
    assert len(logs) == 5 and "fetched 5/5" in logs[-1]
    assert corpus.heldout and all(p.startswith("http-1.0") for p in corpus.heldout)
    assert not any(p.startswith("http-1.0") for p in corpus.train)
    # a vendored copy of a held-out package never reaches the train set; no metadata files
    assert not any("_vendor" in p or "dist-info" in p for p in corpus.train)
    assert (
        corpus.text("json-1.0-py3-none-any.whl:json/decoder.py")
        == (STDLIB / "json" / "decoder.py").read_text()
    )
    # the cache is reused (nothing fetched), and the real lock pins real wheels
    Corpus.from_lock(tmp_path / "cache", lock, log=logs.append)
    assert len(logs) == 5
    wheels = read_lock()
    assert len(wheels) >= 50 and sum(w.heldout for w in wheels) >= 5
    assert all(
        w.url.startswith("https://files.pythonhosted.org/")
        and len(w.sha256) == 64
        and w.filename.endswith("-none-any.whl")
        for w in wheels
    )


def test_a_wheel_that_does_not_match_its_hash_is_refused(tmp_path: Path) -> None:
    lock, source = make_wheel_corpus(tmp_path)
    with zipfile.ZipFile(source / "json-1.0-py3-none-any.whl", "a") as archive:
        archive.writestr("json/extra.py", "x = 1\n")
    with pytest.raises(CorpusError, match="sha256 differs from the lock"):
        Corpus.from_lock(tmp_path / "cache", lock, log=lambda m: None)
    assert not list((tmp_path / "cache").glob("json-*"))  # nothing half-kept
    missing = json.loads(lock.read_text())
    missing["wheels"][0]["url"] = (tmp_path / "gone.whl").as_uri()
    lock.write_text(json.dumps(missing))
    with pytest.raises(CorpusError, match="cannot download"):
        fetch(read_lock(lock), tmp_path / "cache2", log=lambda m: None)


def test_a_checkpoint_in_parts_resumes_a_loop_to_the_same_weights(tmp_path: Path) -> None:
    """Stopped at its time budget and resumed, a loop ends where an uninterrupted one does."""

    def run(folder: Path, deadline: float | None):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        gen = torch.Generator().manual_seed(1)

        def loss_at(step: int) -> torch.Tensor:
            x = torch.randn(4, 8, generator=gen)
            return (model(x) - x).pow(2).mean()

        fit = optimise(
            model,
            12,
            1e-2,
            loss_at,
            lambda m: None,
            "t",
            validate=lambda: model.weight.abs().sum().item(),
            validate_every=4,
            checkpoint=Checkpoint(folder, "t", part_bytes=700),
            checkpoint_every=5,
            generator=gen,
            deadline=deadline,
        )
        return model.state_dict(), fit

    want, want_fit = run(tmp_path / "a", None)
    with pytest.raises(Interrupted, match="stopped at step 1/12"):
        run(tmp_path / "b", deadline=0.0)
    assert len(list((tmp_path / "b").glob("t.ckpt.[0-9]*"))) > 1  # written in parts
    got, got_fit = run(tmp_path / "b", None)
    assert got_fit == want_fit
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_block_lengths_are_full_blocks_or_a_last_blocks_length() -> None:
    from reference_engine.training.recipe import Recipe, draw_block_lengths

    recipe = Recipe()
    lengths = draw_block_lengths(recipe, 20000, torch.Generator().manual_seed(0))
    counts = torch.bincount(lengths, minlength=17)
    assert counts[:2].sum() == 0 and counts[17:].sum() == 0
    assert set(counts.nonzero().flatten().tolist()) == set(range(2, 17))
    short = counts.sum() - counts[8] - counts[16] + 2 * counts[3]  # lengths 8, 16 also drawn short
    assert 0.15 < short.item() / 20000 < 0.25
    assert abs(counts[8].item() - counts[16].item()) < 0.05 * 20000


def smoke(out: Path, lock: Path, cache: Path, *extra: str, seed: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train_demo_pair.py"),
            "--smoke",
            "--device",
            "cpu",
            "--seed",
            str(seed),
            "--out",
            str(out),
            "--corpus-lock",
            str(lock),
            "--corpus-cache",
            str(cache),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def wheel_corpus(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("corpus")
    lock, _ = make_wheel_corpus(folder)
    return lock, folder / "cache"


def parts_run(parts: Path, lock: Path, cache: Path) -> tuple[list[subprocess.CompletedProcess], dict]:
    """--stop-after target, then a --max-minutes 0 stop inside the draft loop, then the same
    command again (each part only once the one before it succeeded); with what the first
    part left: {"target": its target weights exist, "draft": its draft folder exists}."""
    first = smoke(parts, lock, cache, "--stop-after", "target")
    left = {
        "target": (parts / "target" / "model.safetensors").exists(),
        "draft": (parts / "draft").exists(),
    }
    if first.returncode != 0:
        return [first], left
    second = smoke(parts, lock, cache, "--max-minutes", "0")
    if second.returncode != 3:
        return [first, second], left
    return [first, second, smoke(parts, lock, cache)], left


def rejects_bad_settings(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train_demo_pair.py"),
            "--smoke",
            "--prompt-len",
            "60",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def too_small_corpus(folder: Path) -> subprocess.CompletedProcess:
    lock, _ = make_wheel_corpus(folder, packages=("json",), heldout=("json",))
    return smoke(folder / "out", lock, folder / "cache")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, wheel_corpus) -> Results:
    """The recipe runs of the tests below, side by side in the background (tests/together.py)
    while `smoke_pair` runs. Each fills a corpus cache of its own from the lock, as the first
    run of `smoke_pair` fills the shared one (a cache is not written by two runs at once)."""
    lock, _ = wheel_corpus

    def folder(name: str) -> Path:
        return tmp_path_factory.mktemp(name)

    def second_smoke() -> tuple[Path, subprocess.CompletedProcess]:
        out = folder("smoke-b")
        return out, smoke(out / "b", lock, out / "cache")

    def in_parts() -> tuple[Path, list[subprocess.CompletedProcess], dict]:
        out = folder("parts")
        return out / "parts", *parts_run(out / "parts", lock, out / "cache")

    return together(
        request,
        {
            "test_smoke_recipe_writes_a_loadable_pair_reproducibly": second_smoke,
            "test_a_recipe_run_in_parts_equals_one_run": in_parts,
            "test_recipe_rejects_bad_settings": lambda: rejects_bad_settings(folder("bad")),
            "test_a_corpus_too_small_to_split_is_one_error_line_with_code_2": lambda: too_small_corpus(
                folder("small")
            ),
        },
    )


@pytest.fixture(scope="module")
def smoke_pair(tmp_path_factory, wheel_corpus) -> Path:
    out = tmp_path_factory.mktemp("smoke") / "a"
    run = smoke(out, *wheel_corpus)
    assert run.returncode == 0, run.stderr
    return out


def test_smoke_recipe_writes_a_loadable_pair_reproducibly(runs, request, smoke_pair: Path) -> None:
    out, second = runs[request.node.name]  # the same smoke command, into out / "b"
    assert second.returncode == 0, second.stderr
    for name in (
        "target/model.safetensors",
        "draft/model.safetensors",
        "target/tokenizer.json",
        "heldout_prompts.jsonl",
    ):
        assert (smoke_pair / name).read_bytes() == (out / "b" / name).read_bytes(), name
    results = json.loads((smoke_pair / "training.json").read_text())
    assert set(results["acceptance"]) == {"2", "4"}
    assert all(row["mismatched_requests"] == 0 for row in results["acceptance"].values())
    assert results["corpus"]["heldout_packages"] == ["http"]
    assert len(results["draft"]["curve"]) == 4 and len(results["target"]["curve"]) == 6
    card = (smoke_pair / "MODEL_CARD.md").read_text()
    assert "| 4 |" in card and "http are held out" in card and "| draft step | loss |" in card
    target = load_target(smoke_pair / "target")
    draft = load_draft(smoke_pair / "draft", target)
    assert draft.config.block_size == 4 and target.config.is_hybrid


def test_a_recipe_run_in_parts_equals_one_run(runs, request, smoke_pair: Path) -> None:
    """--stop-after target, then a --max-minutes 0 stop inside the draft loop, then the
    same command again: the same files as one uninterrupted run."""
    parts, done, left = runs[request.node.name]  # parts_run: the three commands
    first = done[0]
    assert first.returncode == 0, first.stderr
    assert left["target"] and not left["draft"]  # after the first part
    second = done[1]
    assert second.returncode == 3, second.stderr
    assert "stopped at step 1/4" in second.stdout and "resume" in second.stdout
    third = done[2]
    assert third.returncode == 0, third.stderr
    assert "draft: resumed at step 1/4" in third.stdout and "target step" not in third.stdout
    for name in ("target/model.safetensors", "draft/model.safetensors", "heldout_prompts.jsonl"):
        assert (parts / name).read_bytes() == (smoke_pair / name).read_bytes(), name
    assert not list((parts / "work").glob("*.ckpt.*"))  # finished stages leave no checkpoint


def test_recipe_rejects_bad_settings(runs, request) -> None:
    run = runs[request.node.name]  # rejects_bad_settings: --smoke --prompt-len 60
    assert run.returncode == 2
    assert "seq_len must hold a prompt and one block" in run.stderr


def test_a_corpus_too_small_to_split_is_one_error_line_with_code_2(runs, request) -> None:
    run = runs[request.node.name]  # too_small_corpus: one package, and it is held out
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and "too few Python files" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_chunked_forward_refuses_padding_and_recording() -> None:
    from reference_engine.models.layers import ForwardContext, RotaryEmbedding

    rotary = RotaryEmbedding(4, 10000.0)
    positions = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="a chunked forward takes full rows"):
        ForwardContext(
            None,
            torch.tensor([0]),
            positions,
            2,
            rotary,
            torch.float32,
            valid_len=torch.tensor([1]),
            chunked=True,
        )


def test_pin_takes_the_newest_final_pure_python_wheel_before_the_cutoff(tmp_path, monkeypatch) -> None:
    """`pin` against a stand-in of PyPI's JSON simple index: prereleases, yanked files,
    platform wheels, sdists and uploads after the cut-off are passed over."""
    import io

    from reference_engine.training import corpus

    def wheel(name, upload="2026-01-01T00:00:00", yanked=False):
        return {
            "filename": name,
            "url": f"https://files.example/{name}",
            "yanked": yanked,
            "hashes": {"sha256": "ab" * 32},
            "size": 10,
            "upload-time": upload,
        }

    files = {
        "pkg": [
            wheel("pkg-1.0-py3-none-any.whl"),
            wheel("pkg-1.2-py3-none-any.whl"),
            wheel("pkg-1.3rc1-py3-none-any.whl"),
            wheel("pkg-1.4-py3-none-any.whl", yanked=True),
            wheel("pkg-1.5-cp312-cp312-manylinux_2_17_x86_64.whl"),
            wheel("pkg-1.6.tar.gz"),
            wheel("pkg-1.7-py3-none-any.whl", upload="2026-12-01T00:00:00"),
        ],
        "other": [wheel("other-2.0-py2.py3-none-any.whl")],
        "native": [wheel("native-1.0-cp312-cp312-win_amd64.whl")],
    }

    def urlopen(request, timeout):
        name = request.full_url.rstrip("/").rsplit("/", 1)[-1]
        return io.BytesIO(json.dumps({"files": files[name]}).encode())

    monkeypatch.setattr(corpus.urllib.request, "urlopen", urlopen)
    lock = tmp_path / "lock.json"
    assert (
        corpus.main(["--cutoff", "2026-11-01", "--heldout", "other", "--out", str(lock), "pkg", "other"]) == 0
    )
    rows = {w.name: w for w in read_lock(lock)}
    assert rows["pkg"].version == "1.2" and not rows["pkg"].heldout
    assert rows["other"].filename == "other-2.0-py2.py3-none-any.whl" and rows["other"].heldout
    with pytest.raises(CorpusError, match="native: no pure-Python wheel before 2026-11-01"):
        corpus.pin(["native"], set(), "2026-11-01", tmp_path / "x.json")
