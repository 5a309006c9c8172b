// A real slow inter-node link: tools/netns-topology.sh run puts two "nodes" of 2 ranks each in
// network namespaces joined by a shaped veth pair, and launches tests/netns_rank_main there. The
// bytes the veth pair carried during the run must match what the ranks' inter-node
// sub-communicators counted on the wire (plus TCP/IP framing), and the intra-node traffic must not
// appear on it. Skipped, with the reason, where namespaces cannot be made (not root, no
// CAP_NET_ADMIN, no iproute2). The script tears the topology down itself, also on failure.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/multiprocess.h"
#include "tests/test_util.h"

namespace {

using strata::testing::ParseJson;
using strata::testing::RunShell;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(NetnsComm, InterNodeLinkCarriesExactlyTheInterCommunicatorsBytes) {
  const std::string script = STRATA_NETNS_SCRIPT;
  const auto check = RunShell(script + " check 2>&1");
  if (check.exit_code == 77) GTEST_SKIP() << "network namespaces unavailable: " << check.out;
  ASSERT_EQ(check.exit_code, 0) << check.out;

  const std::string dir = strata::testing::UniqueTestDir("netns");
  const std::string name = "snt" + std::to_string(::getpid() % 1000000);
  const auto run = RunShell("timeout 90 " + script + " run --name " + name + " --offloadctl " +
                            STRATA_OFFLOADCTL_PATH + " --json " + dir +
                            "/link.json --timeout-s 60 --mark 'netns_rank_main: mark' "
                            "-- " NETNS_RANK_MAIN " " +
                            dir + " 2>&1");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  // The topology is gone again.
  EXPECT_EQ(RunShell("ip netns list | grep -c '^" + name + "-'").out, "0\n");

  const nlohmann::json link = ParseJson(ReadFile(dir + "/link.json"));
  ASSERT_TRUE(link.is_object());
  uint64_t sent = 0, received = 0, intra = 0;
  for (int r = 0; r < 4; ++r) {
    const nlohmann::json j = ParseJson(ReadFile(dir + "/rank" + std::to_string(r) + ".json"));
    ASSERT_TRUE(j.is_object()) << "rank " << r << "\n" << run.out;
    EXPECT_EQ(j["node"].get<int>(), r / 2);
    intra += j["intra_wire_sent"].get<uint64_t>();
    if (r / 2 != 0) continue;  // node 0's ranks: their sends are the veth's tx in namespace 0
    sent += j["inter_wire_sent"].get<uint64_t>();
    received += j["inter_wire_received"].get<uint64_t>();
  }
  const auto tx = link["tx_bytes"].get<uint64_t>(), rx = link["rx_bytes"].get<uint64_t>();
  std::printf("veth tx %llu rx %llu; inter wire sent %llu received %llu; intra %llu (%s)\n",
              static_cast<unsigned long long>(tx), static_cast<unsigned long long>(rx),
              static_cast<unsigned long long>(sent), static_cast<unsigned long long>(received),
              static_cast<unsigned long long>(intra), link["link"].get<std::string>().c_str());
  ASSERT_GT(sent, 8u << 20);  // 2 ranks x 512 Ki x (4 + 4 + 1) bytes
  EXPECT_EQ(sent, received);  // symmetric operations
  // The payload crossed (at least), plus framing (Ethernet/IP/TCP headers, ACKs, Gloo's message
  // headers) and the setup of the connections (small); the intra-node all-gather (as large as the
  // inter one, 4 MiB in all) did not.
  EXPECT_GE(tx, sent);
  EXPECT_GE(rx, received);
  EXPECT_LE(tx, sent + sent / 20 + (256u << 10));
  EXPECT_LE(rx, received + received / 20 + (256u << 10));
  EXPECT_GT(intra, 4u << 20);
  // The marks (counters sampled when rank 0 reported a phase done, after a barrier): the
  // inter-node phase carried the payload, the intra-node phase (8 MiB over loopback) only its
  // barrier.
  const auto& marks = link["marks"];
  ASSERT_EQ(marks.size(), 2u) << link.dump();
  EXPECT_NE(marks[0]["line"].get<std::string>().find("mark inter"), std::string::npos);
  EXPECT_GE(marks[0]["tx_bytes"].get<uint64_t>(), sent);
  EXPECT_LT(marks[1]["tx_bytes"].get<uint64_t>(), 64u << 10) << marks[1].dump();
  EXPECT_LT(marks[1]["rx_bytes"].get<uint64_t>(), 64u << 10) << marks[1].dump();
}

}  // namespace
