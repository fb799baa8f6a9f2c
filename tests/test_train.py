"""Block fine-tuning on tiny random models: training forward == inference (docs/invariants.md, invariant 4), collation and masks,
loss goes down, checkpoint + resume reproduces the straight run, data and output-folder checks."""

import copy
import json
import os
import signal
import zlib

import pytest
import torch
from tiny import make_segs, rand_ids

from ragkv.engine.engine import Engine
from ragkv.engine.kv.state import decode_step
from ragkv.engine.options import FusionOptions, validate_fusion
from ragkv.engine.request.segments import Passage
from ragkv.errors import InvalidRequestError
from ragkv.eval.datasets import Example
from ragkv.train.checkpoint import (
    MARKER,
    STATE_FILE,
    OutputFolderError,
    latest_checkpoint,
    list_checkpoints,
    prepare_output,
)
from ragkv.train.config import TrainConfig, TrainConfigError
from ragkv.train.data import (
    IGNORE,
    Batch,
    TrainingDataError,
    build_examples,
    example_from_segments,
    example_mask,
    load_training_examples,
    local_positions,
)
from ragkv.train.data import collate as collate_on_cpu
from ragkv.train.loop import Trainer, answer_loss_sum, data_order, forward_logits, lr_factor, token_loss_sum

TOL = 1e-4




def toy_examples(n=6, seed=0):
    """Token-level examples with varied shapes (tiny models have no tokenizer)."""
    out = []
    for i in range(n):
        segs = make_segs(prefix=6, blocks=tuple(8 + (i + j) % 5 for j in range(2 + i % 2)), query=5, seed=seed + i)
        out.append(example_from_segments(segs, rand_ids(3 + i % 2, 500 + i) + [2], f"ex{i}"))
    return out


def maxdiff(a, b):
    return (a.cpu() - b.cpu()).abs().max().item()


def collate(*args, **kw):
    """Batches where the tiny models are (RAGKV_TEST_DEVICE), as the Trainer moves them."""
    return collate_on_cpu(*args, **kw).to(os.environ.get("RAGKV_TEST_DEVICE", "cpu"))


def fresh_model(tiny_loaded, arch="llama"):
    return copy.deepcopy(tiny_loaded[arch].model)  # never train the session-wide fixture's weights


# --- equivalence: training forward == inference ---

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_block_training_forward_equals_reuse_inference(arch, tiny_loaded):
    """The logits the block loss sees are the ones `reuse` produces: first token, then each answer token."""
    engine = Engine(tiny_loaded[arch])
    segs, answer = make_segs(), [17, 41, 99, 2]
    ex = example_from_segments(segs, answer)
    with torch.no_grad():
        logits = forward_logits(engine.model, collate([ex], "block"))[0]
    state, _ = engine.prefill(segs, FusionOptions(mode="reuse"))
    start = segs.num_tokens - 1
    assert maxdiff(state.logits, logits[start]) <= TOL
    for i, tok in enumerate(answer[:-1]):  # teacher forcing == decoding over the reused cache
        assert maxdiff(decode_step(engine.model, state, tok), logits[start + 1 + i]) <= TOL
    # the loss is taken exactly on those positions
    assert ex.labels[start + 1:] == answer and set(ex.labels[:start + 1]) == {IGNORE}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_block_local_training_forward_equals_reuse_without_reencoding(arch, tiny_loaded):
    """The w/o-pos ablation: training under the block mask with each passage at positions 0..n-1 sees the
    logits `reuse:pos=local` produces; those differ from re-encoded `reuse` (the positions do matter)."""
    engine = Engine(tiny_loaded[arch])
    segs, answer = make_segs(), [17, 41, 99, 2]
    ex = example_from_segments(segs, answer)
    batch = collate([ex], "block-local")
    lens = [len(segs.prefix)] + [len(b) for b in segs.blocks]
    want = torch.cat([torch.arange(n) for n in lens] + [torch.arange(sum(lens), len(ex))])
    assert torch.equal(batch.positions[0].cpu(), want)
    with torch.no_grad():
        logits = forward_logits(engine.model, batch)[0]
    state, stats = engine.prefill(segs, FusionOptions(mode="reuse", positions="local"))
    start = segs.num_tokens - 1
    assert maxdiff(state.logits, logits[start]) <= TOL
    for i, tok in enumerate(answer[:-1]):
        assert maxdiff(decode_step(engine.model, state, tok), logits[start + 1 + i]) <= TOL
    reencoded, again = engine.prefill(segs, FusionOptions(mode="reuse"))
    assert again.cache_misses == 0  # the same cache entries: only the rotation differs
    assert maxdiff(reencoded.logits, state.logits) > 1e-3
    with torch.no_grad():
        assert maxdiff(answer_loss_sum(engine.model, batch),
                       token_loss_sum(logits[None], batch.labels)) <= TOL


def test_local_positions_restart_per_block_and_pads_follow():
    segs = make_segs(prefix=3, blocks=(2, 4), query=2)
    ex = example_from_segments(segs, [7, 2])
    assert local_positions(ex, 15).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 9, 10, 11, 12, 13, 14]
    with pytest.raises(InvalidRequestError, match="applies to mode 'reuse' only"):
        validate_fusion(FusionOptions(mode="full", positions="local"))


def test_vanilla_training_forward_equals_full_inference(tiny_loaded):
    engine = Engine(tiny_loaded["llama"])
    segs = make_segs(seed=3)
    ex = example_from_segments(segs, [5, 2])
    batch = collate([ex], "vanilla")
    assert batch.mask is None
    with torch.no_grad():
        logits = forward_logits(engine.model, batch)[0]
    state, _ = engine.prefill(segs, FusionOptions(mode="full"))
    assert maxdiff(state.logits, logits[segs.num_tokens - 1]) <= TOL


@pytest.mark.parametrize("method", ["block", "block-local"])
def test_block_by_block_attention_equals_the_dense_mask(method, tiny_loaded):
    """Fine-tuning attends span by span (`SegmentedMask`); the dense Block-Attention mask is the reference:
    the same loss and the same gradients, padding included."""
    model = fresh_model(tiny_loaded).requires_grad_(True)
    batch = collate(toy_examples(3), method)
    dense = Batch(batch.ids, batch.labels, batch.mask.dense(batch.ids.device), batch.positions)
    grads = []
    for b in (batch, dense):
        model.zero_grad()
        loss = token_loss_sum(forward_logits(model, b), b.labels)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (fast, g_fast), (ref, g_ref) = grads
    assert abs(fast - ref) <= 1e-4 * abs(ref) and len(g_fast) == len(g_ref)
    assert max(maxdiff(a, b) for a, b in zip(g_fast, g_ref)) <= 1e-5


def test_the_training_step_keeps_block_local_positions(tiny_loaded):
    """The step's loss is the block-local forward's (positions restart per block), not the re-encoded one."""
    examples = toy_examples(2)
    cfg = TrainConfig(method="block-local", steps=1, lr=1e-9, warmup_steps=0, batch_size=2, grad_accum=1)
    model = fresh_model(tiny_loaded)
    batch = collate(examples, "block-local")
    with torch.no_grad():
        local = answer_loss_sum(model, batch).item() / batch.target_tokens
        moved = answer_loss_sum(model, Batch(batch.ids, batch.labels, batch.mask)).item() / batch.target_tokens
    trainer = Trainer(model, examples, cfg)
    assert abs(local - moved) > 1e-3  # the positions matter here
    assert trainer.train_step() == pytest.approx(local, abs=1e-5)


# --- examples, collation, masks ---

def test_example_layout_segments_and_labels():
    segs = make_segs(prefix=3, blocks=(2, 4), query=2)
    ex = example_from_segments(segs, [7, 2])
    assert ex.ids == segs.all_ids() + [7, 2]
    assert ex.segment_ids == [0] * 3 + [1] * 2 + [2] * 4 + [3] * 4 and ex.open_id == 3
    assert ex.labels == [IGNORE] * 11 + [7, 2]
    with pytest.raises(ValueError):
        example_from_segments(segs, [])


def test_block_mask_structure():
    segs = make_segs(prefix=3, blocks=(2, 4), query=2)
    ex = example_from_segments(segs, [7, 2])
    m = collate([ex], "block").mask.dense()[0, 0]
    assert m.shape == (13, 13)
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    assert torch.equal(m[:3, :3], causal[:3, :3]) and not m[:3, 3:].any()  # the prefix is a block too
    assert torch.equal(m[3:5, 3:5], causal[:2, :2]) and not m[3:5, :3].any()  # block 1: itself only
    assert torch.equal(m[5:9, 5:9], causal[:4, :4]) and not m[5:9, :5].any()  # block 2: not prefix, block 1
    assert torch.equal(m[9:], causal[9:])  # query + answer see everything before them


def test_collate_pads_right_and_keeps_each_row_exact(tiny_loaded):
    model = tiny_loaded["llama"].model
    short, long_ = toy_examples(2)
    short, long_ = sorted([short, long_], key=len)
    assert len(short) < len(long_)
    for method in ("block", "vanilla", "block-local"):
        batch = collate([short, long_], method, pad_id=0)
        T = len(long_)
        assert batch.ids.shape == batch.labels.shape == (2, T)
        assert batch.ids[0, len(short):].eq(0).all() and batch.labels[0, len(short):].eq(IGNORE).all()
        assert batch.target_tokens == sum(lab != IGNORE for e in (short, long_) for lab in e.labels)
        if method != "vanilla":
            dense = batch.mask.dense()
            assert dense.shape == (2, 1, T, T)
            assert torch.equal(dense[:, 0], torch.stack([example_mask(e, T) for e in (short, long_)]))
            assert not dense[0, 0, :len(short), len(short):].any()  # no real token sees padding
            assert dense[0, 0].diagonal().all()                      # no fully masked row (NaN-free)
        with torch.no_grad():
            padded = forward_logits(model, batch)
            alone = forward_logits(model, collate([short], method))
        assert torch.isfinite(padded).all()
        assert maxdiff(padded[0, :len(short)], alone[0]) <= TOL
        loss_sum = token_loss_sum(padded, batch.labels)
        parts = sum(token_loss_sum(forward_logits(model, collate([e], method)), collate([e], method).labels)
                    for e in (short, long_))
        assert abs(loss_sum.item() - parts.item()) <= 1e-3
        with torch.no_grad():  # the head only where a label follows: the same loss
            assert abs(answer_loss_sum(model, batch).item() - loss_sum.item()) <= 1e-4


class WordTokenizer:
    """Whitespace tokenizer into the tiny vocabulary: enough for build_segments and truncation."""
    eos_token_id, pad_token_id, chat_template = 2, None, None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + zlib.crc32(w.encode()) % 300 for w in text.split()]}


def hotpot_like(i, n_passages=6, words=20):
    passages = [Passage(text=" ".join(f"w{i}_{j}_{k}" for k in range(words)), title=f"T{j}")
                for j in range(n_passages)]
    return Example(f"q{i}", f"question {i} ?", passages, [f"answer {i}"], "qa", "accuracy",
                   {"supporting_titles": ["T1", "T4"]})


def test_build_examples_truncates_whole_passages_keeping_gold():
    tok = WordTokenizer()
    examples = [hotpot_like(0), hotpot_like(1, n_passages=2)]
    full, rep = build_examples(examples, tok, max_length=10_000)
    assert rep.truncated == rep.skipped == 0 and rep.examples == 2
    limit = len(full[0]) - 30  # forces dropping two 24-token passages
    out, rep = build_examples(examples, tok, max_length=limit)
    assert rep.truncated == 1 and rep.dropped_passages == 2 and rep.skipped == 0
    assert all(len(e) <= limit for e in out)
    assert out[0].open_id == 5  # 4 passages left
    kept = set(out[0].ids)
    for gold in ("w0_1_0", "w0_4_0"):  # supporting passages survive, distractors go from the end
        assert tok(gold)["input_ids"][0] in kept
    assert out[0].labels[-3:] == tok("answer 0")["input_ids"] + [2]
    tiny, rep = build_examples(examples, tok, max_length=12)
    assert tiny == [] and rep.skipped == 2 and "2 skipped" in rep.summary(12)
    picked, _ = build_examples([hotpot_like(2)], tok, max_length=10_000, max_passages=3)
    assert picked[0].open_id == 4  # T1, T4 + the first distractor


def test_empty_and_evaluation_data_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TrainingDataError, match="empty"):
        load_training_examples(None, str(empty), None)
    (tmp_path / "arr.json").write_text("[]")
    with pytest.raises(TrainingDataError, match="no examples"):
        load_training_examples(None, str(tmp_path / "arr.json"), "hotpotqa")
    with pytest.raises(TrainingDataError, match="evaluation"):
        load_training_examples("hotpotqa", None, None)
    with pytest.raises(TrainingDataError, match="'nq-distractors-heldout' is held-out data.*train on hotpotqa-train"):
        load_training_examples("hotpotqa-train,nq-distractors-heldout", None, None)
    with pytest.raises(TrainingDataError, match="no training data"):
        load_training_examples(None, None, None)
    with pytest.raises(TrainingDataError, match="distinct names"):
        load_training_examples("nq-train,nq-train", None, None)


def test_several_training_sets_are_concatenated():
    from ragkv.config import data_dir

    if not (data_dir() / "MANIFEST.md").is_file():
        pytest.skip("shared data not found; set RAGKV_DATA_DIR")
    both = load_training_examples("hotpotqa-train,nq-train", None, None, limit=3)
    assert [ex.id for ex in both] == [ex.id for ex in load_training_examples("hotpotqa-train", None, None, 3)] + \
        [ex.id for ex in load_training_examples("nq-train", None, None, 3)]
    assert [len(ex.passages) for ex in both] == [10] * 6


def test_cli_refuses_empty_file_and_existing_output(tmp_path, capsys):
    from ragkv.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["finetune", "--data", str(empty), "--output", str(tmp_path / "out")]) == 2
    assert "empty" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    assert main(["finetune", "--data", str(empty), "--output", str(tmp_path / "busy")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["finetune", "--data", str(empty), "--output", str(tmp_path / "busy"), "--overwrite"]) == 2
    assert "not a ragkv fine-tuning output" in capsys.readouterr().err and (tmp_path / "busy" / "x").exists()


def test_output_folder_policy(tmp_path):
    out = tmp_path / "run"
    assert prepare_output(out, resume=False, overwrite=False) is None and out.is_dir()
    (out / MARKER).write_text("{}")
    with pytest.raises(OutputFolderError, match="--resume"):
        prepare_output(out, resume=False, overwrite=False)
    assert prepare_output(out, resume=True, overwrite=False) is None  # no checkpoint yet: start over
    with pytest.raises(OutputFolderError, match="not both"):
        prepare_output(out, resume=True, overwrite=True)
    assert prepare_output(out, resume=False, overwrite=True) is None and not any(out.iterdir())


# --- the loop ---

def test_schedule_and_data_order():
    cfg = TrainConfig(steps=10, warmup_steps=2, schedule="cosine")
    f = [lr_factor(s, cfg) for s in range(10)]
    assert f[0] == 0.5 and f[1] == 1.0 and f[2] == 1.0 and all(a >= b for a, b in zip(f[2:], f[3:]))
    assert lr_factor(10, cfg) == pytest.approx(0.0)
    order = data_order(4, 10, seed=1)
    assert sorted(order[:4]) == sorted(order[4:8]) == [0, 1, 2, 3] and order == data_order(4, 10, seed=1)
    with pytest.raises(TrainConfigError):
        TrainConfig(method="lora")


@pytest.mark.parametrize("method", ["block", "vanilla", "block-local"])
def test_a_few_steps_lower_the_loss(method, tiny_loaded):
    model = fresh_model(tiny_loaded)
    examples = toy_examples(4)
    batch = collate(examples, method)

    def loss():
        with torch.no_grad():
            return (token_loss_sum(forward_logits(model, batch), batch.labels) / batch.target_tokens).item()

    before = loss()
    cfg = TrainConfig(method=method, steps=10, lr=3e-3, warmup_steps=1, schedule="constant", batch_size=2,
                      grad_accum=2)
    Trainer(model, examples, cfg).run(progress=False)
    after = loss()
    assert after < 0.6 * before


def test_checkpoint_then_resume_equals_straight_run(tiny_loaded, tiny_dirs, tmp_path):
    """N steps straight == N/2 steps, a new process-like Trainer resuming from the checkpoint, N/2 more."""
    examples = toy_examples(5)
    cfg = TrainConfig(method="block", steps=6, lr=2e-3, warmup_steps=2, batch_size=2, grad_accum=2,
                      weight_decay=0.01, save_every=3, keep_states=1)
    src = tiny_dirs["qwen2"]  # tied embeddings: saving and reloading must keep them tied

    straight = fresh_model(tiny_loaded, "qwen2")
    Trainer(straight, examples, cfg, tmp_path / "a", src).run(progress=False)

    out = tmp_path / "b"
    prepare_output(out, resume=False, overwrite=False)
    first = Trainer(fresh_model(tiny_loaded, "qwen2"), examples, cfg, out, src)
    first.run(progress=False, stop_after=3)  # "crash" after the step-3 checkpoint
    assert [s for s, _ in list_checkpoints(out)] == [3]
    torch.manual_seed(1234)  # a new process would start from other RNG state
    ckpt = prepare_output(out, resume=True, overwrite=False)
    assert ckpt == latest_checkpoint(out) and (ckpt / STATE_FILE).exists()
    resumed = Trainer(fresh_model(tiny_loaded, "qwen2"), examples, cfg, out, src)
    resumed.resume(ckpt)
    assert resumed.step == 3
    resumed.run(progress=False)

    for (name, a), b in zip(straight.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == list(
        range(1, 7))
    steps = [s for s, _ in list_checkpoints(out)]
    assert steps == [3, 6] and not (list_checkpoints(out)[0][1] / STATE_FILE).exists()  # older state pruned
    assert json.loads((out / MARKER).read_text())["step"] == 6
    with pytest.raises(TrainConfigError, match="different settings"):
        Trainer(fresh_model(tiny_loaded, "qwen2"), examples, TrainConfig(**{**cfg.to_dict(), "lr": 1e-3}),
                out, src).resume(latest_checkpoint(out))


def test_stop_request_saves_the_steps_done_and_resume_goes_on(tiny_loaded, tiny_dirs, tmp_path):
    """SIGTERM/SIGINT (or request_stop) ends the run after the current step, with a checkpoint of it."""
    examples = toy_examples(3)
    cfg = TrainConfig(method="block", steps=5, lr=1e-3, warmup_steps=1, save_every=4)
    out = tmp_path / "ft"
    prepare_output(out, resume=False, overwrite=False)
    trainer = Trainer(fresh_model(tiny_loaded, "qwen2"), examples, cfg, out, tiny_dirs["qwen2"])
    step = trainer.train_step

    def step_then_signal():
        loss = step()
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill` would; the handler only asks the loop to stop
        return loss

    trainer.train_step = step_then_signal
    before = signal.getsignal(signal.SIGTERM)
    trainer.run(progress=False)
    assert trainer.step == 2 and [s for s, _ in list_checkpoints(out)] == [2]
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone again
    resumed = Trainer(fresh_model(tiny_loaded, "qwen2"), examples, cfg, out, tiny_dirs["qwen2"])
    resumed.resume(latest_checkpoint(out))
    resumed.run(progress=False)
    assert resumed.step == 5 and (out / "config.json").exists()


def test_cli_stopped_run_says_how_to_go_on(tiny_loaded, tiny_dirs, tmp_path, monkeypatch, capsys):
    """`ragkv finetune` stopped by a signal reports a checkpoint and --resume (not "model saved"), exit 130."""
    from types import SimpleNamespace

    from ragkv.cli import main
    from ragkv.models import loader
    from ragkv.train import data as train_data
    from ragkv.train import loop

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: SimpleNamespace(
        model=fresh_model(tiny_loaded, "qwen2"), tokenizer=WordTokenizer(), path=tiny_dirs["qwen2"]))
    monkeypatch.setattr(train_data, "load_training_examples", lambda *a, **k: [hotpot_like(i) for i in range(3)])
    step = loop.Trainer.train_step

    def step_then_stop(self):
        loss = step(self)
        self.request_stop()
        return loss

    monkeypatch.setattr(loop.Trainer, "train_step", step_then_stop)
    out = tmp_path / "ft"
    code = main(["finetune", "--data", "unused.jsonl", "--output", str(out), "--steps", "4", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130 and "stopped at step 1 of 4" in err and "--resume" in err and "model saved" not in err
    assert [s for s, _ in list_checkpoints(out)] == [1]


def test_until_step_stops_with_a_checkpoint_and_keeps_the_schedule(tiny_loaded, tiny_dirs, tmp_path, monkeypatch,
                                                                    capsys):
    """`--until-step N` ends the run after step N with a checkpoint (exit 0), the learning-rate schedule still that of
    --steps: resuming from it reproduces the straight run's weights."""
    from types import SimpleNamespace

    from ragkv.cli import main
    from ragkv.models import loader
    from ragkv.train import data as train_data

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: SimpleNamespace(
        model=fresh_model(tiny_loaded, "qwen2"), tokenizer=WordTokenizer(), path=tiny_dirs["qwen2"]))
    monkeypatch.setattr(train_data, "load_training_examples", lambda *a, **k: [hotpot_like(i) for i in range(3)])
    flags = ["finetune", "--data", "unused.jsonl", "--steps", "4", "--lr", "1e-3", "--warmup-steps", "1",
             "--no-bf16", "--no-progress"]
    assert main([*flags, "--output", str(tmp_path / "straight")]) == 0
    capsys.readouterr()
    out = tmp_path / "halves"
    assert main([*flags, "--output", str(out), "--until-step", "3"]) == 0
    err = capsys.readouterr().err
    assert "reached --until-step 3 of 4" in err and "--resume" in err and "model saved" not in err
    assert [s for s, _ in list_checkpoints(out)] == [3] and (list_checkpoints(out)[0][1] / STATE_FILE).exists()
    assert main([*flags, "--output", str(out), "--resume", "--until-step", "2"]) == 2
    assert "already at step 3" in capsys.readouterr().err
    assert main(["finetune", "--data", "unused.jsonl", "--output", str(out), "--resume", "--no-progress"]) == 0
    logs = [[json.loads(line)["lr"] for line in (d / "train_log.jsonl").read_text().splitlines()]
            for d in (tmp_path / "straight", out)]
    assert logs[0] == logs[1] and len(logs[0]) == 4
    from safetensors.torch import load_file

    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_saved_folder_loads_as_a_model(tiny_loaded, tiny_dirs, tmp_path, monkeypatch):
    from ragkv.models import loader

    model = fresh_model(tiny_loaded, "qwen2")
    Trainer(model, toy_examples(2), TrainConfig(steps=2, lr=1e-3), tmp_path / "ft", tiny_dirs["qwen2"]).run(
        progress=False)
    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    back = loader.load_model(str(tmp_path / "ft"), device=model.device)
    ids = torch.tensor([rand_ids(20, 9)], device=model.device)
    with torch.no_grad():
        assert maxdiff(back.model(ids, all_logits=True), model(ids, all_logits=True)) == 0
    assert back.fingerprint != tiny_loaded["qwen2"].fingerprint


def test_finetune_report_rows_intervals_and_paired_targets(tmp_path):
    """Table 1 from results files: each row's accuracy with its interval, the w/o-pos rows, and the targets as
    paired differences over the examples both rows answered."""
    from ragkv.bench.finetune_report import table
    from ragkv.eval.results import ResultsFile

    def results(name, accuracy_by_mode):
        f = ResultsFile(tmp_path / f"{name}.jsonl", {"model": name})
        for mode, accs in accuracy_by_mode.items():
            for i, acc in enumerate(accs):
                f.append({"example_id": f"q{i}", "mode_key": mode, "completion_tokens": 3,
                          "scores": {"accuracy": acc, "f1": acc}, "fidelity": {"first_token_kl": 0.1 * acc}})
        return f.path

    rows = {"vanilla-ft": results("v", {"full": [1, 1, 0, 1], "reuse": [0, 1, 0, 0]}),
            "block-ft": results("b", {"reuse": [1, 1, 0, 0], "reuse:pos=local": [0, 0, 0, 0], "full": [1] * 4})}
    out = table(rows, limit=None)
    assert "| vanilla-ft / full | 75.0% [" in out and "| block-ft / reuse:pos=local | 0.0% [0.0, 0.0] |" in out
    assert "| block-ft / reuse - vanilla-ft / full | -25.0 [" in out  # paired over q0..q3
    assert "| block-ft / reuse - block-ft / reuse:pos=local | +50.0 [" in out
    assert "| block-ft / reuse - vanilla-ft / reuse | +25.0 [" in out
    assert "block-local-ft" not in out and "base" not in out  # rows without a file are left out
    two = table(rows, limit=2)
    assert "| block-ft / reuse | 100.0% [100.0, 100.0] | 100.0 | 0.100 | 3.0 | 2 |" in two


def test_finetune_report_row_merges_the_shards_of_one_run(tmp_path):
    """A row given as the files of `ragkv eval --shard K/N` reports as the unsharded run; files of two different
    runs in one row are refused with a message."""
    import pytest

    from ragkv.bench.finetune_report import table
    from ragkv.errors import RagkvError
    from ragkv.eval.results import ResultsFile

    def results(name, config, ids, accs):
        f = ResultsFile(tmp_path / f"{name}.jsonl", config)
        for i, acc in zip(ids, accs):
            f.append({"example_id": f"q{i}", "mode_key": "full", "completion_tokens": 2,
                      "scores": {"accuracy": acc, "f1": acc}, "fidelity": {"first_token_kl": 0.0}})
        return f.path

    accs = [1, 0, 1, 1, 0, 1]
    whole = results("whole", {"model": "m"}, range(6), accs)
    s1 = results("s1", {"model": "m", "shard": "1/2"}, range(0, 6, 2), accs[0::2])
    s2 = results("s2", {"model": "m", "shard": "2/2"}, range(1, 6, 2), accs[1::2])
    assert table({"base": [s1, s2]}, limit=None) == table({"base": whole}, limit=None)
    other = results("other", {"model": "other"}, range(3), accs[:3])
    with pytest.raises(RagkvError, match="2 different runs"):
        table({"base": [s1, other]}, limit=None)


def test_finetune_report_pools_a_models_runs_on_several_data_sets(tmp_path):
    """A model given once per data set is pooled (more examples, still paired by data set and example); each
    data set is also shown alone; two runs of one model on the same data are refused."""
    import pytest

    from ragkv.bench.finetune_report import table
    from ragkv.errors import RagkvError
    from ragkv.eval.results import ResultsFile

    def results(name, config, accs):
        f = ResultsFile(tmp_path / f"{name}.jsonl", config)
        for i, acc in enumerate(accs):  # the same example ids on both data sets: pairing must keep them apart
            f.append({"example_id": f"q{i}", "mode_key": "reuse" if "block" in name else "full",
                      "completion_tokens": 2, "scores": {"accuracy": acc, "f1": acc},
                      "fidelity": {"first_token_kl": 0.0}})
        return f.path

    hot, nq = {"dataset": "hotpotqa"}, {"data_file": "data/nq.jsonl", "gold_position": 4}  # a "/" in a label
    rows = [("vanilla-ft", results("vanilla-hot", {"model": "v", **hot}, [1, 1, 0, 0])),
            ("block-ft", results("block-hot", {"model": "b", **hot}, [1, 0, 0, 0])),
            ("vanilla-ft", results("vanilla-nq", {"model": "v", **nq}, [0, 0, 1, 1, 1, 1])),
            ("block-ft", results("block-nq", {"model": "b", **nq}, [0, 0, 1, 1, 1, 1]))]
    out = table(rows, limit=None)
    assert "| vanilla-ft / full | 60.0% [" in out and "| 10 |" in out  # 6 of 10 pooled
    assert "| block-ft / reuse - vanilla-ft / full | -10.0 [" in out  # paired over 10, not 6 shared ids
    assert "| accuracy by data set (n) | data/nq.jsonl@gold4 | hotpotqa |" in out
    assert "| block-ft / reuse | 66.7% (6) | 25.0% (4) |" in out
    assert "accuracy by data set" not in table(rows[:2], limit=None)
    with pytest.raises(RagkvError, match=r"block-hot2\.jsonl and \S*block-hot\.jsonl are two runs on the same data"):
        table(rows + [("block-ft", results("block-hot2", {"model": "b2", **hot}, [1]))], limit=None)
