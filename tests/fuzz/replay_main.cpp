// Runs a fuzz target's entry point over files and folders given on the
// command line (the seed corpus and saved crash reproducers), so the normal
// g++ build and ctest replay every finding as a regression test without
// clang's fuzzer runtime. Exit 0 when every input ran; the target aborts on
// a broken property.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {
constexpr std::uintmax_t kMaxInputBytes = 64u << 20;

bool run_file(const std::filesystem::path& path) {
  std::error_code ec;
  const std::uintmax_t bytes = std::filesystem::file_size(path, ec);
  if (ec || bytes > kMaxInputBytes) {
    std::fprintf(stderr, "replay: skipping '%s' (%s)\n", path.c_str(), ec ? ec.message().c_str() : "larger than 64 MiB");
    return false;
  }
  std::ifstream in(path, std::ios::binary);
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  return true;
}
}  // namespace

int main(int argc, char** argv) {
  size_t ran = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg)) {
      std::vector<std::filesystem::path> files;
      for (const auto& entry : std::filesystem::directory_iterator(arg))
        if (entry.is_regular_file() && entry.path().filename() != ".gitkeep") files.push_back(entry.path());
      std::sort(files.begin(), files.end());
      for (const auto& f : files) ran += run_file(f) ? 1 : 0;
    } else if (std::filesystem::is_regular_file(arg)) {
      ran += run_file(arg) ? 1 : 0;
    } else {
      std::fprintf(stderr, "replay: '%s' is not a file or folder\n", argv[i]);
      return 2;
    }
  }
  std::printf("replay: %zu input(s) ran, every property held\n", ran);
  return ran > 0 ? 0 : 1;
}
