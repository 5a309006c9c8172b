// The rank program of netns_comm_test, launched by tools/netns-topology.sh run (one network
// namespace per node): connects through the environment's rendezvous, builds the hierarchical
// groups from LOCAL_WORLD_SIZE, runs on the inter-node communicator an fp32 all-gather, a bf16
// reduce-scatter (fp32 partial sums on the wire) and an int8 all-to-all, and on the intra-node
// communicator an all-gather of the same size (which must stay off the inter-node link), checks
// every result, and writes its stats to OUT_DIR/rank<r>.json. After a barrier that follows the
// inter-node operations and after one that follows the intra-node one, rank 0 prints a line
// "netns_rank_main: mark <phase>" to stderr (for netns-topology.sh run --mark).
// `netns_rank_main OUT_DIR [ELEMS]`.
// Exit 2: setup failed; 3: a collective failed; 4: a wrong result.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "cpu/gloo_comm.h"
#include "cpu/rendezvous/rendezvous.h"

namespace {

using namespace strata;

int Fail(int code, const std::string& what) {
  std::fprintf(stderr, "netns_rank_main: %s\n", what.c_str());
  return code;
}

Status Run(Result<CommHandle> h) {
  return h.ok() ? h->WaitFor(std::chrono::seconds(60)) : h.status();
}

// Every rank finished the phase; then rank 0 says so.
Status Mark(Communicator& world, const char* phase) {
  STRATA_RETURN_IF_ERROR(Run(world.Barrier()));
  if (world.rank() == 0) {
    std::fprintf(stderr, "netns_rank_main: mark %s\n", phase);
    std::fflush(stderr);
  }
  return Status::OK();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Fail(2, "usage: netns_rank_main OUT_DIR [ELEMS]");
  const std::string out_dir = argv[1];
  const size_t n = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : (size_t{1} << 19);
  auto cfg = cpu::RendezvousConfig::FromEnv();
  if (!cfg.ok()) return Fail(2, cfg.status().ToString());
  auto store = cpu::OpenRendezvousStore(*cfg);
  if (!store.ok()) return Fail(2, store.status().ToString());
  GlooCommOptions o;  // hostname: STRATA_GLOO_HOSTNAME, this node's address
  o.rank = cfg->rank;
  o.world_size = cfg->world_size;
  o.store = store->get();
  o.timeout = cfg->timeout;
  auto comm = CreateGlooCommunicator(o);
  if (!comm.ok()) return Fail(2, comm.status().ToString());
  auto per_node = RanksPerNodeFromEnv(cfg->world_size);
  if (!per_node.ok()) return Fail(2, per_node.status().ToString());
  auto groups = SplitHierarchical(**comm, *per_node);
  if (!groups.ok()) return Fail(2, groups.status().ToString());
  Communicator& inter = *groups->inter;
  Communicator& intra = *groups->intra;
  const int nodes = inter.world_size(), node = inter.rank();

  // Inter all-gather (fp32): element i of node q's shard is q + i % 7.
  std::vector<float> shard(n), full(n * nodes);
  for (size_t i = 0; i < n; ++i) shard[i] = static_cast<float>(node + i % 7);
  Status st = Run(inter.AllGather(shard.data(), full.data(), n, DType::kF32));
  if (!st.ok()) return Fail(3, st.ToString());
  for (int q = 0; q < nodes; ++q) {
    if (full[q * n + 3] != static_cast<float>(q + 3)) return Fail(4, "all_gather result");
  }
  // Inter reduce-scatter (bf16, small integers: exact).
  std::vector<bf16_t> rs_in(n * nodes, FloatToBf16(static_cast<float>(node + 1))), rs_out(n);
  st = Run(inter.ReduceScatter(rs_in.data(), rs_out.data(), n, DType::kBF16));
  if (!st.ok()) return Fail(3, st.ToString());
  if (Bf16ToFloat(rs_out[n - 1]) != nodes * (nodes + 1) / 2.0f) {
    return Fail(4, "reduce_scatter result");
  }
  // Inter all-to-all (int8): chunk j of node q carries q * 10 + j.
  std::vector<int8_t> a_in(n * nodes), a_out(n * nodes);
  for (int j = 0; j < nodes; ++j) {
    std::fill(a_in.begin() + j * n, a_in.begin() + (j + 1) * n, static_cast<int8_t>(node * 10 + j));
  }
  st = Run(inter.AllToAll(a_in.data(), a_out.data(), n, DType::kI8));
  if (!st.ok()) return Fail(3, st.ToString());
  for (int j = 0; j < nodes; ++j) {
    if (a_out[j * n] != static_cast<int8_t>(j * 10 + node)) return Fail(4, "all_to_all result");
  }
  st = Mark(**comm, "inter");
  if (!st.ok()) return Fail(3, st.ToString());
  // Intra all-gather of the same size: loopback inside the node, never on the veth.
  std::vector<float> ifull(n * intra.world_size());
  st = Run(intra.AllGather(shard.data(), ifull.data(), n, DType::kF32));
  if (!st.ok()) return Fail(3, st.ToString());
  st = Mark(**comm, "intra");
  if (!st.ok()) return Fail(3, st.ToString());

  const CommStats is = inter.stats(), ns = intra.stats();
  uint64_t inter_rx = 0, intra_rx = 0;
  for (const auto& op : is.ops) inter_rx += op.wire_received_bytes;
  for (const auto& op : ns.ops) intra_rx += op.wire_received_bytes;
  std::ofstream f(out_dir + "/rank" + std::to_string(cfg->rank) + ".json");
  f << "{\"rank\": " << cfg->rank << ", \"node\": " << cfg->rank / *per_node
    << ", \"inter_wire_sent\": " << is.total_wire_sent_bytes()
    << ", \"inter_wire_received\": " << inter_rx
    << ", \"intra_wire_sent\": " << ns.total_wire_sent_bytes()
    << ", \"intra_wire_received\": " << intra_rx << "}\n";
  if (!f) return Fail(2, "cannot write " + out_dir);
  std::printf("rank %d node %d: inter wire sent %llu received %llu, intra sent %llu\n", cfg->rank,
              cfg->rank / *per_node, static_cast<unsigned long long>(is.total_wire_sent_bytes()),
              static_cast<unsigned long long>(inter_rx),
              static_cast<unsigned long long>(ns.total_wire_sent_bytes()));
  return 0;
}
