"""A training script written the way DeepSpeed's examples are (DeepSpeedExamples'
training/cifar/cifar10_deepspeed.py): argparse with add_config_arguments and --local_rank,
init_distributed() before anything else, initialize(args=args, model=net,
model_parameters=filter(...), training_data=trainset), the engine's local_rank, device and
bfloat16_enabled(), get_accelerator().device_name(local_rank) for the inputs' device, a loop over
the loader initialize returns, and an evaluation through the model itself. The changes from the
DeepSpeed script: the imports (`import strata as deepspeed`, `from strata.accelerator import
get_accelerator`, and `import strata.comm as dist` for the loss averaged over ranks as
DeepSpeed-Chat logs it) and a random dataset instead of CIFAR's download. Rank 0 writes what it saw as
JSON to --out."""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import strata as deepspeed
import strata.comm as dist
from strata.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


deepspeed.init_distributed()

g = torch.Generator().manual_seed(1)
images = torch.randn(48, 3, 32, 32, generator=g)
targets = torch.randint(0, 10, (48,), generator=g)
trainset = torch.utils.data.TensorDataset(images, targets)

args = add_argument()


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


torch.manual_seed(0)
net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
model_engine, optimizer, trainloader, __ = deepspeed.initialize(
    args=args, model=net, model_parameters=parameters, training_data=trainset)

local_device = get_accelerator().device_name(model_engine.local_rank)
local_rank = model_engine.local_rank
bf16 = model_engine.bfloat16_enabled()
criterion = nn.CrossEntropyLoss()

losses, mean_losses = [], []
for epoch in range(args.epochs):
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(local_device), data[1].to(local_device)
        if bf16:
            inputs = inputs.to(torch.bfloat16)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        # The mean over ranks, as DeepSpeed-Chat's get_all_reduce_mean logs it.
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        losses.append(loss.item())
        mean_losses.append(mean.item() / dist.get_world_size())

correct = 0
with torch.no_grad():
    outputs = net(images.to(local_device))
    _, predicted = torch.max(outputs, 1)
    correct = (predicted == targets.to(local_device)).sum().item()
    eval_loss = criterion(outputs.float(), targets.to(local_device)).item()

# The comm calls DeepSpeed scripts and libraries make around the loop.
dist.monitored_barrier()
# On the accelerator's device, as a script must under NCCL (a group without a CPU backend).
counts = [torch.full((2,), float(dist.get_rank() + 1), device=local_device),
          torch.ones(3, device=local_device)]
dist.all_reduce_coalesced(counts)
comm = {"coalesced": [c.tolist() for c in counts],
        "ranks": dist.get_all_ranks_from_group(dist.get_world_group())}
dist.log_summary()

if dist.get_rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"world": dist.get_world_size(), "local_rank": local_rank,
                   "dist_local_rank": dist.get_local_rank(), "mean_losses": mean_losses,
                   "device": local_device, "engine_device": str(model_engine.device),
                   "args_local_rank": args.local_rank, "deepspeed": args.deepspeed,
                   "stage": model_engine.zero_optimization_stage(),
                   "train_batch_size": model_engine.train_batch_size(),
                   "fp16": model_engine.fp16_enabled(), "bf16": bf16,
                   "global_steps": model_engine.global_steps, "losses": losses,
                   "correct": correct, "eval_loss": eval_loss, "comm": comm}, f)
