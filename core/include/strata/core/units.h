#pragma once
// Parsing and printing of byte sizes and counts as users write them:
// "256MiB", "4GiB", "80GB", "1e9", "7B" (billions, for parameter counts).

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

// Bytes: plain integers or scientific ("1e9"), optional suffix
// B, KB/MB/GB/TB (decimal), KiB/MiB/GiB/TiB (binary), K/M/G/T (binary, like
// most tools' "1M" block sizes). Case-insensitive. Negative or fractional
// byte counts are rejected. `what` names the flag or key in the error.
Result<uint64_t> parse_bytes(std::string_view text, std::string_view what = "size");

// Counts such as parameter numbers: "7e9", "7B" / "7b" (billion), "350M",
// "1.3B", "125K", "1T" (decimal multipliers).
Result<uint64_t> parse_count(std::string_view text, std::string_view what = "count");

// "1.50 GB" (decimal) or "1.40 GiB" (binary).
std::string format_bytes(uint64_t bytes, bool binary = false);
// "7.00B", "350.00M"
std::string format_count(uint64_t count);

}  // namespace strata
