// Shared helpers of the Python bindings: Status -> Python exception, dict building.
// The bindings are the one place where strata errors become exceptions (STYLE.md: no exceptions
// across the C++ API; Python callers expect them). Every StatusError carries the Status's code
// name and message ("InvalidArgument: ...") and becomes strata.StrataError in Python.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include "strata/status.h"

namespace strata::python {

class StatusError : public std::runtime_error {
 public:
  explicit StatusError(const Status& s) : std::runtime_error(s.ToString()), code_(s.code()) {}
  Status::Code code() const { return code_; }

 private:
  Status::Code code_;
};

inline void ThrowIfError(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}

template <typename T>
T ValueOrThrow(Result<T> r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(*r);
}

}  // namespace strata::python
