// direct_io_refused (fs_probe.h): whether an O_DIRECT transfer may be
// repeated through the page cache is decided on the errno the Status
// carries, not on its text (strerror's text depends on the locale, and any
// message may mention "Invalid argument").
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <gtest/gtest.h>

#include "nvme_test_util.h"
#include "strata/core/status.h"
#include "strata/nvme/fs_probe.h"

namespace strata::nvme {
namespace {

using testing::disk_scratch_root;
using testing::ScratchDir;

TEST(DirectIoRefused, DecidedOnErrnoNotOnText) {
  EXPECT_TRUE(direct_io_refused(ErrnoStatus(EINVAL, "write '/nvme/a' at offset 0")));
  EXPECT_TRUE(direct_io_refused(ErrnoStatus(EINVAL, "write '/nvme/a'").with_context("checkpoint model file")));
  // strerror(EINVAL) in another locale: still a refusal.
  EXPECT_TRUE(direct_io_refused(
      Status(StatusCode::kInvalidArgument, "write '/nvme/a' at offset 0: Argument non valide (errno 22)", EINVAL)));
  // The words without the errno are not: a user's bad argument, or a path named "Invalid argument".
  EXPECT_FALSE(direct_io_refused(InvalidArgument("write '/nvme/Invalid argument/a': Invalid argument (errno 22)")));
  EXPECT_FALSE(direct_io_refused(ErrnoStatus(EIO, "write '/nvme/Invalid argument/a'")));
  EXPECT_FALSE(direct_io_refused(ErrnoStatus(ENOSPC, "write '/nvme/a'")));
  EXPECT_FALSE(direct_io_refused(Status::Ok()));
}

// A misaligned O_DIRECT write on a real disk: the kernel refuses it with
// EINVAL, the Status says so by errno, and the same write through the page
// cache (O_DIRECT cleared) succeeds: the fallback the checkpoint writer takes.
TEST(DirectIoRefused, MisalignedDirectWriteIsRefusedThenWrittenThroughThePageCache) {
  ScratchDir dir(disk_scratch_root());
  ASSERT_TRUE(dir.ok());
  const std::string path = dir.file("direct.bin");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0644);
  if (fd < 0 && errno == EINVAL) {
    EXPECT_TRUE(direct_io_refused(ErrnoStatus(errno, "open '" + path + "' with O_DIRECT")));
    GTEST_SKIP() << "the file system under " << disk_scratch_root() << " refuses O_DIRECT at open";
  }
  ASSERT_GE(fd, 0) << std::strerror(errno);
  constexpr size_t kBlock = 4096;
  std::unique_ptr<char, decltype(&std::free)> block(static_cast<char*>(std::aligned_alloc(kBlock, 2 * kBlock)),
                                                   &std::free);
  ASSERT_NE(block, nullptr);
  std::memset(block.get(), 0x5a, 2 * kBlock);
  char* misaligned = block.get() + 1;  // address and length off the direct-I/O alignment
  const ssize_t n = ::pwrite(fd, misaligned, kBlock - 1, 0);
  if (n >= 0) {
    ::close(fd);
    GTEST_SKIP() << "the file system under " << disk_scratch_root() << " accepts misaligned O_DIRECT writes";
  }
  const Status st = ErrnoStatus(errno, "write '" + path + "' at offset 0").with_context("checkpoint");
  EXPECT_EQ(st.system_errno(), EINVAL) << st.to_string();
  EXPECT_TRUE(direct_io_refused(st)) << st.to_string();
  const int flags = ::fcntl(fd, F_GETFL);
  ASSERT_GE(flags, 0);
  ASSERT_EQ(::fcntl(fd, F_SETFL, flags & ~O_DIRECT), 0) << std::strerror(errno);
  EXPECT_EQ(::pwrite(fd, misaligned, kBlock - 1, 0), static_cast<ssize_t>(kBlock - 1)) << std::strerror(errno);
  ::close(fd);
}

}  // namespace
}  // namespace strata::nvme
