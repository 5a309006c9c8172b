// Robustness: mutated published configs (bytes deleted, inserted, replaced; fixed seeds) never
// make the parser throw or crash, every finding is printable as JSON, and a clean result
// re-parses from its effective config.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "strata/config.h"

namespace strata {
namespace {

std::string ReadFixture(const std::string& name) {
  const char* env = std::getenv("STRATA_SOURCE_DIR");
  std::string dir = env != nullptr ? env : STRATA_SOURCE_DIR_DEFAULT;
  std::ifstream in(dir + "/tests/data/ds_configs/" + name);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Mutate(std::string s, std::mt19937_64& rng) {
  // Characters that matter to the grammar, plus arbitrary bytes.
  static const char kSpecial[] = "{}[],:\"\\/*#-+.eE0123456789 \n";
  int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && !s.empty(); ++e) {
    size_t at = rng() % s.size();
    char c = (rng() % 3 == 0) ? static_cast<char>(rng() % 256)
                              : kSpecial[rng() % (sizeof(kSpecial) - 1)];
    switch (rng() % 3) {
      case 0:
        s.erase(at, 1 + rng() % 3);
        break;
      case 1:
        s.insert(at, 1, c);
        break;
      default:
        s[at] = c;
        break;
    }
  }
  return s;
}

constexpr int kIterations = 3000;

class MutatedConfigs : public ::testing::TestWithParam<const char*> {};

TEST_P(MutatedConfigs, NeverThrowAndReportPrintably) {
  const std::string original = ReadFixture(GetParam());
  ASSERT_FALSE(original.empty());
  const uint64_t seed = std::hash<std::string>{}(GetParam());
  std::mt19937_64 rng(seed);
  ParseOptions o;
  o.world_size = 4;
  int valid = 0;
  for (int i = 0; i < kIterations; ++i) {
    std::string text = Mutate(original, rng);
    ConfigCheck c;
    ASSERT_NO_THROW(c = CheckDeepSpeedConfig(text, o)) << "seed " << seed << " iteration " << i;
    for (const ConfigDiagnostic& d : c.errors) {
      ASSERT_FALSE(d.message.empty());
      ASSERT_NO_THROW(nlohmann::json(d.ToString()).dump())
          << "not UTF-8: " << d.ToString() << " (seed " << seed << " iteration " << i << ")";
    }
    EXPECT_EQ(c.ok(), c.parsed.has_value());
    if (!c.ok()) continue;
    ++valid;
    std::string effective = EffectiveConfigJson(c.parsed->config);
    ConfigCheck again = CheckDeepSpeedConfig(effective, o);
    ASSERT_TRUE(again.ok()) << "seed " << seed << " iteration " << i << "\n" << text;
    EXPECT_EQ(EffectiveConfigJson(again.parsed->config), effective);
  }
  // Some mutations (in whitespace, in numbers) keep the config valid: both paths are exercised.
  EXPECT_GT(valid, 0);
  EXPECT_LT(valid, kIterations);
}

INSTANTIATE_TEST_SUITE_P(Published, MutatedConfigs,
                         ::testing::Values("hf_ds_config_zero2.json", "hf_ds_config_zero3.json",
                                           "llamafactory_ds_z3_offload_config.json",
                                           "dse_ds_zero_stage_infinity_config.json",
                                           "accelerate_docs_ds_config_auto.json",
                                           "hf_docs_zero3_nvme.json"));

}  // namespace
}  // namespace strata
