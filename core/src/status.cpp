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
  return Status(code_, fmt::format("{}: {}", context, message_));
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

Status ErrnoStatus(int err, std::string_view what) {
  std::string msg = fmt::format("{}: {} (errno {})", what, std::strerror(err), err);
  switch (err) {
    case EAGAIN:
    case EINTR:
    case EBUSY: return Unavailable(std::move(msg));
    case ENOENT: return NotFound(std::move(msg));
    case EEXIST: return AlreadyExists(std::move(msg));
    case ENOMEM: return OutOfMemory(std::move(msg));
    case ENOSPC:
    case EDQUOT:
    case EMFILE:
    case ENFILE: return ResourceExhausted(std::move(msg));
    case EINVAL: return InvalidArgument(std::move(msg));
    case ETIMEDOUT: return DeadlineExceeded(std::move(msg));
    case ENOSYS:
    case EOPNOTSUPP: return Unsupported(std::move(msg));
    default: return IoError(std::move(msg));
  }
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
