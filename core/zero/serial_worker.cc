#include "core/zero/serial_worker.h"

#include <utility>

namespace strata::zero {

SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

std::shared_future<Status> SerialWorker::Post(std::function<Status()> job) {
  std::packaged_task<Status()> task(std::move(job));
  std::shared_future<Status> result = task.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
  cv_.notify_one();
  return result;
}

void SerialWorker::Run() {
  for (;;) {
    std::packaged_task<Status()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !queue_.empty() || closing_; });
      if (queue_.empty()) return;  // closing, and every job has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace strata::zero
