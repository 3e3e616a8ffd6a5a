#pragma once
// Range guards every number flag of the CLI gets (issue 16): CLI11 reads an
// int64 flag with strtoll, which saturates (--steps 99999999999999999999
// became 9223372036854775807), and an unsigned one with strtoull, which wraps
// (--seed -1 became 2^64 - 1); and a floating-point flag takes "nan" and
// "inf", and a NaN passes CLI::Range (--clip nan reached the engine).
// Installed once over the whole command tree in main(), so a flag added later
// is guarded without doing anything.

#include <CLI/CLI.hpp>

namespace strata::cli {

// Adds to every INT/UINT option of `app` and its subcommands a check that
// the text is a whole number inside the 64-bit range of its sign, and that an
// unsigned flag is not negative; to every FLOAT option a check that it is
// finite (not NaN, not infinite). The error names the flag and the range.
void guard_number_flags(CLI::App& app);

// What CLI11 prints when a flag's text is a whole number in the 64-bit range
// but does not fit the flag's narrower type ("Could not convert: --ranks =
// 2147483648"), rewritten to name the flag and the type's range; `failed` is
// the (sub)command whose parse failed. Returns CLI11's own message for every
// other error.
std::string parse_failure_message(const CLI::App* failed, const CLI::Error& error);

}  // namespace strata::cli
