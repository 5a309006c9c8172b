// Status and Result<T>: how every fallible strata call reports an operating error.
//
// No exceptions cross the strata API. A call returns `Status` (success or a code plus a
// message) or `Result<T>` (a value or a non-OK Status). An OK Status holds a null pointer, so
// creating, copying, moving and testing it costs nothing; only errors allocate.
//
// Codes:
//   kInvalidArgument   the caller passed something wrong (a config value, a size, a path).
//   kNotFound          a named thing (file, block, key) does not exist.
//   kIOError           the operating system failed an IO; the message carries errno and file.
//   kCorruption        data read back does not verify (checksum, short extent, bad magic).
//   kResourceExhausted a budget (bytes, slots, queue depth) would be exceeded and nothing
//                      in flight can free it.
//   kUnavailable       a facility is missing on this machine (no GPU, io_uring refused) or a
//                      peer went away; the caller may fall back or retry elsewhere.
//   kDeadlineExceeded  a wait ran past its deadline.
//   kFailedPrecondition the object is in the wrong state for the call.
//   kAborted           the operation was cancelled (a communicator aborted, a shutdown).
//   kInternal          a bug in strata; please report it.
//
// Thread safety: a Status or Result is a value; distinct objects may be used from distinct
// threads without synchronization, a shared one needs external synchronization.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace strata {

class [[nodiscard]] Status {
 public:
  enum class Code : uint8_t {
    kOk = 0,
    kInvalidArgument,
    kNotFound,
    kIOError,
    kCorruption,
    kResourceExhausted,
    kUnavailable,
    kDeadlineExceeded,
    kFailedPrecondition,
    kAborted,
    kInternal,
  };

  Status() noexcept = default;
  Status(Code code, std::string_view msg)
      : rep_(code == Code::kOk ? nullptr : std::make_unique<Rep>(Rep{code, std::string(msg)})) {}

  Status(const Status& other) : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}
  Status& operator=(const Status& other) {
    if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  static Status OK() noexcept { return Status(); }
  static Status InvalidArgument(std::string_view m) { return {Code::kInvalidArgument, m}; }
  static Status NotFound(std::string_view m) { return {Code::kNotFound, m}; }
  static Status IOError(std::string_view m) { return {Code::kIOError, m}; }
  static Status Corruption(std::string_view m) { return {Code::kCorruption, m}; }
  static Status ResourceExhausted(std::string_view m) { return {Code::kResourceExhausted, m}; }
  static Status Unavailable(std::string_view m) { return {Code::kUnavailable, m}; }
  static Status DeadlineExceeded(std::string_view m) { return {Code::kDeadlineExceeded, m}; }
  static Status FailedPrecondition(std::string_view m) { return {Code::kFailedPrecondition, m}; }
  static Status Aborted(std::string_view m) { return {Code::kAborted, m}; }
  static Status Internal(std::string_view m) { return {Code::kInternal, m}; }
  // An IOError whose message names the operation, the file and errno (with strerror text).
  static Status FromErrno(int err, std::string_view op, std::string_view file = {});

  bool ok() const noexcept { return rep_ == nullptr; }
  Code code() const noexcept { return rep_ ? rep_->code : Code::kOk; }
  // The message without the code name; empty for OK.
  std::string_view message() const noexcept {
    return rep_ ? std::string_view(rep_->msg) : std::string_view();
  }
  bool IsInvalidArgument() const noexcept { return code() == Code::kInvalidArgument; }
  bool IsNotFound() const noexcept { return code() == Code::kNotFound; }
  bool IsIOError() const noexcept { return code() == Code::kIOError; }
  bool IsCorruption() const noexcept { return code() == Code::kCorruption; }
  bool IsResourceExhausted() const noexcept { return code() == Code::kResourceExhausted; }
  bool IsUnavailable() const noexcept { return code() == Code::kUnavailable; }
  bool IsDeadlineExceeded() const noexcept { return code() == Code::kDeadlineExceeded; }

  // Returns a copy whose message is "<context>: <message>"; OK stays OK.
  Status WithContext(std::string_view context) const;

  // "OK" or "<CodeName>: <message>".
  std::string ToString() const;

  // Marks a status as deliberately ignored (best-effort cleanup paths).
  void IgnoreError() const noexcept {}

  friend bool operator==(const Status& a, const Status& b) noexcept {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    Code code;
    std::string msg;
  };
  std::unique_ptr<Rep> rep_;
};

std::string_view CodeName(Status::Code code) noexcept;

// Result<T>: a T or a non-OK Status. REQUIRES: never constructed from an OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result constructed from an OK Status");
  }

  bool ok() const noexcept { return std::holds_alternative<T>(v_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }
  // REQUIRES: ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

// ---------------------------------------------------------------------------
// Inline definitions (header-only so every layer can use Status without a link dependency).
// ---------------------------------------------------------------------------
inline std::string_view CodeName(Status::Code code) noexcept {
  switch (code) {
    case Status::Code::kOk: return "OK";
    case Status::Code::kInvalidArgument: return "InvalidArgument";
    case Status::Code::kNotFound: return "NotFound";
    case Status::Code::kIOError: return "IOError";
    case Status::Code::kCorruption: return "Corruption";
    case Status::Code::kResourceExhausted: return "ResourceExhausted";
    case Status::Code::kUnavailable: return "Unavailable";
    case Status::Code::kDeadlineExceeded: return "DeadlineExceeded";
    case Status::Code::kFailedPrecondition: return "FailedPrecondition";
    case Status::Code::kAborted: return "Aborted";
    case Status::Code::kInternal: return "Internal";
  }
  return "Unknown";
}

inline std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(CodeName(rep_->code));
  s += ": ";
  s += rep_->msg;
  return s;
}

inline Status Status::WithContext(std::string_view context) const {
  if (ok()) return Status();
  std::string m(context);
  m += ": ";
  m += rep_->msg;
  return Status(rep_->code, m);
}

}  // namespace strata

// errno text lives in a function of its own so <cstring> stays out of every includer's way.
#include <cstring>
namespace strata {
inline Status Status::FromErrno(int err, std::string_view op, std::string_view file) {
  std::string m(op);
  if (!file.empty()) {
    m += " '";
    m += file;
    m += "'";
  }
  m += ": errno ";
  m += std::to_string(err);
  m += " (";
  char buf[128];
  // GNU strerror_r returns the message pointer (which may not be buf).
  const char* text = strerror_r(err, buf, sizeof(buf));
  m += text;
  m += ")";
  return Status(Code::kIOError, m);
}
}  // namespace strata

// Helper macros. STRATA_RETURN_IF_ERROR(expr): returns the Status of `expr` if not OK.
// STRATA_ASSIGN_OR_RETURN(lhs, expr): evaluates a Result<T>, returns its Status on error,
// otherwise assigns (or declares, e.g. `auto x`) lhs from the value.
#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::strata::Status strata_status_ = (expr);        \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_result_, __LINE__), lhs, expr)
