// Issue 12, section 5: the config reader takes time linear in its input, and what it reports
// about a huge config stays bounded.
//
// No test here asserts a wall time. Scaling compares CheckDeepSpeedConfig with plain
// nlohmann::json::parse of the same text, both timed in this run, at sizes from 64 KiB to the
// 16 MiB a config file may have: within kMaxRatio at every size means linear (a quadratic step
// was 50x to 300x slower already at a few hundred KiB, and fails at the first sizes instead of
// running for minutes).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ostream>
#include <string>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/config/bench/large_configs.h"
#include "strata/config.h"
#include "tests/config_test_util.h"

namespace strata {
namespace config {
// The shape's name in test output, not its bytes.
void PrintTo(LargeShape s, std::ostream* os) { *os << LargeShapeName(s); }
}  // namespace config

namespace {

using config::LargeConfig;
using config::LargeShape;
using config::LargeShapeName;
using Kind = ConfigDiagnostic::Kind;
using testing::FindDiag;

// How much slower than nlohmann::json::parse the whole check may be. Measured: 1x to 6x at
// 16 MiB (the check parses, reads every key, and writes diagnostics and the normalized JSON).
constexpr double kMaxRatio = 20;
// Reference times below this count as this much: the check's fixed cost (the effective config,
// "did you mean" for up to 100 unknown keys: a few ms) must not fail the smallest inputs.
constexpr double kMinReferenceSeconds = 0.005;

template <class F>
double Seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class ConfigScale : public ::testing::TestWithParam<LargeShape> {};

TEST_P(ConfigScale, CheckTimeGrowsAsJsonParseTime) {
  for (size_t kib = 64; kib <= 16 * 1024; kib *= 4) {
    const std::string text = LargeConfig(GetParam(), kib << 10);
    ASSERT_LE(text.size(), kib << 10);
    ASSERT_GE(text.size(), (kib << 10) * 9 / 10);
    // The better of up to three tries each: a loaded machine delays one run, not every one.
    double check_s = 1e9, parse_s = 1e9;
    size_t findings = 0;
    for (int attempt = 0; attempt < 3; ++attempt) {
      check_s = std::min(check_s, Seconds([&] {
                           const ConfigCheck c = CheckDeepSpeedConfig(text);
                           findings = c.errors.size() + c.warnings.size();
                         }));
      parse_s = std::min(parse_s, Seconds([&] {
                           const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
                           EXPECT_FALSE(j.is_discarded());
                         }));
      if (check_s <= kMaxRatio * std::max(parse_s, kMinReferenceSeconds)) break;
    }
    std::printf("%-26s %6zu KiB: check %8.4f s (%7.1f MB/s), json::parse %8.4f s, ratio %.1f\n",
                std::string(LargeShapeName(GetParam())).c_str(), kib, check_s,
                static_cast<double>(text.size()) / 1e6 / check_s, parse_s, check_s / parse_s);
    ASSERT_LE(check_s, kMaxRatio * std::max(parse_s, kMinReferenceSeconds))
        << LargeShapeName(GetParam()) << " at " << kib << " KiB";
    // Bounded reports: at most 1,000 unknown keys and 20 duplicates named, plus one count each.
    EXPECT_LE(findings, 1002u);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ConfigScale, ::testing::ValuesIn(config::kLargeShapes),
                         [](const ::testing::TestParamInfo<LargeShape>& info) {
                           return std::string(LargeShapeName(info.param));
                         });

// What a huge config reports stays bounded: the first 1,000 unknown keys are warned about, the
// rest counted in one warning; every key is still kept.
TEST(ConfigLimits, UnknownKeysPastTheLimitAreCountedNotListed) {
  std::string text = R"({"train_batch_size": 8)";
  for (int i = 0; i < 1500; ++i) text += ", \"k" + std::to_string(i) + "\": 1";
  text += "}";
  const ConfigCheck c = CheckDeepSpeedConfig(text);
  ASSERT_TRUE(c.ok()) << testing::Dump(c.errors);
  ASSERT_EQ(c.warnings.size(), 1001u);
  EXPECT_EQ(c.warnings[999].path, "k999");
  EXPECT_EQ(c.warnings[1000].kind, Kind::kUnknownKey);
  EXPECT_NE(c.warnings[1000].message.find("500 more unknown keys"), std::string::npos)
      << c.warnings[1000].message;
  EXPECT_EQ(c.parsed->config.unacted_keys.size(), 1500u);
}

TEST(ConfigLimits, DuplicatesPastTwentyAreCounted) {
  std::string text = R"({"train_batch_size": 8, "x": {"d": 0)";
  for (int i = 0; i < 30; ++i) text += ", \"d\": 1";
  text += "}}";
  const ConfigCheck c = CheckDeepSpeedConfig(text);
  ASSERT_EQ(c.errors.size(), 21u) << testing::Dump(c.errors);
  EXPECT_EQ(c.errors[0].path, "x.d");
  EXPECT_EQ(c.errors[0].line, 1);
  EXPECT_NE(c.errors[20].message.find("10 more duplicate keys"), std::string::npos)
      << c.errors[20].message;
}

// A duplicate found once the object is large enough to be indexed, and earlier duplicates that
// the index then meets, are each reported once.
TEST(ConfigLimits, DuplicatesInALargeObjectAreEachNamedOnce) {
  std::string text = R"({"x": {"a": 0, "a": 1)";
  for (int i = 0; i < 40; ++i) text += ", \"k" + std::to_string(i) + "\": 1";
  text += R"(, "k7": 2}, "train_batch_size": 8})";
  const ConfigCheck c = CheckDeepSpeedConfig(text);
  ASSERT_EQ(c.errors.size(), 2u) << testing::Dump(c.errors);
  EXPECT_EQ(c.errors[0].path, "x.a");
  EXPECT_EQ(c.errors[1].path, "x.k7");
}

TEST(ConfigLimits, KeysLongerThan64BytesGetNoSuggestion) {
  const std::string near = "stage3_max_live_parameters" + std::string(39, 's');  // 65 bytes
  const ConfigCheck c = CheckDeepSpeedConfig(
      R"({"train_batch_size": 8, "zero_optimization": {"stage3_max_live_parameter": 1, ")" + near +
      R"(": 1}})");
  const ConfigDiagnostic* typo =
      FindDiag(c.warnings, Kind::kUnknownKey, "zero_optimization.stage3_max_live_parameter");
  ASSERT_NE(typo, nullptr);
  EXPECT_NE(typo->message.find("did you mean 'stage3_max_live_parameters'"), std::string::npos)
      << typo->message;
  const ConfigDiagnostic* long_key =
      FindDiag(c.warnings, Kind::kUnknownKey, "zero_optimization." + near);
  ASSERT_NE(long_key, nullptr);
  EXPECT_EQ(long_key->message.find("did you mean"), std::string::npos) << long_key->message;
}

// Keys are located as the parser decodes them: an escaped key is found at its line.
TEST(ConfigLimits, EscapedKeysAreLocated) {
  const ConfigCheck c = CheckDeepSpeedConfig("{\"train_batch_size\": 8,\n \"a\\u0062c\": 1}");
  const ConfigDiagnostic* d = FindDiag(c.warnings, Kind::kUnknownKey, "abc");
  ASSERT_NE(d, nullptr) << testing::Dump(c.warnings);
  EXPECT_EQ(d->line, 2);
  EXPECT_EQ(d->column, 2);
}

}  // namespace
}  // namespace strata
