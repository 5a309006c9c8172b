// A thread that runs posted jobs one after another, in the order posted. The engine's
// accumulation of reduced gradients into the fp32 gradients (overlap_comm) runs on one, behind
// the trainer's backward.
//
// Thread safety: Post from one thread at a time (the engine's). The destructor runs every job
// posted, then joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "strata/status.h"

namespace strata::zero {

class SerialWorker {
 public:
  SerialWorker() = default;
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;
  ~SerialWorker();

  // Queues `job` after every job posted before it; the thread starts with the first. The future
  // holds what the job returned.
  std::shared_future<Status> Post(std::function<Status()> job);

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<Status()>> queue_;
  bool closing_ = false;
  std::thread thread_;
};

}  // namespace strata::zero
