"""A training script written the way accelerate's users write them (transformers'
run_clm_no_trainer.py, accelerate's deepspeed_with_config_support.py): the tiny Llama of
test_hf_trainer, a DataLoader, AdamW and a linear schedule (or DummyOptim / DummyScheduler when
the DeepSpeed config has an optimizer), `accelerator.accumulate`, `backward`,
`clip_grad_norm_`, the optimizer / scheduler calls, `gather`, `save_state` / `load_state`,
`get_state_dict` and `save_pretrained`.

--strata CONFIG: strata's Accelerator with DeepSpeedPlugin(hf_ds_config=CONFIG); --env CONFIG:
the plugin accelerate builds from ACCELERATE_USE_DEEPSPEED / ACCELERATE_DEEPSPEED_CONFIG_FILE;
neither: accelerate's own Accelerator without DeepSpeed (the reference). Writes OUT (torch.save):
the mean loss of every micro-step over the processes, each step's lr and grad norm, and the
final state_dict from get_state_dict (main process)."""
import argparse
import os

import torch

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--strata")
ap.add_argument("--env")
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--gas", type=int, default=2)
ap.add_argument("--dummy", action="store_true", help="DummyOptim + DummyScheduler(callable)")
ap.add_argument("--lora", action="store_true")
ap.add_argument("--save-state-at", type=int, default=0)
ap.add_argument("--state-dir")
ap.add_argument("--resume-from")
ap.add_argument("--save-pretrained")
ap.add_argument("--mixed-precision")
ap.add_argument("--save-model")
ap.add_argument("--second-accelerator", action="store_true")
ap.add_argument("--gpu", action="store_true", help="on the GPU (default: cpu=True)")
ap.add_argument("--no-cpu-arg", action="store_true",
                help="no cpu= argument (a script written for GPUs, run on a machine without one)")
ap.add_argument("--from-pretrained", help="the model from this directory (transformers' "
                "from_pretrained, after the Accelerator) instead of tiny_llama()")
ap.add_argument("--no-zero3-init", action="store_true", help="DeepSpeedPlugin(zero3_init_flag=False)")
args = ap.parse_args()

if args.env:
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=args.env)
if "RANK" in os.environ:  # accelerate starts torch.distributed (gloo) from these
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

import transformers  # noqa: E402
from strata.integrations.accelerate import DeepSpeedPlugin, DummyOptim, DummyScheduler  # noqa: E402

from test_hf_trainer import Tokens, tiny_llama  # noqa: E402

if args.strata or args.env:
    from strata.integrations.accelerate import Accelerator
else:
    from accelerate import Accelerator

torch.set_num_threads(1)
kw = {}
if args.strata:
    kw["deepspeed_plugin"] = DeepSpeedPlugin(
        hf_ds_config=args.strata, **({"zero3_init_flag": False} if args.no_zero3_init else {}))
if args.mixed_precision:
    kw["mixed_precision"] = args.mixed_precision
if not args.no_cpu_arg:
    kw["cpu"] = not args.gpu
accelerator = Accelerator(gradient_accumulation_steps=args.gas, **kw)

if args.from_pretrained:
    model = transformers.AutoModelForCausalLM.from_pretrained(args.from_pretrained)
else:
    model = tiny_llama()
partitioned = [p.numel() == 0 and hasattr(p, "ds_numel") for p in model.parameters()]
if args.lora:
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0))
loader = torch.utils.data.DataLoader(Tokens(), batch_size=4, shuffle=False)
no_decay = ["bias", "norm.weight"]
groups = [
    {"params": [p for n, p in model.named_parameters()
                if p.requires_grad and not any(nd in n for nd in no_decay)],
     "weight_decay": 0.01},
    {"params": [p for n, p in model.named_parameters()
                if p.requires_grad and any(nd in n for nd in no_decay)],
     "weight_decay": 0.0},
]
groups = [g for g in groups if g["params"]]
plugin = accelerator.state.deepspeed_plugin
use_dummy = plugin is not None and "optimizer" in plugin.deepspeed_config
assert use_dummy == args.dummy, (use_dummy, args.dummy)
if use_dummy:
    optimizer = DummyOptim(groups, lr=1e-2)
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: transformers.get_scheduler(
        "linear", optimizer=opt, num_warmup_steps=2, num_training_steps=args.steps))
else:
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    scheduler = transformers.get_scheduler("linear", optimizer=optimizer, num_warmup_steps=2,
                                           num_training_steps=args.steps)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

no_sync_calls = [0]
if hasattr(model, "no_sync"):  # counts accumulate()'s use of the engine's (or DDP's) no_sync
    inner = model.no_sync

    def counted():
        no_sync_calls[0] += 1
        return inner()
    model.no_sync = counted

done = 0
if args.resume_from:
    accelerator.load_state(args.resume_from)
    done = args.save_state_at
rec = {"loss": [], "lr": [], "grad_norm": [], "distributed_type": accelerator.distributed_type.name,
       "mixed_precision": accelerator.mixed_precision}
skip = done * accelerator.gradient_accumulation_steps
while done < args.steps:
    model.train()
    active = loader
    if skip:
        active = accelerator.skip_first_batches(loader, skip)
        skip = 0
    for batch in active:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        rec["loss"].append(accelerator.gather(loss.detach()[None]).mean().item())
        if accelerator.sync_gradients:
            done += 1
            rec["lr"].append(scheduler.get_last_lr()[0])
            rec["grad_norm"].append(float(norm))
            if done == args.save_state_at and args.state_dir:
                accelerator.save_state(args.state_dir)
            if done == args.steps:
                break

accelerator.wait_for_everyone()
rec["bf16"] = getattr(model, "bfloat16_enabled", lambda: None)()
rec["device"] = str(accelerator.device)
rec["engine_device"] = str(getattr(model, "device", accelerator.device))
try:
    state = accelerator.get_state_dict(model)
except ValueError as e:  # stage 3 without stage3_gather_16bit_weights_on_model_save
    rec["state_error"], state = str(e), {}
if args.save_pretrained:
    accelerator.unwrap_model(model).save_pretrained(
        args.save_pretrained, is_main_process=accelerator.is_main_process,
        save_function=accelerator.save, state_dict=state)
rec["no_sync_calls"] = no_sync_calls[0]
rec["partitioned_at_load"] = all(partitioned) if all(partitioned) or not any(partitioned) else None
if args.second_accelerator:  # as helper code builds one: the first one's plugin and state
    again = Accelerator()
    rec["second"] = (again.distributed_type.name, again.state.deepspeed_plugin is plugin,
                     accelerator.distributed_type.name)
    try:
        accelerator.prepare(tiny_llama())
    except RuntimeError as e:  # one model per Accelerator, refused before an engine is built
        rec["second_model"] = str(e)
if args.save_model:
    accelerator.save_model(model, args.save_model)
if accelerator.is_main_process:
    rec["state"] = {k: v.detach().float().cpu().clone() for k, v in state.items()}
    rec["gas"] = accelerator.gradient_accumulation_steps
    torch.save(rec, args.out)
accelerator.wait_for_everyone()
