#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "strata/model/text_data.h"

namespace strata::model {
namespace {

TEST(TextData, ByteTokenizerRoundTrips) {
  const std::string s = "H\xc3\xa9llo\n\x01\xff";
  const auto tok = encode_bytes(s);
  ASSERT_EQ(tok.size(), s.size());
  for (int32_t t : tok) EXPECT_TRUE(t >= 0 && t < kByteVocabSize);
  EXPECT_EQ(tok[1], 0xc3);
  EXPECT_EQ(decode_bytes(tok), s);
}

TEST(TextData, SplitKeepsValidationAtTheEnd) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + i % 26);
  auto d = TextDataset::from_text(text, 8, 0.1).value();
  EXPECT_EQ(d.train().size(), 900u);
  EXPECT_EQ(d.val().size(), 100u);
  EXPECT_EQ(d.val()[0], static_cast<uint8_t>(text[900]));
}

TEST(TextData, UnigramBaselineIsTheSmoothedCrossEntropy) {
  // Train: 90 'a' + 10 'b' (smoothed over 256), val: 'a' 'b' repeated.
  std::string text(90, 'a');
  text += std::string(10, 'b');
  for (int i = 0; i < 50; ++i) text += (i % 2 ? "b" : "a");
  auto d = TextDataset::from_text(text, 4, 50.0 / 150.0).value();
  ASSERT_EQ(d.val().size(), 50u);
  const double total = 100 + 256;
  const double want = -0.5 * (std::log(91 / total) + std::log(11 / total));
  EXPECT_NEAR(d.unigram_baseline(), want, 1e-12);
}

TEST(TextData, LoaderIsSeededAndTargetsAreShifted) {
  std::string text;
  for (int i = 0; i < 5000; ++i) text += static_cast<char>(i * 31 % 251);
  auto d = TextDataset::from_text(text, 16).value();
  BatchLoader a(d.train(), 4, 16, 42), b(d.train(), 4, 16, 42), c(d.train(), 4, 16, 43);
  std::vector<int32_t> ia(64), ta(64), ib(64), tb(64), ic(64), tc(64);
  for (int step = 0; step < 3; ++step) {
    a.next(ia, ta);
    b.next(ib, tb);
    c.next(ic, tc);
    EXPECT_EQ(ia, ib);
    EXPECT_EQ(ta, tb);
    EXPECT_NE(ia, ic);
    for (int r = 0; r < 4; ++r)
      for (int t = 0; t + 1 < 16; ++t) EXPECT_EQ(ta[r * 16 + t], ia[r * 16 + t + 1]);
  }
  const size_t n = BatchLoader::eval_batches(d.val(), 4, 16);
  ASSERT_GT(n, 0u);
  BatchLoader::eval_batch(d.val(), 4, 16, 0, ia, ta);
  EXPECT_EQ(ia[0], d.val()[0]);
  EXPECT_EQ(ta[63], d.val()[64]);
}

TEST(TextData, ErrorsNameTheFile) {
  auto missing = TextDataset::load("/nonexistent/strata-corpus.txt", 8);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/strata-corpus.txt"), std::string::npos);
  auto short_text = TextDataset::from_text("abc", 8, 0.1, "short.txt");
  ASSERT_FALSE(short_text.ok());
  EXPECT_NE(short_text.status().message().find("short.txt"), std::string::npos);
  EXPECT_NE(short_text.status().message().find("--seq"), std::string::npos);
}

TEST(TextData, ShippedCorpusIsThere) {
  const std::string path = default_corpus_path();
  ASSERT_FALSE(path.empty());
  auto d = TextDataset::load(path, 64).value();
  EXPECT_GT(d.train().size(), 1000000u);
  EXPECT_GT(d.unigram_baseline(), 2.5);  // English bytes: about 4.4-4.6 bits
  EXPECT_LT(d.unigram_baseline(), 3.6);
}

}  // namespace
}  // namespace strata::model
