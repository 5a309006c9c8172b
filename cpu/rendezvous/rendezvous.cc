#include "cpu/rendezvous/rendezvous.h"

#include <memory>
#include <string>

namespace strata::cpu {

namespace {
// A view of a store whose keys all live under `prefix` (the run's scope).
class PrefixedKvStore final : public KvStore {
 public:
  PrefixedKvStore(std::unique_ptr<KvStore> base, std::string prefix)
      : base_(std::move(base)), prefix_(std::move(prefix)) {}
  Status Set(std::string_view key, std::span<const uint8_t> value) override {
    return base_->Set(prefix_ + std::string(key), value);
  }
  Result<std::vector<uint8_t>> Get(std::string_view key,
                                   std::chrono::milliseconds timeout) override {
    return base_->Get(prefix_ + std::string(key), timeout);
  }
  Status Delete(std::string_view key) override { return base_->Delete(prefix_ + std::string(key)); }

 private:
  std::unique_ptr<KvStore> base_;
  const std::string prefix_;
};
}  // namespace

}  // namespace strata::cpu

namespace strata {

Result<LaunchRendezvous> OpenLaunchRendezvous() {
  STRATA_ASSIGN_OR_RETURN(cpu::RendezvousConfig config, cpu::RendezvousConfig::FromEnv());
  LaunchRendezvous out;
  out.rank = config.rank;
  out.world_size = config.world_size;
  out.local_rank = config.local_rank;
  STRATA_ASSIGN_OR_RETURN(out.store, cpu::OpenRendezvousStore(config));
  return out;
}

}  // namespace strata

namespace strata::cpu {

Result<std::unique_ptr<KvStore>> OpenRendezvousStore(const RendezvousConfig& config) {
  STRATA_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<KvStore> store;
  if (!config.file_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto fs, FileKvStore::Open(config.file_dir));
    store = std::move(fs);
  } else {
    TcpKvStoreOptions o;
    o.host = config.master_addr;
    o.port = config.master_port;
    o.is_server = config.rank == 0;
    o.timeout = config.timeout;
    o.secret = config.secret;
    o.insecure = config.insecure;
    STRATA_ASSIGN_OR_RETURN(auto ts, TcpKvStore::Open(o));
    store = std::move(ts);
  }
  if (config.run_id.empty()) return store;
  return std::unique_ptr<KvStore>(
      std::make_unique<PrefixedKvStore>(std::move(store), "run/" + config.run_id + "/"));
}

}  // namespace strata::cpu
