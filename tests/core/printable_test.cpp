#include "strata/core/printable.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(Printable, ControlBytesBecomeHexEscapes) {
  EXPECT_EQ(printable(std::string_view("a\x1b[31mb\x07\nc\0d", 12)), "a\\x1b[31mb\\x07\\x0ac\\x00d");
  EXPECT_EQ(printable("plain text"), "plain text");
  EXPECT_EQ(printable("0123456789", 4), "0123...(cut, 10 bytes in all)");
}

TEST(Printable, AMessageKeepsItsLineBreaksAndLosesEverythingElse) {
  EXPECT_EQ(printable_message("bad --device 'c\x1bpu'\n    hint: use cpu\r\x7f"),
            "bad --device 'c\\x1bpu'\n    hint: use cpu\\x0d\\x7f");
  EXPECT_EQ(printable_message("tab\there"), "tab\\x09here");
}

TEST(Printable, AsciiOnlyTextEscapesEveryByteAbove0x7fToo) {
  // A checkpoint tag read from `latest`: a byte that is not ASCII (not even UTF-8 here) is shown, never passed on.
  EXPECT_EQ(printable_ascii("global_step1\xff\xc3\xa9\x1b"), "global_step1\\xff\\xc3\\xa9\\x1b");
  EXPECT_EQ(printable("caf\xc3\xa9"), "caf\xc3\xa9");  // printable() keeps UTF-8 text readable
  EXPECT_EQ(printable_ascii("0123456789", 4), "0123...(cut, 10 bytes in all)");
}

}  // namespace
}  // namespace strata
