// OpenIoBackend: picks the backend, falling back from io_uring to posix with a one-line reason.
#include "nvme/posix_backend.h"
#include "nvme/sim_backend.h"
#include "nvme/uring_backend.h"
#include "strata/io.h"

namespace strata {

Result<std::unique_ptr<IoBackend>> OpenIoBackend(const IoBackendOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return Status::InvalidArgument("io backend: queue_depth " +
                                   std::to_string(options.queue_depth) + " out of range 1..4096");
  }
  if (options.posix_threads == 0 || options.posix_threads > 256) {
    return Status::InvalidArgument("io backend: posix_threads " +
                                   std::to_string(options.posix_threads) + " out of range 1..256");
  }
  switch (options.kind) {
    case IoBackendKind::kSimulated: {
      nvme::SimOptions sim;
      sim.queue_depth = options.queue_depth;
      return std::unique_ptr<IoBackend>(new nvme::SimBackend(sim));
    }
    case IoBackendKind::kPosix:
      return std::unique_ptr<IoBackend>(
          new nvme::PosixBackend(options.queue_depth, options.posix_threads));
    case IoBackendKind::kIoUring: {
      STRATA_ASSIGN_OR_RETURN(auto uring, nvme::UringBackend::Open(options));
      return std::unique_ptr<IoBackend>(std::move(uring));
    }
    case IoBackendKind::kAuto:
      break;
  }
  auto uring = nvme::UringBackend::Open(options);
  if (uring.ok()) return std::unique_ptr<IoBackend>(std::move(uring).value());
  auto posix = std::make_unique<nvme::PosixBackend>(options.queue_depth, options.posix_threads);
  posix->set_note("io_uring unavailable (" + std::string(uring.status().message()) +
                  "); using posix pread/pwrite on " + std::to_string(options.posix_threads) +
                  " threads");
  return std::unique_ptr<IoBackend>(std::move(posix));
}

}  // namespace strata
