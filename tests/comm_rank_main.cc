// A rank program for the launcher tests: connects through the rendezvous the environment describes
// (cpu::RendezvousConfig::FromEnv), all-reduces rank+1 and prints the sum. `comm_rank_main die K`:
// rank K exits with code 3 right after setup and the others report the failed collective (exit 4).
// Exit 2: bad rendezvous settings (message on stderr).
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cpu/gloo_comm.h"
#include "cpu/rendezvous/rendezvous.h"

int main(int argc, char** argv) {
  using namespace strata;
  auto cfg = cpu::RendezvousConfig::FromEnv();
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str());
    return 2;
  }
  const int die = argc > 2 && std::string(argv[1]) == "die" ? std::atoi(argv[2]) : -1;
  auto store = cpu::OpenRendezvousStore(*cfg);
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    return 2;
  }
  GlooCommOptions o;
  o.rank = cfg->rank;
  o.world_size = cfg->world_size;
  o.store = store->get();
  o.timeout = cfg->timeout;
  auto comm = CreateGlooCommunicator(o);
  if (!comm.ok()) {
    std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
    return 2;
  }
  if (cfg->rank == die) ::_exit(3);
  float v[4] = {0, 0, 0, 0};
  for (float& x : v) x = static_cast<float>(cfg->rank + 1);
  auto h = (*comm)->AllReduce(v, v, 4, DType::kF32);
  const Status st = h.ok() ? h->WaitFor(std::chrono::seconds(60)) : h.status();
  if (!st.ok()) {
    std::fprintf(stderr, "collective failed: %s\n", st.ToString().c_str());
    return 4;
  }
  const float want = cfg->world_size * (cfg->world_size + 1) / 2.0f;
  std::printf("rank %d sum %g %s\n", cfg->rank, v[0], v[0] == want ? "ok" : "WRONG");
  return v[0] == want ? 0 : 1;
}
