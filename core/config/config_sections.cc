// The optimizer, scheduler, aio and checkpoint sections of a DeepSpeed config, and those the
// Python adapter acts on (dataloader_drop_last, the monitors).
#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

#include "core/config/config_reader.h"

namespace strata::config {

using Kind = ConfigDiagnostic::Kind;

namespace {

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// betas: a pair [b1, b2], each in [0, 1); "auto" allowed (the trainer's adam_beta1/2).
void ReadBetas(Reader& r, Section& p, OptimizerConfig* o) {
  std::string used;
  Json* v = r.Find(p, {"betas"}, &used);
  if (v == nullptr) return;
  std::string path = r.PathOf(p, "betas");
  if (r.IsUnresolvedAuto(p, v, "betas", AutoPolicy::kTrainerFills)) {
    o->betas = AutoOr<std::pair<double, double>>::Auto();
    return;
  }
  if (!v->is_array() || v->size() != 2) {
    r.Error(Kind::kType, path,
            "expected a pair [beta1, beta2] such as [0.9, 0.999], got " + v->dump());
    return;
  }
  auto b1 = r.ToDouble((*v)[0], path + "[0]", 0.0);
  auto b2 = r.ToDouble((*v)[1], path + "[1]", 0.0);
  if (!b1 || !b2) return;
  if (*b1 >= 1.0 || *b2 >= 1.0) {
    r.Error(Kind::kRange, path, "expected each beta in [0, 1), got " + v->dump());
    return;
  }
  o->betas = std::pair<double, double>{*b1, *b2};
}

}  // namespace

void ReadOptimizer(Reader& r, Section& root, OptimizerConfig* o) {
  Section s = r.Child(root, "optimizer");
  if (!s.present()) return;
  std::string type;
  if (!r.String(s, {"type"}, &type)) {
    if (r.Member(s, "type") == nullptr) {
      r.Error(Kind::kType, r.PathOf(s, "type"), "missing; expected \"Adam\" or \"AdamW\"");
    }
    return;
  }
  std::string low = Lower(type);
  if (low == "adam") {
    o->type = OptimizerType::kAdam;
  } else if (low == "adamw") {
    o->type = OptimizerType::kAdamW;
  } else {
    r.Error(Kind::kUnsupported, r.PathOf(s, "type"),
            "strata runs Adam and AdamW (its CPU Adam); got \"" + type +
                "\". Use \"Adam\" or \"AdamW\", or remove the section and let the trainer bring "
                "its optimizer");
    return;
  }
  Section p = r.Child(s, "params");
  r.AutoDouble(p, {"lr"}, &o->lr, 0.0);
  ReadBetas(r, p, o);
  r.AutoDouble(p, {"eps"}, &o->eps, 0.0);
  r.AutoDouble(p, {"weight_decay"}, &o->weight_decay, 0.0);
  bool w_given = r.Bool(p, {"adam_w_mode"}, &o->adam_w_mode);
  if (o->type == OptimizerType::kAdamW) {
    if (w_given && !o->adam_w_mode) {
      r.Warn(Kind::kIgnored, r.PathOf(p, "adam_w_mode"),
             "\"AdamW\" always uses decoupled weight decay; adam_w_mode: false is ignored (use "
             "type \"Adam\" for L2-regularised Adam)");
    }
    o->adam_w_mode = true;
  }
  r.Bool(p, {"bias_correction"}, &o->bias_correction);
  if (r.Member(p, "max_grad_norm") != nullptr) {
    r.Warn(Kind::kIgnored, r.PathOf(p, "max_grad_norm"),
           "max_grad_norm is not an optimizer parameter (DeepSpeed refuses it with a "
           "ValueError); strata ignores it: use the top-level 'gradient_clipping'");
  }
  if (const Json* v = r.Member(p, "fp32_optimizer_states");
      v != nullptr && v->is_boolean() && !v->get<bool>()) {
    r.Warn(Kind::kIgnored, r.PathOf(p, "fp32_optimizer_states"),
           "false is not acted on: strata keeps Adam's moments in fp32 (8 bytes per parameter, "
           "where DeepSpeed's CPU Adam would keep them in the parameters' 16-bit type); "
           "'offloadctl plan' and the engine's budget checks count those bytes");
  }
  // Options that change Adam's arithmetic, which strata's Adam does not have.
  for (const char* name : {"amsgrad", "maximize"}) {
    const Json* v = r.Member(p, name);
    if (v != nullptr && v->is_boolean() && v->get<bool>()) {
      r.Error(Kind::kUnsupported, r.PathOf(p, name),
              std::string(name) + ": true is not supported; strata's Adam has no " + name +
                  " variant (DeepSpeed's FusedAdam and CPU Adam refuse it too)");
    }
  }
  if (p.present()) {
    for (auto it = p.obj->begin(); it != p.obj->end(); ++it) {
      if (p.consumed.count(it.key()) != 0) continue;
      Json* v = &it.value();
      r.IsUnresolvedAuto(p, v, it.key(), AutoPolicy::kTrainerFills);
      o->other_params[it.key()] = v->dump();
    }
  }
  r.FinishSection(p);  // unknown names (a misspelt weight_decay): DeepSpeed's TypeError
  r.FinishSection(s);
}

namespace {

SchedulerType SchedulerFromName(const std::string& name) {
  if (name == "WarmupLR") return SchedulerType::kWarmupLR;
  if (name == "WarmupDecayLR") return SchedulerType::kWarmupDecayLR;
  if (name == "WarmupCosineLR") return SchedulerType::kWarmupCosineLR;
  if (name == "OneCycle") return SchedulerType::kOneCycle;
  if (name == "LRRangeTest") return SchedulerType::kLRRangeTest;
  return SchedulerType::kOther;
}

void ReadScheduler(Reader& r, Section& root, SchedulerConfig* sc) {
  Section s = r.Child(root, "scheduler");
  if (!s.present()) return;
  if (!r.String(s, {"type"}, &sc->type_name)) {
    if (r.Member(s, "type") == nullptr) {
      r.Error(Kind::kType, r.PathOf(s, "type"),
              "missing; expected a scheduler such as \"WarmupLR\", \"WarmupDecayLR\", "
              "\"WarmupCosineLR\" or \"OneCycle\"");
    }
    return;
  }
  sc->type = SchedulerFromName(sc->type_name);
  if (sc->type == SchedulerType::kOther) {
    r.Warn(Kind::kIgnored, r.PathOf(s, "type"),
           "\"" + sc->type_name +
               "\" is not a DeepSpeed scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR, "
               "OneCycle, LRRangeTest); DeepSpeed looks it up in torch.optim.lr_scheduler");
  }
  Section p = r.Child(s, "params");
  if (p.present()) {
    for (auto it = p.obj->begin(); it != p.obj->end(); ++it) {
      p.consumed.insert(it.key());
      Json* v = &it.value();
      r.IsUnresolvedAuto(p, v, it.key(), AutoPolicy::kTrainerFills);
      sc->params[it.key()] = v->dump();
    }
  }
  r.FinishSection(s);
}

// `thread_count` is the old name of `intra_op_parallelism`. DeepSpeed 0.19.8 reads only the new
// one and ignores the old silently, so a config that sets only `thread_count` runs DeepSpeed
// with 1 thread. strata reads the old name when the new one is absent (what its author meant)
// and says so in a note, since DeepSpeed would not.
void ReadAioParallelism(Reader& r, Section& s, AioConfig* a) {
  const bool given = r.Int(s, {"intra_op_parallelism"}, &a->intra_op_parallelism, 1);
  std::string used;
  Json* legacy = r.Find(s, {"thread_count"}, &used);
  if (legacy == nullptr) return;
  const std::string path = r.PathOf(s, "thread_count");
  const Json* current = r.Member(s, "intra_op_parallelism");
  if (given || (current != nullptr && !current->is_null())) {
    r.Note(path +
           ": the old name of 'intra_op_parallelism', which is given too; ignored (as "
           "DeepSpeed ignores it): remove it");
    return;
  }
  if (r.IsUnresolvedAuto(s, legacy, "thread_count", AutoPolicy::kDeepSpeedRule)) return;
  if (auto n = r.ToInt(*legacy, path, 1)) {
    a->intra_op_parallelism = *n;
    r.Note(path +
           ": the old name of 'intra_op_parallelism'; strata reads it as "
           "intra_op_parallelism = " +
           std::to_string(*n) +
           ", but DeepSpeed 0.19.8 ignores it and runs with its default of 1: rename it to "
           "'intra_op_parallelism'");
  }
}

void ReadAio(Reader& r, Section& root, AioConfig* a) {
  Section s = r.Child(root, "aio");
  if (r.Int(s, {"block_size"}, &a->block_size, 1) &&
      (a->block_size < kAioMinBlockSize || a->block_size > kAioMaxBlockSize)) {
    r.Warn(Kind::kRange, "aio.block_size",
           std::to_string(a->block_size) + " is outside what strata runs (" +
               std::to_string(kAioMinBlockSize) + " to " + std::to_string(kAioMaxBlockSize) +
               " bytes): its IO requests use " +
               std::to_string(std::clamp(a->block_size, kAioMinBlockSize, kAioMaxBlockSize)));
  }
  if (r.Int(s, {"queue_depth"}, &a->queue_depth, 1) && a->queue_depth > kAioMaxQueueDepth) {
    r.Warn(Kind::kRange, "aio.queue_depth",
           std::to_string(a->queue_depth) + " runs as " + std::to_string(kAioMaxQueueDepth) +
               ", the most IOs strata keeps in flight per backend");
  }
  if (s.present()) ReadAioParallelism(r, s, a);
  r.Bool(s, {"single_submit"}, &a->single_submit);
  r.Bool(s, {"overlap_events"}, &a->overlap_events);
  if (r.Bool(s, {"use_gds"}, &a->use_gds) && a->use_gds) {
    r.Warn(Kind::kIgnored, "aio.use_gds",
           "GPUDirect Storage is not supported: NVMe reads and writes go through host memory");
  }
  r.FinishSection(s);
}

}  // namespace

void ReadSchedulerAndAio(Reader& r, Section& root, SchedulerConfig* sc, AioConfig* aio) {
  ReadScheduler(r, root, sc);
  ReadAio(r, root, aio);
}

// `checkpoint`: strata's retention keys; DeepSpeed's keys stay unacted (FinishSection).
void ReadCheckpoint(Reader& r, Section& root, CheckpointConfig* c) {
  Section s = r.Child(root, "checkpoint");
  r.Int(s, {"keep_last"}, &c->keep_last, 0);
  r.Bool(s, {"recycle_files"}, &c->recycle_files);
  r.FinishSection(s);
}

void ReadAdapterSections(Reader& r, Section& root) {
  bool flag = false;
  std::string text;
  r.Bool(root, {"dataloader_drop_last"}, &flag);
  r.String(root, {"log_level"}, &text);  // DeepSpeed's logger's level (strata.utils)
  for (const char* monitor : {"tensorboard", "csv_monitor", "wandb"}) {
    Section s = r.Child(root, monitor);
    r.Bool(s, {"enabled"}, &flag);
    if (std::string_view(monitor) == "wandb") {
      for (const char* k : {"team", "group", "project"}) r.String(s, {k}, &text);
    } else {
      for (const char* k : {"output_path", "job_name"}) r.String(s, {k}, &text);
    }
    r.FinishSection(s);
  }
}

}  // namespace strata::config
