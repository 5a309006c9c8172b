// MemberIndex: a hash index of one JSON object's members by key. nlohmann's ordered_json keeps
// an object as a vector of members and finds a key by scanning it, which makes reading a large
// object quadratic. Internal to strata_config. Not thread-safe (one reader at a time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::config {

class MemberIndex {
 public:
  using Object = nlohmann::ordered_json::object_t;

  // Indexes the members of `obj` from indexed() on. A member whose key an earlier member has is
  // not indexed: on_duplicate(its position, the earlier one's) is called instead.
  // REQUIRES: `obj` is the object indexed so far, grown only at its end.
  template <class OnDuplicate>
  void Update(const Object& obj, OnDuplicate&& on_duplicate) {
    for (; indexed_ < obj.size(); ++indexed_) {
      const std::string_view key = KeyAt(obj, indexed_);
      if (2 * (count_ + 1) > slots_.size()) Grow();
      const uint64_t h = Hash(key);
      size_t i = h & (slots_.size() - 1);
      for (; slots_[i].pos != kEmpty; i = (i + 1) & (slots_.size() - 1)) {
        if (slots_[i].hash == h && KeyAt(obj, slots_[i].pos) == key) break;
      }
      if (slots_[i].pos != kEmpty) {
        on_duplicate(indexed_, slots_[i].pos);
        continue;
      }
      slots_[i] = Slot{indexed_, h};
      ++count_;
    }
  }
  void Update(const Object& obj) {
    Update(obj, [](size_t, size_t) {});
  }

  // The position of the first member of `obj` with `key` among those indexed, or nullopt.
  std::optional<size_t> Find(const Object& obj, std::string_view key) const {
    if (slots_.empty()) return std::nullopt;
    const uint64_t h = Hash(key);
    for (size_t i = h & (slots_.size() - 1); slots_[i].pos != kEmpty;
         i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].hash == h && KeyAt(obj, slots_[i].pos) == key) return slots_[i].pos;
    }
    return std::nullopt;
  }

  size_t indexed() const { return indexed_; }

 private:
  static constexpr size_t kEmpty = SIZE_MAX;
  struct Slot {
    size_t pos = kEmpty;
    uint64_t hash = 0;
  };

  static std::string_view KeyAt(const Object& obj, size_t pos) { return obj.begin()[pos].first; }
  static uint64_t Hash(std::string_view key) { return std::hash<std::string_view>{}(key); }

  // Doubles the table (at least 16 slots), keeping it at most half full.
  void Grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.empty() ? 16 : 2 * old.size(), Slot{});
    for (const Slot& s : old) {
      if (s.pos == kEmpty) continue;
      size_t i = s.hash & (slots_.size() - 1);
      while (slots_[i].pos != kEmpty) i = (i + 1) & (slots_.size() - 1);
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  size_t count_ = 0;    // occupied slots
  size_t indexed_ = 0;  // members of the object seen by Update
};

}  // namespace strata::config
