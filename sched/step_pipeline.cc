#include "sched/step_pipeline.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace strata::sched {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t Ns(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

// Shared with the `done` closures, which may run on other threads until Run has drained them.
struct RunState {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint8_t> read_done;
  std::vector<uint32_t> slot_of;
  std::vector<uint32_t> free_slots;
  uint32_t reads_in_flight = 0;
  uint32_t writes_in_flight = 0;
  Status error;

  void Fail(Status s) {
    if (error.ok()) error = std::move(s);
  }
};

}  // namespace

Status StepPipeline::Run(size_t count, const PipelineStages& stages, PipelineStats* stats) {
  if (options_.buffers == 0) return Status::InvalidArgument("StepPipeline: buffers must be >= 1");
  if (!stages.read || !stages.compute || !stages.write) {
    return Status::InvalidArgument("StepPipeline: read, compute and write must all be set");
  }
  PipelineStats local;
  PipelineStats& st = stats ? *stats : local;
  st = PipelineStats{};
  const auto t0 = Clock::now();
  auto s = std::make_shared<RunState>();
  s->read_done.assign(count, 0);
  s->slot_of.assign(count, 0);
  for (uint32_t b = options_.buffers; b-- > 0;) s->free_slots.push_back(b);

  size_t next_read = 0;
  size_t cur = 0;
  // Issues reads within the read-ahead window while buffers are free. Called with the lock held;
  // drops it around the user callback.
  auto issue_reads = [&](std::unique_lock<std::mutex>& l) {
    while (s->error.ok() && next_read < count && next_read <= cur + options_.read_ahead &&
           !s->free_slots.empty()) {
      const size_t i = next_read++;
      const uint32_t slot = s->free_slots.back();
      s->free_slots.pop_back();
      s->slot_of[i] = slot;
      ++s->reads_in_flight;
      st.max_reads_in_flight = std::max(st.max_reads_in_flight, s->reads_in_flight);
      l.unlock();
      Status rs = stages.read(i, slot, [s, i, slot](Status r) {
        std::lock_guard<std::mutex> g(s->mu);
        --s->reads_in_flight;
        if (r.ok()) {
          s->read_done[i] = 1;
        } else {
          s->free_slots.push_back(slot);
          s->Fail(r.WithContext("read of sub-group " + std::to_string(i)));
        }
        s->cv.notify_all();
      });
      l.lock();
      if (!rs.ok()) {
        --s->reads_in_flight;
        s->free_slots.push_back(slot);
        s->Fail(rs.WithContext("starting read of sub-group " + std::to_string(i)));
      }
    }
  };

  std::unique_lock<std::mutex> l(s->mu);
  for (cur = 0; cur < count && s->error.ok(); ++cur) {
    issue_reads(l);
    const auto w0 = Clock::now();
    while (s->error.ok() && !s->read_done[cur]) {
      s->cv.wait(l);
      issue_reads(l);
    }
    st.wait_read_ns += Ns(Clock::now() - w0);
    if (!s->error.ok()) break;
    const uint32_t slot = s->slot_of[cur];
    l.unlock();
    const auto c0 = Clock::now();
    Status cs = stages.compute(cur, slot);
    st.compute_ns += Ns(Clock::now() - c0);
    l.lock();
    if (!cs.ok()) {
      s->free_slots.push_back(slot);
      s->Fail(cs.WithContext("compute of sub-group " + std::to_string(cur)));
      break;
    }
    ++s->writes_in_flight;
    st.max_writes_in_flight = std::max(st.max_writes_in_flight, s->writes_in_flight);
    const size_t i = cur;
    l.unlock();
    Status ws = stages.write(i, slot, [s, i, slot](Status r) {
      std::lock_guard<std::mutex> g(s->mu);
      --s->writes_in_flight;
      s->free_slots.push_back(slot);
      if (!r.ok()) s->Fail(r.WithContext("write of sub-group " + std::to_string(i)));
      s->cv.notify_all();
    });
    l.lock();
    if (!ws.ok()) {
      --s->writes_in_flight;
      s->free_slots.push_back(slot);
      s->Fail(ws.WithContext("starting write of sub-group " + std::to_string(i)));
      break;
    }
    // Write-behind depth: wait (issuing reads meanwhile) until at most write_behind remain.
    const auto w1 = Clock::now();
    while (s->error.ok() && s->writes_in_flight > options_.write_behind) {
      s->cv.wait(l);
      issue_reads(l);
    }
    st.wait_write_ns += Ns(Clock::now() - w1);
  }
  // Drain: nothing of this run may outlive it.
  const auto w2 = Clock::now();
  s->cv.wait(l, [&] { return s->reads_in_flight == 0 && s->writes_in_flight == 0; });
  st.wait_write_ns += Ns(Clock::now() - w2);
  st.total_ns = Ns(Clock::now() - t0);
  return s->error;
}

}  // namespace strata::sched
