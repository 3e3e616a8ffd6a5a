#include "strata/core/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

namespace strata {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "Ok";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kOutOfMemory: return "OutOfMemory";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kDataLoss: return "DataLoss";
    case StatusCode::kUnsupported: return "Unsupported";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

Status Status::with_context(std::string_view context) const& {
  if (ok()) return *this;
  return Status(code_, fmt::format("{}: {}", context, message_), system_errno_);
}

Status Status::with_context(std::string_view context) && {
  if (ok()) return std::move(*this);
  message_ = fmt::format("{}: {}", context, message_);
  return std::move(*this);
}

std::string Status::to_string() const {
  if (ok()) return "Ok";
  return fmt::format("{}: {}", status_code_name(code_), message_);
}

namespace {
StatusCode errno_code(int err) {
  switch (err) {
    case EAGAIN:
    case EINTR:
    case EBUSY: return StatusCode::kUnavailable;
    case ENOENT: return StatusCode::kNotFound;
    case EEXIST: return StatusCode::kAlreadyExists;
    case ENOMEM: return StatusCode::kOutOfMemory;
    case ENOSPC:
    case EDQUOT:
    case EMFILE:
    case ENFILE: return StatusCode::kResourceExhausted;
    case EINVAL: return StatusCode::kInvalidArgument;
    case ETIMEDOUT: return StatusCode::kDeadlineExceeded;
    case ENOSYS:
    case EOPNOTSUPP: return StatusCode::kUnsupported;
    default: return StatusCode::kIoError;
  }
}
}  // namespace

Status ErrnoStatus(int err, std::string_view what) {
  return Status(errno_code(err), fmt::format("{}: {} (errno {})", what, std::strerror(err), err), err);
}

namespace detail {
void check_failed(const char* file, int line, const char* condition, std::string_view message) {
  std::fprintf(stderr, "strata: check failed at %s:%d: %s%s%.*s\n", file, line, condition,
               message.empty() ? "" : ": ", static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

}  // namespace strata
