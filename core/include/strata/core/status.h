#pragma once
// Errors are values. A Status carries a code, a message with the context a
// user needs (path, offset, key, rank) and whether retrying can help.
// Result<T> is a value or a Status. Bugs are STRATA_CHECKs, on in release.

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace strata {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // bad input from a user: config, CLI flag, file
  kNotFound,            // a file, key, device or tensor that does not exist
  kAlreadyExists,
  kOutOfMemory,         // a tier ran out of capacity
  kResourceExhausted,   // other bounded resources: queue slots, disk space
  kFailedPrecondition,  // the system is not in a state to do this
  kUnavailable,         // transient: retrying may succeed
  kDeadlineExceeded,    // a timeout (watchdog, I/O)
  kIoError,             // a syscall or device failed
  kDataLoss,            // corruption detected: checksum mismatch, torn write
  kUnsupported,         // this build or machine cannot do it
  kInternal,            // a bug in Strata
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  // A failed system call: `system_errno` is its errno (ErrnoStatus builds these).
  Status(StatusCode code, std::string message, int system_errno)
      : code_(code), message_(std::move(message)), system_errno_(system_errno) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // Transient failures that a caller may retry (EAGAIN-like, timeouts).
  bool retryable() const {
    return code_ == StatusCode::kUnavailable || code_ == StatusCode::kDeadlineExceeded;
  }
  bool is_data_loss() const { return code_ == StatusCode::kDataLoss; }
  // The errno of the system call this status reports (ErrnoStatus), kept
  // through with_context; 0 when it did not come from one. Code that reacts
  // to a particular errno (EINVAL from an O_DIRECT write) decides on this,
  // never on the message text.
  int system_errno() const { return system_errno_; }

  // Prepends context: "while loading ckpt: <message>".
  Status with_context(std::string_view context) const&;
  Status with_context(std::string_view context) &&;

  // "IoError: <message>"
  std::string to_string() const;

  // Marks a status as deliberately ignored.
  void ignore() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int system_errno_ = 0;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status OutOfMemory(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
inline Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
inline Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
// An errno mapped to a Status; the message names the operation and the errno
// text, and system_errno() returns `err`.
Status ErrnoStatus(int err, std::string_view what);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : data_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : data_(std::move(status)) {  // NOLINT
    check_not_ok();
  }

  bool ok() const { return std::holds_alternative<T>(data_); }
  const Status& status() const& {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(data_);
  }
  Status status() && { return ok() ? Status() : std::get<Status>(std::move(data_)); }

  T& value() & { check_ok(); return std::get<T>(data_); }
  const T& value() const& { check_ok(); return std::get<T>(data_); }
  T&& value() && { check_ok(); return std::get<T>(std::move(data_)); }
  T value_or(T fallback) const& { return ok() ? std::get<T>(data_) : std::move(fallback); }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void check_ok() const;
  void check_not_ok() const;
  std::variant<T, Status> data_;
};

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const char* condition, std::string_view message);
}  // namespace detail

template <typename T>
void Result<T>::check_ok() const {
  if (!ok()) detail::check_failed(__FILE__, __LINE__, "Result::ok()", std::get<Status>(data_).to_string());
}
template <typename T>
void Result<T>::check_not_ok() const {
  if (std::get<Status>(data_).ok())
    detail::check_failed(__FILE__, __LINE__, "!status.ok()", "Result<T> constructed from an ok Status");
}

}  // namespace strata

// Always-on invariant check (release builds too). For bugs, not for input.
#define STRATA_CHECK(cond, ...)                                                           \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::strata::detail::check_failed(__FILE__, __LINE__, #cond, ::std::string_view{__VA_ARGS__}); \
  } while (0)

#define STRATA_CONCAT_INNER(a, b) a##b
#define STRATA_CONCAT(a, b) STRATA_CONCAT_INNER(a, b)

#define STRATA_RETURN_IF_ERROR(expr)              \
  do {                                            \
    ::strata::Status _strata_st = (expr);         \
    if (!_strata_st.ok()) return _strata_st;      \
  } while (0)

#define STRATA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()

#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL(STRATA_CONCAT(_strata_result_, __LINE__), lhs, expr)
