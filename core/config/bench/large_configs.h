// Large DeepSpeed configs of the shapes that once made the config reader quadratic (issue 12,
// section 5), for config_benchmark and the scaling test. Internal; header-only.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace strata::config {

enum class LargeShape {
  kUnknownTopKeys,          // {"train_batch_size": 8, "k0": 0, "k1": 1, ...}: one warning per key
  kHugeObject,              // {"train_batch_size": 8, "x": {"k0": 0, ...}}: a free-form object
  kArrayOfObjects,          // {"train_batch_size": 8, "x": [{"a": 1, "b": [2]}, ...]}
  kLongKey,                 // {"train_batch_size": 8, "aaa...": 1}: one key near the whole size
  kNearMissZeroKeys,        // zero_optimization keys a few edits from real ones: "did you mean"
  kDuplicatesUnderLongKey,  // {"aaa...": {"d": 0, "d": 1, ...}}: duplicates with long paths
};

inline constexpr LargeShape kLargeShapes[] = {
    LargeShape::kUnknownTopKeys, LargeShape::kHugeObject,       LargeShape::kArrayOfObjects,
    LargeShape::kLongKey,        LargeShape::kNearMissZeroKeys, LargeShape::kDuplicatesUnderLongKey,
};

inline std::string_view LargeShapeName(LargeShape s) {
  switch (s) {
    case LargeShape::kUnknownTopKeys:
      return "unknown_top_keys";
    case LargeShape::kHugeObject:
      return "huge_object";
    case LargeShape::kArrayOfObjects:
      return "array_of_objects";
    case LargeShape::kLongKey:
      return "long_key";
    case LargeShape::kNearMissZeroKeys:
      return "near_miss_zero_keys";
    case LargeShape::kDuplicatesUnderLongKey:
      return "duplicates_under_long_key";
  }
  return "?";
}

// A config of `shape` about `bytes` long (never longer).
inline std::string LargeConfig(LargeShape shape, size_t bytes) {
  std::string s;
  s.reserve(bytes);
  // Members ", <item i>" until the next one would pass the size, then `tail`.
  auto repeat = [&](std::string head, std::string_view tail, auto item) {
    s = std::move(head);
    std::string next;
    for (size_t i = 0;; ++i) {
      next.clear();
      item(next, i);
      if (s.size() + next.size() + tail.size() > bytes) break;
      s += next;
    }
    s += tail;
  };
  auto numbered_key = [](std::string& out, std::string_view prefix, size_t i) {
    out += ", \"";
    out += prefix;
    out += std::to_string(i);
    out += "\": ";
    out += std::to_string(i % 1000);
  };
  const size_t key_bytes = bytes > 64 ? bytes - 64 : 0;
  switch (shape) {
    case LargeShape::kUnknownTopKeys:
      repeat("{\"train_batch_size\": 8", "}",
             [&](std::string& out, size_t i) { numbered_key(out, "k", i); });
      break;
    case LargeShape::kHugeObject:
      repeat("{\"train_batch_size\": 8, \"x\": {\"k\": 0", "}}",
             [&](std::string& out, size_t i) { numbered_key(out, "k", i); });
      break;
    case LargeShape::kArrayOfObjects:
      repeat("{\"train_batch_size\": 8, \"x\": [{}", "]}",
             [](std::string& out, size_t) { out += ", {\"a\": 1, \"b\": [2]}"; });
      break;
    case LargeShape::kLongKey:
      s = "{\"train_batch_size\": 8, \"" + std::string(key_bytes, 'a') + "\": 1}";
      break;
    case LargeShape::kNearMissZeroKeys:
      repeat("{\"train_batch_size\": 8, \"zero_optimization\": {\"stage\": 3", "}}",
             [&](std::string& out, size_t i) { numbered_key(out, "stage3_max_live_paramx", i); });
      break;
    case LargeShape::kDuplicatesUnderLongKey:
      s = "{\"" + std::string(key_bytes / 2, 'a') + "\": {\"d\": 0";
      while (s.size() + 12 <= bytes) s += ", \"d\": 1";
      s += "}}";
      break;
  }
  return s;
}

}  // namespace strata::config
