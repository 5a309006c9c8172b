"""strata.initialize on a GPU (CudaDevice + NCCL) against plain torch on the same GPU: fp32 AdamW
and bf16 with fp32 masters, stages 0-3 x optimizer offload none/cpu/nvme; the engine's placement
property on the GPU (the CUDA Adam of device-resident state and the CPU Adam of offloaded state
give the same bits); a gathered parameter read by a kernel on another stream; a model that
computes on two streams; the host running ahead of the GPU (no stream synchronize per module,
releases ordered on the GPU with the params offloaded too); the device budget; a LoRA fused
into its base weights after training (Engine::WriteParams on the GPU); offload_states lending the
GPU out between steps; activation checkpointing keeping the blocks' inputs in host memory;
optimizer state written between steps (safe_set_*); a frozen teacher's weight saved in the
student's forward and gathered for backward; a backward that raises part way, dropped; a LoRA
checkpoint without its frozen base, resumed.
Every test but the device-choice ones needs a GPU and is skipped (and reported so) without one;
the device-choice and budget checks also run on the host stand-in."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
from strata import engine as strata_engine  # noqa: E402

from models import batch, ds_config, make_model, reference  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")

STEPS = 3
LR, WD = 1e-2, 0.01
# As test_adapter.py: the same gradients from the same kernels, Adam's rounding order apart.
LOSS_RTOL, PARAM_ATOL, PARAM_RTOL = 1e-5, 2e-5, 1e-4


def on_gpu(xs):
    return tuple(x.cuda() for x in xs)


def train_cuda(kind, cfg, steps=STEPS, model=None):
    model = make_model(kind).cuda() if model is None else model
    names = [n for n, _ in model.named_parameters()]
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    assert engine.device.type == "cuda"
    assert engine._engine.device.startswith("cuda:")
    losses = []
    for step in range(steps):
        loss = engine(*on_gpu(batch(kind, step)))
        assert loss.is_cuda
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    master = engine.read_master()
    engine.close()
    return losses, {n: master[n] for n in names if n in master}


def reference_cuda(kind, steps, dtype):
    """Plain torch on the GPU: fp32 AdamW, or bf16 forward/backward with fp32 masters."""
    model = make_model(kind).cuda()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    masters = params if dtype == "fp32" else [p.detach().float().clone().requires_grad_()
                                              for p in params]
    # foreach=False: torch's per-tensor order of operations, the engine's (its default on a GPU,
    # foreach, rounds differently)
    opt = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD,
                            foreach=False)
    losses = []
    for step in range(steps):
        for p in params:
            p.grad = None
        loss = model(*on_gpu(batch(kind, step)))
        loss.backward()
        losses.append(loss.item())
        if dtype == "bf16":
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
        opt.step()
        if dtype == "bf16":
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return losses, {n: m.detach().float().cpu() for n, m in zip(names, masters)}


CASES = [(s, o) for s in range(4) for o in ("none", "cpu", "nvme") if o != "nvme" or s == 3]


@needs_gpu
@pytest.mark.parametrize("stage,offload", CASES, ids=[f"stage{s}-{o}" for s, o in CASES])
def test_fp32_matches_torch_adamw_on_the_gpu(stage, offload, tmp_path):
    cfg = ds_config(stage, offload, lr=LR, wd=WD, nvme_path=str(tmp_path))
    losses, params = train_cuda("gpt", cfg)
    ref_losses, ref = reference_cuda("gpt", STEPS, "fp32")
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    for n, p in params.items():
        torch.testing.assert_close(p, ref[n], atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=n)


@needs_gpu
def test_bf16_matches_torch_and_bits_do_not_depend_on_placement(tmp_path):
    """Device-resident state runs the CUDA Adam, offloaded state the SIMD CPU Adam: the same bits
    (FMA targets), at every stage, and within a bf16 rounding of torch's bf16 + fp32 masters."""
    runs = {}
    for stage, off in [(0, "none"), (2, "cpu"), (3, "none"), (3, "cpu"), (3, "nvme")]:
        cfg = ds_config(stage, off, dtype="bf16", lr=LR, wd=WD, nvme_path=str(tmp_path))
        runs[(stage, off)] = train_cuda("gpt", cfg)
    base_losses, base = runs[(0, "none")]
    for key, (losses, params) in runs.items():
        assert losses == base_losses, key
        for n in base:
            assert torch.equal(params[n], base[n]), (key, n)
    ref_losses, ref = reference_cuda("gpt", STEPS, "bf16")
    assert base_losses == pytest.approx(ref_losses, rel=1e-3)
    # Adam moves every element by about lr a step whatever its gradient's size, so a gradient
    # near zero whose sign a bf16 rounding apart flips (torch's fused AdamW and strata's Adam
    # differ in an ulp, the next bf16 forward then in a rounding) ends up to 2 lr a step apart:
    # a few such elements, none further.
    for n, p in base.items():
        d = (p - ref[n]).abs()
        assert d.max().item() <= 2 * STEPS * LR, n
        assert (d > 1e-2).float().mean().item() <= 0.01, n


@needs_gpu
def test_gathered_parameter_read_on_another_stream():
    """A gathered parameter is complete when gather returns: a kernel on a side stream (ordered
    after the current one, as torch requires) reads the engine's values; the memory is the
    engine's (no copy)."""
    model = make_model("mlp").cuda()
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3))
    master = engine.read_master()
    name, p = next(iter(model.named_parameters()))
    side = torch.cuda.Stream()
    with engine.gathered_parameters():
        assert p.is_cuda and p.numel() == p.ds_numel
        x = torch.randn(p.shape[-1], 5, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = p @ x
            ptr = p.data_ptr()
        torch.cuda.current_stream().wait_stream(side)
        views = engine._engine.gather(engine._group_of[id(p)])
        assert ptr in {strata_engine._as_tensor(a).data_ptr() for a in views}
    torch.testing.assert_close(y.cpu(), master[name] @ x.cpu(), atol=1e-5, rtol=1e-5)
    assert p.numel() == 0 and p.is_cuda  # released: empty, still on the engine's GPU
    engine.close()


class _TwoStreamLinear(torch.nn.Module):
    """x @ w.T + b with the matmul on a side stream and the bias added on the current one (ordered
    both ways, as torch requires): autograd runs each backward node on its forward op's stream,
    so one group's gradients come from two streams."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(n_out) * 0.1)
        self.side = None

    def forward(self, x):
        current = torch.cuda.current_stream(x.device)
        if self.side is None:
            self.side = torch.cuda.Stream(x.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            y = x @ self.w.t()
        current.wait_stream(self.side)
        y.record_stream(current)
        return y + self.b


def _two_stream_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(_TwoStreamLinear(16, 32), torch.nn.Tanh(),
                               _TwoStreamLinear(32, 4)).cuda()


@needs_gpu
@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_that_computes_on_two_streams_matches_torch(stage):
    """Part of each layer on a side stream: its gradients reach the adapter on that stream, and
    where they land in a buffer taken on another stream the copies are ordered with it (on one
    GPU the engine orders its work with the buffer's stream, not the current one). The losses
    and weights match plain torch's AdamW on the same GPU."""
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=gen).cuda(), torch.randn(8, 4, generator=gen).cuda())
            for _ in range(STEPS)]
    ref = _two_stream_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD, foreach=False)
    ref_losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    model = _two_stream_model()
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))
    assert engine._stream_ordered
    crossed = []
    copy_grad = engine._copy_grad

    def spy(gi, view, grad):
        crossed.append(engine._grad_streams.get(gi) != torch.cuda.current_stream())
        copy_grad(gi, view, grad)

    engine._copy_grad = spy
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    master = engine.read_master()
    engine.close()
    print(f"gradient copies from another stream than their buffer's: {sum(crossed)} of "
          f"{len(crossed)}")
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach().cpu(), atol=PARAM_ATOL, rtol=PARAM_RTOL,
                                   msg=n)


needs_two_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2,
                                    reason="needs two GPUs")
TWO_GPU_CASES = ["gpt:3:none", "gpt:3:cpu", "gpt:2:none", "mlp:1:cpu", "gpt:3:nvme"]


@needs_two_gpus
def test_two_processes_on_two_gpus_match_torch(tmp_path):
    """One process per GPU (LOCAL_RANK picks it), the engine on CudaDevice with NCCL through
    strata's rendezvous: both ranks end with the same bits, and the mean loss and the weights
    match torch's AdamW on the mean of both ranks' gradients, computed on the GPU."""
    import os
    from launch import launch
    os.environ["TEST_DEVICE"] = "cuda"
    try:
        outs = launch(tmp_path, "dist_worker.py",
                      lambda r, nvme: [STEPS, tmp_path, nvme, *TWO_GPU_CASES], 2, 60000)
    finally:
        del os.environ["TEST_DEVICE"]
    for rc, out in outs:
        assert rc == 0, out
    for case in TWO_GPU_CASES:
        kind = case.split(":")[0]
        res = [torch.load(tmp_path / f"{case}.rank{r}.pt") for r in range(2)]
        assert [r["engine_device"] for r in res] == ["cuda:0", "cuda:1"], case
        for n, p in res[0]["master"].items():
            assert torch.equal(p, res[1]["master"][n]), (case, n)
        ref_losses, ref = reference(kind, STEPS, LR, WD, world=2, device="cuda")
        mean = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"])]
        assert mean == pytest.approx(ref_losses, rel=LOSS_RTOL), case
        for n, p in res[0]["master"].items():
            torch.testing.assert_close(p, ref[n], atol=PARAM_ATOL, rtol=PARAM_RTOL,
                                       msg=f"{case} {n}")


SLEEP_CYCLES = 400_000_000  # torch.cuda._sleep: ~0.2 s at an H200's ~2 GHz


@needs_gpu
@pytest.mark.parametrize("param", ["none", "cpu"])
def test_the_host_runs_ahead_of_the_gpu_through_forward_and_backward(param):
    """One GPU, stage 3 (orders_caller_streams): with nothing offloaded (gathers_alias_home) a
    slow kernel queued early in the forward is still running when the forward returns (releases
    wait for nothing), and one queued after the first gradient's copy in the backward is still
    running while the engine takes the next buffers and reduces groups (both ordered with torch's
    stream on the GPU). With the params offloaded each release is ordered after torch's stream on
    the GPU too (the store's copies of later groups then queue behind the slow kernel, so only
    the adapter's own waits are checked). Either way the adapter waits for nothing in the forward
    and backward, and the results match the run without the slow kernels. The reference run
    goes first: with CUDA's lazy module loading, a kernel's first launch may synchronize, which
    would look like a wait here."""
    cfg = ds_config(3)
    if param != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": param, "pin_memory": True}
    ref_losses, ref = train_cuda("gpt", cfg)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    model = make_model("gpt").cuda()
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    assert engine._engine.gathers_alias_home is (param == "none")
    assert engine._release_waits is (param != "none")
    assert engine._engine.orders_caller_streams and engine._stream_ordered
    assert engine._held.limit == 0 and engine._held_releases.limit == 0
    stream = torch.cuda.current_stream()
    waits = engine._device_waits.count
    first = next(m for m in model.modules() if next(m.parameters(recurse=False), None) is not None)
    slow_forward = first.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(SLEEP_CYCLES))
    loss = engine(*on_gpu(batch("gpt", 0)))
    if param == "none":
        assert not stream.query(), "the forward waited for the GPU"
    assert engine._device_waits.count == waits, "the adapter waited for the GPU in the forward"
    slow_forward.remove()
    reduced, seen = [], []
    reduce = engine._held.call
    engine._held.call = lambda gi: (reduced.append(gi), reduce(gi))
    slept = []

    def after_engine_hook(p):  # registered after the engine's: runs after its hook for p
        if not slept:
            torch.cuda._sleep(SLEEP_CYCLES)
            slept.append((len(reduced), engine._device_waits.count))
        else:
            seen.append((len(reduced) - slept[0][0], stream.query(), engine._device_waits.count))

    hooks = [p.register_post_accumulate_grad_hook(after_engine_hook)
             for p in model.parameters() if p.requires_grad]
    engine.backward(loss)
    for h in hooks:
        h.remove()
    # Reductions after the slow kernel, queued while it still runs; no wait in the backward.
    assert slept and seen
    if param == "none":
        assert any(n >= 1 and not done for n, done, _ in seen), seen
    assert all(w == waits for _, _, w in seen), "the adapter waited for the GPU"
    engine.step()
    losses = [loss.item()]
    for step in range(1, STEPS):
        loss = engine(*on_gpu(batch("gpt", step)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    master = engine.read_master()
    engine.close()
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    for n, v in ref.items():
        torch.testing.assert_close(master[n], v, atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=n)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_over_budget_is_refused_naming_the_tier(device):
    model = make_model("gpt").to(device)
    with pytest.raises(RuntimeError, match="ResourceExhausted: .* hbm tier of rank 0"):
        strata.initialize(model=model, config=ds_config(3), device_budget_bytes=64 << 10)


def test_device_follows_the_model_or_the_argument():
    cpu_model = make_model("mlp")
    # A model on the CPU: the rank's GPU where there is one (as DeepSpeed), else the host.
    want = torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else torch.device("cpu")
    assert strata_engine._engine_device(cpu_model) == want
    assert strata_engine._engine_device(cpu_model, "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not supported"):
        strata_engine._engine_device(cpu_model, "meta")
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="no GPU"):
            strata_engine._engine_device(cpu_model, "cuda")
    else:
        assert strata_engine._engine_device(cpu_model.cuda()).type == "cuda"
    with pytest.raises(ValueError, match="device_budget_bytes"):
        strata_engine._device_budget(None, 0)
    assert strata_engine._device_budget(None, 12345) == 12345


@needs_gpu
def test_a_deepspeed_script_trains_on_the_gpu_without_moving_its_model(tmp_path):
    """ds_script_worker.py (test_ds_script.py, after DeepSpeedExamples' CIFAR script) never moves
    its model: as under DeepSpeed, initialize puts it on the rank's GPU, and the script moves its
    inputs to get_accelerator().device_name(engine.local_rank), the same GPU. The losses follow torch's on the CPU within the GPU's TF32
    convolutions."""
    import test_ds_script as ds
    got = ds.run_one_process(tmp_path, 3)
    assert got["device"] == got["engine_device"] == "cuda:0", got
    want_losses, _, want_eval = ds.reference()
    assert got["losses"] == pytest.approx(want_losses, rel=1e-2)
    assert got["eval_loss"] == pytest.approx(want_eval, rel=1e-2)


@needs_gpu
def test_zero_init_on_the_gpu_trains_on_the_gpu():
    """A model built under strata.zero.Init on the GPU: the emptied parameters stay on it, so the
    engine runs there; training matches the same model built whole."""
    cfg = ds_config(3, lr=LR, wd=WD)
    with torch.device("cuda"), strata.zero.Init(config=cfg):
        model = make_model("mlp")
    assert all(p.numel() == 0 and p.is_cuda for p in model.parameters())
    _, got = train_cuda("mlp", cfg, model=model)  # asserts the engine runs on the GPU
    with torch.device("cuda"):  # the same draws from the GPU's generator, built whole
        whole = make_model("mlp")
    _, want = train_cuda("mlp", cfg, model=whole)
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n


@needs_gpu
@pytest.mark.parametrize("param", ["none", "cpu"])
def test_a_lora_fused_after_training_is_written_on_the_gpu(param):
    """GatheredParameters(modifier_rank=0) after steps (Engine::WriteParams) on CudaDevice:
    DeepSpeed-Chat's LoRA fused into its frozen base weights, whose home is the GPU or (param
    offload) host memory; gathered again they hold the fused values."""
    import warnings

    import test_param_write_after_steps as w
    model = w.opt_model().cuda()
    cfg = w.ds_config()
    cfg["zero_optimization"]["offload_param"] = {"device": param}
    engine, *_ = strata.initialize(model=model, config=cfg,
                                   model_parameters=[p for p in model.parameters()
                                                     if p.requires_grad])
    assert engine.device.type == "cuda"
    try:
        ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(2)).cuda()
        for _ in range(3):
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
        lora = {n: m for n, m in model.named_modules() if isinstance(m, w.LinearLayer_LoRA)}
        expected = {}
        for n, m in lora.items():
            with strata.zero.GatheredParameters([m.weight, m.lora_left_weight,
                                                 m.lora_right_weight]):
                expected[n] = m.weight.data + m.lora_scaling * torch.matmul(
                    m.lora_left_weight.t(), m.lora_right_weight.t())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w.convert_lora_to_linear_layer(model)
        for n, m in lora.items():
            with strata.zero.GatheredParameters([m.weight]):
                assert m.weight.is_cuda and torch.equal(m.weight.data, expected[n]), n
    finally:
        engine.destroy()


@needs_gpu
@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "none"), (3, "cpu")])
def test_a_lora_checkpoint_without_its_base_resumes_on_the_gpu(stage, offload, tmp_path):
    """save_checkpoint(exclude_frozen_parameters=True) on CudaDevice (the frozen base's home the
    GPU, or host memory), resumed into the model built from the same base with
    load_module_strict=False: the same bits as the run that never stopped; into another base:
    refused by the frozen values' fingerprints."""
    cfg = ds_config(stage, offload, lr=LR, wd=WD)

    def gpu_engine(seed=0):
        engine, *_ = strata.initialize(model=make_model("lora", seed=seed).cuda(), config=cfg)
        assert engine.device.type == "cuda"
        return engine

    def steps(engine, first, last):
        for step in range(first, last):
            loss = engine(*on_gpu(batch("lora", step)))
            engine.backward(loss)
            engine.step()

    engine = gpu_engine()
    steps(engine, 0, 2)
    engine.save_checkpoint(tmp_path / "lean", exclude_frozen_parameters=True)
    steps(engine, 2, 4)
    straight = engine.read_master()
    engine.close()
    resumed = gpu_engine()
    resumed.load_checkpoint(tmp_path / "lean", load_module_strict=False)
    steps(resumed, 2, 4)
    again = resumed.read_master()
    resumed.close()
    assert straight.keys() == again.keys()
    for n in straight:
        assert torch.equal(straight[n], again[n]), n
    wrong = gpu_engine(seed=1)
    with pytest.raises(strata.StrataError, match="not the ones the saving run started from"):
        wrong.load_checkpoint(tmp_path / "lean", load_module_strict=False)
    wrong.close()


@needs_gpu
@pytest.mark.parametrize("stage,offload", [(2, "none"), (3, "none"), (3, "cpu")])
def test_offload_states_frees_the_gpu_and_training_goes_on_bit_for_bit(stage, offload):
    """engine.offload_states() between steps: the engine's GPU memory (cudaMemGetInfo's free
    grows by it; memory_allocated counts it) goes to pinned host memory, a torch allocation of
    that size then fits, and after reload_states() training gives the bits it gives without."""
    cfg = ds_config(stage, offload, dtype="bf16", lr=LR, wd=WD)

    def run(lend):
        model = make_model("gpt").cuda()
        names = [n for n, _ in model.named_parameters()]
        engine, _, _, _ = strata.initialize(model=model, config=cfg)
        for step in range(STEPS):
            engine.backward(engine(*on_gpu(batch("gpt", step))))
            engine.step()
            if lend:
                # A first round drops what the engine keeps on the GPU for reuse and makes again
                # in the next backward (spare gradient buffers, kept gathered copies): `held` is
                # then the state that offload_states() lends out and reload_states() brings back.
                engine.offload_states()
                engine.reload_states()
                held = engine._engine.device_used_bytes
                free_before = torch.cuda.mem_get_info()[0]
                engine.offload_states()
                torch.cuda.synchronize()
                freed = held - engine._engine.device_used_bytes
                assert freed > 0
                assert torch.cuda.mem_get_info()[0] >= free_before  # the pool may keep some
                other = torch.empty(freed, dtype=torch.uint8, device="cuda")  # the other work
                del other
                engine.reload_states()
                assert engine._engine.device_used_bytes == held
        master = engine.read_master()
        engine.close()
        return {n: master[n] for n in names if n in master}

    want = run(False)
    got = run(True)
    for n in want:
        assert torch.equal(got[n], want[n]), n


@pytest.fixture(scope="module")
def accelerate_gpu_reference(tmp_path_factory):
    """accelerate_worker.py with accelerate's own Accelerator on the GPU, without DeepSpeed: one
    run (a process that imports transformers and starts CUDA) for every case below."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import test_accelerate as ta
    return ta.run(tmp_path_factory.mktemp("accelerate_ref"), "ref", "--gpu")


@needs_gpu
@pytest.mark.parametrize("stage,offload", [(3, "none"), (3, "cpu")])
def test_an_accelerate_deepspeed_script_trains_on_the_gpu(tmp_path, stage, offload,
                                                          accelerate_gpu_reference):
    """accelerate_worker.py (test_accelerate.py's script) on the GPU: strata's Accelerator with
    the plugin against accelerate's own Accelerator without DeepSpeed, fp32."""
    import test_accelerate as ta
    ref = accelerate_gpu_reference
    got = ta.run(tmp_path, "strata", "--gpu", "--strata",
                 ta.write(tmp_path, ta.config(stage, offload)))
    assert got["device"].startswith("cuda") and got["engine_device"].startswith("cuda")
    ta.assert_same_run(got, ref)


@needs_gpu
def test_cpu_checkpointing_keeps_the_blocks_inputs_in_host_memory(monkeypatch):
    """deepspeed.checkpointing with cpu_checkpointing: between the forward and the backward the
    checkpointed blocks' inputs wait in host memory, so the device holds less by about their
    bytes (8 blocks x a 4 MiB input each), and the gradients are those of the run that keeps
    them on the device."""
    import strata.checkpointing as ck
    monkeypatch.setattr(ck, "_options", dict(ck._DEFAULTS))
    monkeypatch.setattr(ck, "_configured", False)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                     torch.nn.GELU()) for _ in range(8)).cuda()

    x0 = torch.randn(1024, 1024, device="cuda")  # one input for both runs

    def run(cpu):
        ck.configure(None, checkpoint_in_cpu=cpu)
        blocks.zero_grad()
        x = x0.clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = x
        for b in blocks:
            h = ck.checkpoint(b, h * 1.0)  # a fresh input per block, as a residual stream makes
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        h.sum().backward()
        return held, [p.grad.clone() for p in blocks.parameters()]

    on_device, want = run(False)
    on_host, got = run(True)
    assert on_device - on_host >= 7 * 4 * 2**20  # 8 inputs of 4 MiB, one of slack
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@needs_gpu
@pytest.mark.parametrize("stage,offload", [(0, "none"), (3, "none"), (3, "cpu")])
def test_written_optimizer_state_trains_on_the_gpu(stage, offload, tmp_path):
    """safe_set_full_fp32_param / safe_set_*_optimizer_state (Engine::WriteOptimizerState) on
    CudaDevice, where the CUDA Adam keeps the state in device memory (stages 0 and 3, nothing
    offloaded) or the CPU Adam in host memory: read back as written, and two more steps train as
    torch AdamW on the GPU after the same writes (test_tensor_fragment.py on the host)."""
    from test_tensor_fragment import writes_against_torch
    writes_against_torch(stage, offload, tmp_path, device="cuda")


@needs_gpu
@pytest.mark.parametrize("where", ["block", "function"])
def test_a_frozen_teachers_weight_saved_in_the_forward_is_gathered_in_backward(where):
    """A frozen teacher's stage-3 weight saved by a custom Function in the student's forward
    (TRL's fused distillation loss), both engines on the GPU: backward gets its values gathered
    (test_external_parameters.py on the host), the student's gradients torch's on the GPU."""
    from test_external_parameters import saved_foreign_parameter_against_torch
    saved_foreign_parameter_against_torch(where, False, device="cuda")


@needs_gpu
@pytest.mark.parametrize("stage,offload,how", [(0, "none", "engine"), (3, "none", "torch"),
                                               (3, "cpu", "engine+zero_grad"), (2, "none", "drop")])
def test_a_backward_that_raises_on_the_gpu_is_dropped_and_training_goes_on(stage, offload, how,
                                                                          tmp_path):
    """Engine::DiscardGradients on CudaDevice (gradient buffers taken on torch's stream, freed
    behind it): training goes on as torch's AdamW on the GPU skipping the batch, and a
    checkpoint saves at once (test_failed_backward.py on the host)."""
    from test_failed_backward import assert_trained_without_the_bad_batch, train as train_skip
    got = train_skip(stage, offload, how, save_dir=tmp_path, device="cuda")
    assert_trained_without_the_bad_batch(got, device="cuda")
