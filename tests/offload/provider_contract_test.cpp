// The provider contract of strata/core/layered_model.h as the GPT executor
// honours it on a cpu-device stream: the model's stream waits for each
// layer's ready Completion (filled later from another thread), a failed
// ready Completion fails the pass with its Status, kEval hands out no
// gradients, bf16/fp16 gradient buffers are accumulated into, the tied
// embedding is acquired twice in backward, and release's `done` completes
// only after the stream work that used the layer.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <thread>

#include <fmt/format.h>

#include "strata/core/completion.h"
#include "strata/core/device_registry.h"
#include "strata/core/dtype.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/offload/resident_provider.h"

namespace strata::offload {
namespace {

using model::GptConfig;
using model::GptExecutor;
using model::GptModel;

GptConfig micro_config() {
  GptConfig c;
  c.preset = "micro";
  c.vocab_size = 256;
  c.max_seq_len = 8;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

struct Rig {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  static Rig make() {
    Rig r;
    r.device = make_device("cpu").value();
    r.stream = r.device->create_stream().value();
    return r;
  }
};

void make_batch(std::vector<int32_t>& tok, std::vector<int32_t>& tgt, size_t n) {
  tok.resize(n);
  tgt.resize(n);
  for (size_t i = 0; i < n; ++i) {
    tok[i] = static_cast<int32_t>((i * 37 + 11) % 256);
    tgt[i] = static_cast<int32_t>((i * 53 + 5) % 256);
  }
}

// A provider that serves a model's layers from its own host copies, with
// knobs for the contract's options. Its "fetch" of a layer happens on
// another thread: each acquire hands out a fresh buffer that is garbage
// (NaN) until a fetch thread copies the real values in and completes
// `ready`, so a model that read it before waiting would compute NaN. (A
// fresh buffer per acquire, because a layer acquired again may still be in
// use by enqueued work of its previous acquire.)
class LateProvider final : public ParameterProvider {
 public:
  LateProvider(const GptModel& model, DType grad_dtype) : model_(model), grad_dtype_(grad_dtype) {
    for (size_t i = 0; i < model.layers().size(); ++i) {
      const LayerSpec& spec = model.layers()[i];
      Layer l;
      l.source.resize(spec.param_bytes);
      EXPECT_TRUE(model.init_layer(i, l.source).ok());
      l.grads.assign(spec.param_count * dtype_size(grad_dtype), std::byte{0});
      layers_.push_back(std::move(l));
    }
  }
  ~LateProvider() override {
    for (auto& t : fetchers_) t.join();
  }

  std::chrono::milliseconds delay{0};
  Status fail_with;            // not ok: every fetch fails with this
  size_t fail_layer = SIZE_MAX;  // only this layer fails (SIZE_MAX: all)
  std::vector<std::string> log;
  std::vector<Completion> done;  // every release's `done`, in order

  Result<LayerMemory> acquire(size_t layer, Pass pass) override {
    log.push_back(fmt::format("acquire {} {}", layer, pass_name(pass)));
    Layer& l = layers_[layer];
    // Poison what is served; the fetch thread writes the real bytes.
    served_.emplace_back(l.source.size(), std::byte{0xFF});  // 0xFFFFFFFF is a NaN in fp32
    std::vector<std::byte>& served = served_.back();
    CompletionSource source(fmt::format("fetch of layer {}", layer));
    LayerMemory mem;
    mem.params = served.data();
    mem.ready = source.completion();
    if (pass == Pass::kBackward) {
      mem.grads = l.grads.data();
      mem.grad_dtype = grad_dtype_;
    }
    const bool fail = !fail_with.ok() && (fail_layer == SIZE_MAX || fail_layer == layer);
    fetchers_.emplace_back([this, &l, &served, fail, src = std::move(source)]() mutable {
      std::this_thread::sleep_for(delay);
      if (fail) {
        src.complete(fail_with);
        return;
      }
      std::memcpy(served.data(), l.source.data(), l.source.size());
      src.complete(Status::Ok());
    });
    return mem;
  }
  Status release(size_t layer, Pass pass, const Completion& d) override {
    log.push_back(fmt::format("release {} {}", layer, pass_name(pass)));
    done.push_back(d);
    return Status::Ok();
  }
  Status wait_all() {
    for (auto& t : fetchers_) t.join();
    fetchers_.clear();
    for (const Completion& d : done) STRATA_RETURN_IF_ERROR(d.wait());
    return Status::Ok();
  }
  // Gradient of layer i widened to fp32.
  std::vector<float> grads(size_t i) const {
    const size_t n = model_.layers()[i].param_count;
    std::vector<float> out(n);
    const std::byte* g = layers_[i].grads.data();
    for (size_t k = 0; k < n; ++k) {
      if (grad_dtype_ == DType::kF32) {
        std::memcpy(&out[k], g + 4 * k, 4);
      } else {
        uint16_t b;
        std::memcpy(&b, g + 2 * k, 2);
        out[k] = grad_dtype_ == DType::kBF16 ? bf16_bits_to_fp32(b) : fp16_bits_to_fp32(b);
      }
    }
    return out;
  }

 private:
  struct Layer {
    std::vector<std::byte> source, grads;
  };
  const GptModel& model_;
  DType grad_dtype_;
  std::vector<Layer> layers_;
  std::deque<std::vector<std::byte>> served_;  // stable addresses, kept to the end
  std::vector<std::thread> fetchers_;
};

TEST(ProviderContract, StreamWaitsForReadyCompletionFromAnotherThread) {
  auto model = GptModel::create(micro_config(), 7).value();
  std::vector<int32_t> tok, tgt;
  make_batch(tok, tgt, 2 * 8);
  MemoryStats stats;
  auto resident = ResidentProvider::create(*model, stats).value();
  Rig a = Rig::make();
  auto ea = GptExecutor::create(*model, *a.device, *a.stream, 2, 8).value();
  const float want = ea->forward(tok, tgt, *resident).value();
  ASSERT_TRUE(ea->backward(1.0f, *resident).ok());
  ASSERT_TRUE(resident->wait_gradients().ok());

  LateProvider late(*model, DType::kF32);
  late.delay = std::chrono::milliseconds(20);
  Rig b = Rig::make();
  auto eb = GptExecutor::create(*model, *b.device, *b.stream, 2, 8).value();
  const float got = eb->forward(tok, tgt, late).value();
  EXPECT_EQ(got, want) << "the stream read a layer before its ready Completion";
  ASSERT_TRUE(eb->backward(1.0f, late).ok());
  ASSERT_TRUE(late.wait_all().ok());
  for (size_t l = 0; l < model->layers().size(); ++l) {
    auto g = late.grads(l);
    auto r = resident->grads(l);
    ASSERT_EQ(g.size(), r.size());
    for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], r[i]) << model->layers()[l].name << "[" << i << "]";
  }
}

TEST(ProviderContract, FailedReadyCompletionFailsThePassWithItsStatus) {
  auto model = GptModel::create(micro_config(), 7).value();
  std::vector<int32_t> tok, tgt;
  make_batch(tok, tgt, 8);
  LateProvider late(*model, DType::kF32);
  late.delay = std::chrono::milliseconds(5);
  late.fail_with = IoError("nvme read of 'h1.swp' [4096, 8192) failed: EIO");
  late.fail_layer = 2;  // the second block
  Rig r = Rig::make();
  auto exec = GptExecutor::create(*model, *r.device, *r.stream, 1, 8).value();
  auto loss = exec->forward(tok, tgt, late);
  ASSERT_FALSE(loss.ok());
  EXPECT_EQ(loss.status().code(), StatusCode::kIoError) << loss.status().to_string();
  EXPECT_NE(loss.status().message().find("h1.swp"), std::string::npos) << loss.status().to_string();
  (void)late.wait_all();
}

TEST(ProviderContract, EvalPassRequestsNoGradientsAndAllowsNoBackward) {
  auto model = GptModel::create(micro_config(), 3).value();
  std::vector<int32_t> tok, tgt;
  make_batch(tok, tgt, 8);
  MemoryStats stats;
  auto p = ResidentProvider::create(*model, stats).value();
  Rig r = Rig::make();
  auto exec = GptExecutor::create(*model, *r.device, *r.stream, 1, 8).value();
  p->set_recording(true);
  const float train_loss = exec->forward(tok, tgt, *p, Pass::kForward).value();
  p->clear_events();
  const float eval_loss = exec->forward(tok, tgt, *p, Pass::kEval).value();
  EXPECT_EQ(eval_loss, train_loss);
  ASSERT_FALSE(p->events().empty());
  for (const HookEvent& e : p->events()) EXPECT_EQ(e.pass, Pass::kEval);
  // After an evaluation pass there are no activations to go back through.
  EXPECT_EQ(exec->backward(1.0f, *p).code(), StatusCode::kFailedPrecondition);

  LateProvider late(*model, DType::kF32);
  ASSERT_TRUE(exec->forward(tok, tgt, late, Pass::kEval).ok());
  ASSERT_TRUE(late.wait_all().ok());
  for (const std::string& line : late.log) EXPECT_NE(line.find("eval"), std::string::npos) << line;
}

// bf16 / fp16 gradient buffers: the model accumulates in fp32 and adds
// into the provider's buffer once per acquire, rounded to its dtype.
TEST(ProviderContract, LowPrecisionGradientBuffersAreAccumulatedInto) {
  auto model = GptModel::create(micro_config(), 5).value();
  std::vector<int32_t> tok, tgt;
  make_batch(tok, tgt, 8);
  MemoryStats stats;
  auto resident = ResidentProvider::create(*model, stats).value();
  Rig a = Rig::make();
  auto ea = GptExecutor::create(*model, *a.device, *a.stream, 1, 8).value();
  ASSERT_TRUE(ea->forward(tok, tgt, *resident).ok());
  ASSERT_TRUE(ea->backward(1.0f, *resident).ok());
  ASSERT_TRUE(resident->wait_gradients().ok());
  for (DType dt : {DType::kBF16, DType::kF16}) {
    LateProvider late(*model, dt);
    Rig b = Rig::make();
    auto eb = GptExecutor::create(*model, *b.device, *b.stream, 1, 8).value();
    ASSERT_TRUE(eb->forward(tok, tgt, late).ok());
    ASSERT_TRUE(eb->backward(1.0f, late).ok());
    ASSERT_TRUE(late.wait_all().ok());
    const double rel = dt == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024;
    for (size_t l = 0; l < model->layers().size(); ++l) {
      auto g = late.grads(l);
      auto want = resident->grads(l);
      float max_abs = 0;
      for (float v : want) max_abs = std::max(max_abs, std::abs(v));
      for (size_t i = 0; i < g.size(); ++i)
        ASSERT_NEAR(g[i], want[i], rel * std::abs(want[i]) * 2 + 1e-6 * max_abs + 1e-7)
            << dtype_name(dt) << " " << model->layers()[l].name << "[" << i << "]";
    }
  }
}

TEST(ProviderContract, TiedEmbeddingIsAcquiredTwiceInBackwardAndNotHeldBetween) {
  auto model = GptModel::create(micro_config(), 1).value();
  std::vector<int32_t> tok, tgt;
  make_batch(tok, tgt, 8);
  LateProvider late(*model, DType::kF32);
  Rig r = Rig::make();
  auto exec = GptExecutor::create(*model, *r.device, *r.stream, 1, 8).value();
  ASSERT_TRUE(exec->forward(tok, tgt, late).ok());
  late.log.clear();
  ASSERT_TRUE(exec->backward(1.0f, late).ok());
  ASSERT_TRUE(late.wait_all().ok());
  const std::vector<std::string> want = {
      "acquire 0 backward", "release 0 backward",  // LM head
      "acquire 3 backward", "release 3 backward",  // final norm
      "acquire 2 backward", "release 2 backward", "acquire 1 backward", "release 1 backward",
      "acquire 0 backward", "release 0 backward"};  // token and position embeddings
  EXPECT_EQ(late.log, want);
}

// `done` of a release completes only once the stream ran the layer's work:
// with the stream gated on a pending Completion, backward() returns with
// every `done` still pending; they complete after the gate opens.
TEST(ProviderContract, ReleaseDoneCompletesAfterTheStreamWork) {
  auto model = GptModel::create(micro_config(), 2).value();
  std::vector<int32_t> tok, tgt;
  make_batch(tok, tgt, 8);
  LateProvider late(*model, DType::kF32);
  Rig r = Rig::make();
  auto exec = GptExecutor::create(*model, *r.device, *r.stream, 1, 8).value();
  ASSERT_TRUE(exec->forward(tok, tgt, late).ok());
  late.done.clear();
  CompletionSource gate("test gate");
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gate.complete(Status::Ok());
  });
  ASSERT_TRUE(r.stream->wait(gate.completion()).ok());
  ASSERT_TRUE(exec->backward(1.0f, late).ok());
  ASSERT_EQ(late.done.size(), model->layers().size() + 1);  // the embedding twice
  // Every `done` read first, then the gate: a gate still closed after the
  // reads was closed during them (it opens once), so none may have completed.
  std::vector<bool> done_before;
  for (const Completion& d : late.done) done_before.push_back(d.done());
  if (!gate.completion().done()) {
    for (bool d : done_before) EXPECT_FALSE(d) << "a release's done ran ahead of its stream work";
  }
  ASSERT_TRUE(late.wait_all().ok());
  opener.join();
  for (const Completion& d : late.done) EXPECT_TRUE(d.done());
  float sum = 0;
  for (float g : late.grads(0)) sum += std::abs(g);
  EXPECT_GT(sum, 0.0f);
}

}  // namespace
}  // namespace strata::offload
