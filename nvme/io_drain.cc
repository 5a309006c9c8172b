#include "nvme/io_drain.h"

#include <chrono>
#include <thread>

namespace strata::nvme {

bool DrainInflight(IoBackend& io, std::span<IoCompletion> sink, Status* first_error) {
  int failures = 0;
  while (io.inflight() > 0) {
    Result<size_t> got = io.Reap(sink, 1);
    if (!got.ok()) {
      if (first_error->ok()) *first_error = got.status();
      if (++failures >= kMaxDrainFailures) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    failures = 0;
    for (size_t i = 0; i < *got; ++i) {
      if (!sink[i].status.ok() && first_error->ok()) *first_error = sink[i].status;
    }
  }
  return true;
}

}  // namespace strata::nvme
