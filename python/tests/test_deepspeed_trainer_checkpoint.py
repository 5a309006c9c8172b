"""A Hugging Face Trainer run that DeepSpeed trained, resumed with strata's Trainer. The fixture
under data/deepspeed_trainer/ is checkpoint-4 of transformers' own Trainer under DeepSpeed 0.19.8
(ZeRO-3, bf16, one rank; the DeepSpeed config has no optimizer or scheduler, so the Trainer made
its AdamW and linear-warmup schedule: DeepSpeed saves the optimizer and the lr in force, the
Trainer the schedule in scheduler.pt), and deepspeed_resumed.json what DeepSpeed logged when it
resumed from it. strata's Trainer must log the same lrs and losses for steps 5-8."""
import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from strata.integrations.transformers import Trainer, TrainingArguments  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed_trainer",
                       "stage3_bf16_trainer_scheduler")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(123)
        self.x = torch.randint(0, 128, (64, 16), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i].clone(),
                "attention_mask": torch.ones(16, dtype=torch.long)}


class _InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


@pytest.fixture
def process_group_as_it_was():
    """The Trainer (accelerate's state, use_cpu) starts torch.distributed: ended after the test,
    as a script's exit would, so that later tests see the process as they found it."""
    was = torch.distributed.is_initialized()
    yield
    if not was and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_a_trainer_run_deepspeed_saved_resumes_with_its_schedule(tmp_path,
                                                                 process_group_as_it_was):
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(os.path.join(FIXTURE, "checkpoint-4"), checkpoint)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=False))
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             max_steps=8, save_strategy="no", logging_steps=1,
                             learning_rate=1e-2, warmup_steps=2, weight_decay=0.01, bf16=True,
                             report_to=[], seed=0, dataloader_num_workers=0, deepspeed=config,
                             disable_tqdm=True, max_grad_norm=1.0, use_cpu=True)
    trainer = _InOrder(model=model, args=args, train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=str(checkpoint))
    with open(os.path.join(FIXTURE, "deepspeed_resumed.json")) as f:
        deepspeed = json.load(f)
    logged = [h for h in trainer.state.log_history if "loss" in h and h["step"] > 4]
    assert [h["step"] for h in logged] == [5, 6, 7, 8]
    assert [h["learning_rate"] for h in logged] == pytest.approx(
        [deepspeed["lrs"][str(s)] for s in (5, 6, 7, 8)], rel=1e-12)
    assert [h["loss"] for h in logged] == pytest.approx(
        [deepspeed["losses"][str(s)] for s in (5, 6, 7, 8)], abs=1e-5)
    trainer.strata_engine.close()
