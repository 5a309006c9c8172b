"""offload_optimizer.speculative_step from PyTorch, with models nobody here wrote: a transformers
GPT-2 trained with gradient clipping and a PEFT LoRA adapter on a transformers Llama. The run with
the key on (each group's CPU Adam during the backward, undone when a step is clipped) gives the
same parameters, bit for bit, as the run with it off; the step reports say what was speculated
and what was undone."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata  # noqa: E402

from models import ds_config  # noqa: E402

STEPS = 4


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                 bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def lora_llama():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           init_lora_weights="gaussian")
    return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)


def train(make, vocab, offload, clip, speculate, tmp_path, overlap_step=False, steps=STEPS,
          stats=None):
    """speculate None: the key unset (the engine times both ways)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = ds_config(3, offload, lr=1e-2, wd=0.01, nvme_path=str(tmp_path))
    cfg["gradient_clipping"] = clip
    cfg["zero_optimization"]["offload_optimizer"]["speculation_buffer_size"] = 10**9
    if speculate is not None:
        cfg["zero_optimization"]["offload_optimizer"]["speculative_step"] = speculate
    model = make()
    engine, _, _, _ = strata.initialize(model=model, config=cfg, overlap_step=overlap_step)
    reports = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, vocab, (4, 12), generator=g)
        loss = engine(input_ids=idx, labels=idx).loss
        engine.backward(loss)
        engine.step()
        reports.append(dict(engine.last_step_report))
    master = engine.read_master()
    if stats is not None:
        stats.update(engine.stats())
    engine.close()
    return master, reports


CASES = [("gpt2", gpt2, 61, "cpu"), ("lora-llama", lora_llama, 37, "nvme")]


@pytest.mark.parametrize("name,make,vocab,offload", CASES, ids=[c[0] for c in CASES])
def test_speculative_step_same_bits_kept_or_undone(name, make, vocab, offload, tmp_path):
    # No clipping: every step keeps its speculation.
    off, off_reports = train(make, vocab, offload, 1e9, False, tmp_path / "a")
    on, on_reports = train(make, vocab, offload, 1e9, True, tmp_path / "b")
    assert off.keys() == on.keys()
    for n in off:
        assert torch.equal(off[n], on[n]), n
    assert all(r["speculated_sub_groups"] > 0 for r in on_reports)
    assert all(r["rolled_back_sub_groups"] == 0 for r in on_reports)
    assert all(r["speculated_sub_groups"] == 0 for r in off_reports)
    # Clipping every step: the first step's speculation is undone and redone, the later steps do
    # not speculate; the same bits again.
    off, _ = train(make, vocab, offload, 1e-4, False, tmp_path / "c")
    on, reports = train(make, vocab, offload, 1e-4, True, tmp_path / "d")
    for n in off:
        assert torch.equal(off[n], on[n]), n
    assert reports[0]["clip_coefficient"] > 1
    assert reports[0]["rolled_back_sub_groups"] > 0
    assert all(r["speculated_sub_groups"] == 0 for r in reports)


def test_default_caches_a_small_models_nvme_state_instead(tmp_path):
    # The key unset, the optimizer on NVMe, a GPT-2 whose NVMe-homed state fits the memory the
    # rollback copies would take: that memory caches the state instead (a layout note says so),
    # nothing speculates, and from step to step nothing is read from NVMe or written to it; the
    # same bits as with it off.
    def wide_gpt2():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=256, n_layer=2,
                                      n_head=4, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)

    def run(speculate, path):
        path.mkdir(parents=True, exist_ok=True)
        cfg = ds_config(3, "nvme", lr=1e-2, wd=0.01, nvme_path=str(path))
        if speculate is not None:
            cfg["zero_optimization"]["offload_optimizer"]["speculative_step"] = speculate
        engine, _, _, _ = strata.initialize(model=wide_gpt2(), config=cfg)
        moved, reports = [], []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 61, (4, 12), generator=g)
            engine.backward(engine(input_ids=idx, labels=idx).loss)
            engine.step()
            reports.append(dict(engine.last_step_report))
            moved.append(dict(engine.stats()["store"]["bytes_moved"]))
        notes = engine.stats()["layout"]["notes"]
        master = engine.read_master()
        engine.close()
        return master, reports, moved, notes

    off, _, _, _ = run(False, tmp_path / "a")
    auto, reports, moved, notes = run(None, tmp_path / "b")
    for n in off:
        assert torch.equal(off[n], auto[n]), n
    assert any("NVMe-homed state in host memory instead" in n for n in notes), notes
    assert all(r["speculated_sub_groups"] == 0 for r in reports)
    for way in ("nvme->host", "host->nvme"):
        assert moved[-1].get(way, 0) == moved[0].get(way, 0), way
    # The key given: it speculates.
    _, reports, _, notes = run(True, tmp_path / "c")
    assert not any("NVMe-homed state in host memory instead" in n for n in notes), notes
    assert all(r["speculated_sub_groups"] > 0 for r in reports)


def test_speculative_step_behind_the_next_forward_with_overlap_step(tmp_path):
    # overlap_step with the key asked for: a kept speculation's worker finishes behind the next
    # forward with the rest of the step; the same bits as overlap_step alone.
    off, _ = train(gpt2, 61, "nvme", 1e9, False, tmp_path / "a", overlap_step=True)
    on, reports = train(gpt2, 61, "nvme", 1e9, True, tmp_path / "b", overlap_step=True)
    for n in off:
        assert torch.equal(off[n], on[n]), n
    assert all(r["speculated_sub_groups"] > 0 for r in reports)
    assert all(r["rolled_back_sub_groups"] == 0 for r in reports)


def test_speculative_step_by_default_is_timed_both_ways(tmp_path):
    # The key unset: the first three steps speculate, the next six alternate (off first) while the
    # engine times them, then the faster mode holds; the same bits as with it off throughout.
    off, _ = train(gpt2, 61, "cpu", 1e9, False, tmp_path / "a", steps=11)
    stats = {}
    auto, reports = train(gpt2, 61, "cpu", 1e9, None, tmp_path / "b", steps=11, stats=stats)
    for n in off:
        assert torch.equal(off[n], auto[n]), n
    speculated = [r["speculated_sub_groups"] > 0 for r in reports]
    assert speculated[:9] == [True, True, True, False, True, False, True, False, True]
    sp = stats["speculation"]
    assert sp["applies"] and sp["adaptive"] and sp["probes"] == 1
    assert sp["on_s"] > 0 and sp["off_s"] > 0
    assert sp["next"] == (sp["on_s"] <= sp["off_s"])
    assert speculated[9:] == [sp["next"]] * 2
