"""DeepSpeed's monitors: the config's "tensorboard", "csv_monitor" and "wandb" sections.

engine.monitor is a MonitorMaster, as DeepSpeedEngine.monitor: `enabled` when any section is,
and write_events([(name, value, step), ...]) writes each event to every enabled monitor, on rank 0
only (elsewhere it does nothing). The engine itself writes what DeepSpeed's does at each
optimizer step, on rank 0: ("Train/Samples/lr", the next step's lr of optimizer group 0,
global_samples), and with fp16 ("Train/Samples/loss_scale", the scale, global_samples).

  tensorboard: {"enabled", "output_path" (""), "job_name" ("DeepSpeedJobName")}: a
      torch.utils.tensorboard SummaryWriter in output_path/job_name, flushed after each call
      (needs the `tensorboard` package: its absence is an error at initialize naming it).
  csv_monitor: the same keys: one file per event name in output_path/job_name, the name's "/"
      and spaces as "_" ("Train_Samples_lr.csv"), a "step,<last part of the name>" header, then a
      "step,value" row per event, as DeepSpeed's csvMonitor.
  wandb: {"enabled", "team", "group", "project" ("deepspeed")}: wandb.init(entity=team,
      group=group, project=project), then wandb.log({name: value}, step=step) (needs `wandb`).
The "comet" section is not supported: a warning names it.
"""
from __future__ import annotations

import csv
import os
import warnings
from typing import Iterable, Optional

from .config import config_bool


def _section(config: dict, name: str) -> Optional[dict]:
    s = config.get(name)
    return s if isinstance(s, dict) and config_bool(s.get("enabled", False)) else None


def _log_dir(section: dict) -> str:
    return os.path.join(str(section.get("output_path") or ""),
                        str(section.get("job_name", "DeepSpeedJobName")))


class _Csv:
    def __init__(self, section: dict):
        self.dir = _log_dir(section)
        os.makedirs(self.dir, exist_ok=True)
        self.started: set = set()

    def write(self, events: list) -> None:
        for name, value, step in events:
            stem = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.dir, stem + ".csv"), "a+", newline="") as f:
                w = csv.writer(f)
                if stem not in self.started:
                    self.started.add(stem)
                    w.writerow(["step", name.split("/")[-1]])
                w.writerow([step, float(value)])


class _TensorBoard:
    def __init__(self, section: dict):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(f"config \"tensorboard\" is enabled, and torch's SummaryWriter "
                              f"cannot be imported ({e}): pip install tensorboard, or disable "
                              "the section") from e
        log_dir = _log_dir(section)
        os.makedirs(log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, events: list) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()


class _Wandb:
    def __init__(self, section: dict):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(f"config \"wandb\" is enabled, and wandb cannot be imported ({e}): "
                              "pip install wandb, or disable the section") from e
        self.wandb = wandb
        wandb.init(project=section.get("project", "deepspeed"), group=section.get("group"),
                   entity=section.get("team"))

    def write(self, events: list) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)


class MonitorMaster:
    """As DeepSpeed's MonitorMaster (see the module's docstring)."""

    def __init__(self, config: dict, rank: int):
        kinds = {"tensorboard": _TensorBoard, "csv_monitor": _Csv, "wandb": _Wandb}
        enabled = {k: _section(config, k) for k in kinds}
        self.enabled = any(s is not None for s in enabled.values())
        if _section(config, "comet") is not None:
            warnings.warn("strata: the config's \"comet\" monitor is not supported; its events "
                          "are not written", stacklevel=3)
        self._writers = [] if rank != 0 else [
            kinds[k](s) for k, s in enabled.items() if s is not None]

    def write_events(self, event_list: Iterable) -> None:
        """Writes (name, value, step) events to every enabled monitor, on rank 0."""
        events = [(str(n), v, int(s)) for n, v, s in event_list]
        for w in self._writers:
            w.write(events)
