#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/adam.h"
#include "kernels/pool.h"
#include "kernels_test_util.h"
#include "strata/dtype.h"

namespace strata::kernels {
namespace {

// One element of PyTorch's Adam/AdamW in double (the reference).
struct Ref {
  double p, m, v;
  void Step(const AdamHyper& h, double grad) {
    double g = grad * h.grad_scale;
    if (h.decoupled_weight_decay) {
      p *= 1.0 - double{h.lr} * h.weight_decay;
    } else {
      g += double{h.weight_decay} * p;
    }
    m = double{h.beta1} * m + (1.0 - h.beta1) * g;
    v = double{h.beta2} * v + (1.0 - h.beta2) * g * g;
    const double t = static_cast<double>(h.step);
    const double bc1 = h.bias_correction ? 1.0 - std::pow(double{h.beta1}, t) : 1.0;
    const double bc2 = h.bias_correction ? 1.0 - std::pow(double{h.beta2}, t) : 1.0;
    last_update = h.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
    p -= last_update;
  }
  double last_update = 0;
};

// 64-byte aligned storage, so the AVX-512 streaming-store path runs in these tests (a plain
// std::vector is only 16-byte aligned); offset views exercise the unaligned path.
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}  // NOLINT: allocator rebind
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  friend bool operator==(const Aligned64&, const Aligned64&) { return true; }
};
template <class T>
using AVec = std::vector<T, Aligned64<T>>;

// A shard with random state and gradients (quantized to the gradient dtype).
struct Shard {
  Shard(size_t n, DType grad_t, std::optional<DType> out_t, uint32_t seed)
      : p(n), m(n), v(n), g32(n), g16(n), out(n, 0xdead), grad_t(grad_t), out_t(out_t) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      p[i] = u(rng);
      m[i] = 0.1f * u(rng);
      v[i] = 0.01f * std::abs(u(rng));
      SetGrad(i, 2.0f * u(rng));
      ref.push_back({p[i], m[i], v[i]});
    }
  }
  void SetGrad(size_t i, float x) { StoreAs(grad_t, x, &g16[i], &g32[i]); }
  AdamShard View() {
    return {p.data(),
            m.data(),
            v.data(),
            grad_t == DType::kF32 ? static_cast<const void*>(g32.data()) : g16.data(),
            grad_t,
            out_t ? out.data() : nullptr,
            out_t.value_or(DType::kBF16),
            p.size()};
  }
  void RefStep(const AdamHyper& h) {
    for (size_t i = 0; i < ref.size(); ++i) ref[i].Step(h, g32[i]);
  }
  // Compares against the reference; `tol` is relative to the magnitudes involved.
  void Check(const AdamHyper& h, double tol, const std::string& what) {
    for (size_t i = 0; i < p.size(); ++i) {
      const Ref& r = ref[i];
      const double g = double{g32[i]} * h.grad_scale;
      ASSERT_NEAR(m[i], r.m, tol * (std::abs(r.m) + std::abs(g) + 1e-30))
          << what << " m[" << i << "]";
      ASSERT_NEAR(v[i], r.v, tol * (r.v + g * g + 1e-30)) << what << " v[" << i << "]";
      ASSERT_NEAR(p[i], r.p, tol * (std::abs(r.p) + std::abs(r.last_update) + 1e-30))
          << what << " p[" << i << "]";
      if (out_t == DType::kBF16) {
        ASSERT_EQ(out[i], FloatToBf16(p[i]).bits) << what << " bf16 out[" << i << "]";
      } else if (out_t == DType::kF16) {
        ASSERT_EQ(out[i], FloatToHalf(p[i]).bits) << what << " fp16 out[" << i << "]";
      }
    }
    if (!out_t) {
      for (uint16_t o : out) ASSERT_EQ(o, 0xdead) << what << ": wrote param_out without one";
    }
  }
  AVec<float> p, m, v, g32;
  AVec<uint16_t> g16, out;
  std::vector<Ref> ref;
  DType grad_t;
  std::optional<DType> out_t;
};

class AdamTest : public TargetTest {};

const DType kGradTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const std::optional<DType> kOutTypes[] = {std::nullopt, DType::kBF16, DType::kF16};

TEST_P(AdamTest, MatchesDoubleReferenceEveryPathAndSize) {
  for (size_t n : Sizes()) {
    for (DType gt : kGradTypes) {
      for (std::optional<DType> ot : kOutTypes) {
        for (bool adamw : {true, false}) {
          Shard s(n, gt, ot, static_cast<uint32_t>(n * 7 + 1));
          AdamHyper h;
          h.lr = 1e-2f;
          h.weight_decay = 0.05f;
          h.decoupled_weight_decay = adamw;
          h.grad_scale = 0.37f;
          h.step = 3;
          ASSERT_TRUE(AdamStep(h, s.View()).ok());
          s.RefStep(h);
          s.Check(h, 2e-6,
                  "n=" + std::to_string(n) + " grad=" + std::string(DTypeName(gt)) + " out=" +
                      (ot ? std::string(DTypeName(*ot)) : "none") + (adamw ? " adamw" : " adam"));
        }
      }
    }
  }
}

TEST_P(AdamTest, MultiStepSequenceWithoutBiasCorrection) {
  for (bool bias_correction : {true, false}) {
    Shard s(4099, DType::kBF16, DType::kBF16, 11);
    AdamHyper h;
    h.bias_correction = bias_correction;
    h.weight_decay = 0.01f;
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int step = 1; step <= 6; ++step) {
      h.step = step;
      h.lr = 1e-3f * static_cast<float>(step);  // a schedule: lr changes per call
      for (size_t i = 0; i < s.p.size(); ++i) s.SetGrad(i, u(rng));
      ASSERT_TRUE(AdamStep(h, s.View()).ok());
      s.RefStep(h);
      s.Check(h, 1e-5, "step " + std::to_string(step));
    }
  }
}

// grad_scale is folded in: scaling by a power of two before or inside the step is the same.
TEST_P(AdamTest, GradScaleEqualsPrescaledGradient) {
  Shard a(777, DType::kF32, DType::kBF16, 9), b(777, DType::kF32, DType::kBF16, 9);
  for (float& g : b.g32) g *= 0.25f;
  AdamHyper h;
  h.grad_scale = 0.25f;
  ASSERT_TRUE(AdamStep(h, a.View()).ok());
  h.grad_scale = 1.0f;
  ASSERT_TRUE(AdamStep(h, b.View()).ok());
  EXPECT_EQ(0, std::memcmp(a.p.data(), b.p.data(), a.p.size() * 4));
  EXPECT_EQ(0, std::memcmp(a.m.data(), b.m.data(), a.m.size() * 4));
  EXPECT_EQ(0, std::memcmp(a.v.data(), b.v.data(), a.v.size() * 4));
  EXPECT_EQ(a.out, b.out);
}

// NaN/Inf gradients poison exactly their own element (as in PyTorch), nothing else.
TEST_P(AdamTest, NonFiniteGradientsStayInTheirElement) {
  for (DType gt : kGradTypes) {
    const size_t n = 2 * simd::LanesF32() + 5;
    Shard s(n, gt, DType::kF16, 21);
    const float bad[] = {std::nanf(""), std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity()};
    const size_t where[] = {0, n / 2, n - 1};  // body and tail
    for (int k = 0; k < 3; ++k) s.SetGrad(where[k], bad[k]);
    AdamHyper h;
    ASSERT_TRUE(AdamStep(h, s.View()).ok());
    s.RefStep(h);
    for (size_t i = 0; i < n; ++i) {
      const bool poisoned = i == where[0] || i == where[1] || i == where[2];
      EXPECT_EQ(std::isnan(s.p[i]), poisoned) << DTypeName(gt) << " p[" << i << "]";
      EXPECT_EQ(std::isnan(s.ref[i].p), poisoned);  // the reference agrees
      if (poisoned) {
        EXPECT_EQ(FloatToHalf(s.p[i]).bits, s.out[i]);  // a NaN param out, sign kept
      } else {
        EXPECT_NEAR(s.p[i], s.ref[i].p, 1e-5) << DTypeName(gt) << " p[" << i << "]";
      }
    }
  }
}

// Any thread count, any tile size, any offset: the same bits as one call.
TEST_P(AdamTest, BitwiseIdenticalForAnyThreadsAndTiles) {
  const size_t n = 200003;
  Shard ref(n, DType::kBF16, DType::kBF16, 77);
  AdamHyper h;
  h.weight_decay = 0.1f;
  ASSERT_TRUE(AdamStep(h, ref.View()).ok());
  const std::pair<int, size_t> configs[] = {{1, 1024}, {2, 1024}, {3, 5000}, {4, 65536}};
  for (auto [threads, tile] : configs) {
    auto pool = KernelPool::Create({.threads = threads, .tile_elems = tile});
    ASSERT_TRUE(pool.ok());
    Shard s(n, DType::kBF16, DType::kBF16, 77);
    ASSERT_TRUE(AdamStep(**pool, h, s.View()).ok());
    EXPECT_EQ(0, std::memcmp(s.p.data(), ref.p.data(), n * 4)) << threads << "/" << tile;
    EXPECT_EQ(0, std::memcmp(s.m.data(), ref.m.data(), n * 4)) << threads << "/" << tile;
    EXPECT_EQ(0, std::memcmp(s.v.data(), ref.v.data(), n * 4)) << threads << "/" << tile;
    EXPECT_EQ(s.out, ref.out) << threads << "/" << tile;
  }
  {  // Streaming stores for p, m, v too (aligned shard): the same bits.
    auto pool = KernelPool::Create({.threads = 2, .tile_elems = 4096});
    ASSERT_TRUE(pool.ok());
    Shard s(n, DType::kBF16, DType::kBF16, 77);
    AdamHyper hs = h;
    hs.stream_state = true;
    ASSERT_TRUE(AdamStep(**pool, hs, s.View()).ok());
    EXPECT_EQ(0, std::memcmp(s.p.data(), ref.p.data(), n * 4));
    EXPECT_EQ(0, std::memcmp(s.m.data(), ref.m.data(), n * 4));
    EXPECT_EQ(0, std::memcmp(s.v.data(), ref.v.data(), n * 4));
    EXPECT_EQ(s.out, ref.out);
  }
  // A shard starting at an odd element (unaligned: no streaming stores) gives the same bits.
  Shard s(n + 3, DType::kBF16, DType::kBF16, 77);
  Shard t(n, DType::kBF16, DType::kBF16, 77);
  std::copy(t.p.begin(), t.p.end(), s.p.begin() + 3);
  std::copy(t.m.begin(), t.m.end(), s.m.begin() + 3);
  std::copy(t.v.begin(), t.v.end(), s.v.begin() + 3);
  std::copy(t.g16.begin(), t.g16.end(), s.g16.begin() + 3);
  AdamShard view = s.View();
  view.master += 3;
  view.exp_avg += 3;
  view.exp_avg_sq += 3;
  view.grad = s.g16.data() + 3;
  view.param_out = s.out.data() + 3;
  view.n = n;
  h.stream_state = true;  // asks for streaming; must fall back cleanly when unaligned
  ASSERT_TRUE(AdamStep(h, view).ok());
  EXPECT_EQ(0, std::memcmp(s.p.data() + 3, ref.p.data(), n * 4));
  EXPECT_TRUE(std::equal(ref.out.begin(), ref.out.end(), s.out.begin() + 3));
}

// AdamStepSaving: the same bits as AdamStep, and the copies hold the state and params from
// before the step, for any thread count and tile, streamed or not; a null copy is refused.
TEST_P(AdamTest, SavingStepsTheSameAndKeepsTheOldState) {
  const size_t n = 100003;  // several of its 16 Ki-element pieces, and a ragged end
  Shard ref(n, DType::kBF16, DType::kBF16, 91);
  const Shard before(n, DType::kBF16, DType::kBF16, 91);
  AdamHyper h;
  h.weight_decay = 0.1f;
  ASSERT_TRUE(AdamStep(h, ref.View()).ok());
  for (auto [threads, tile, stream] :
       {std::tuple{1, size_t{1024}, false}, std::tuple{2, size_t{4096}, true},
        std::tuple{3, size_t{65536}, false}}) {
    auto pool = KernelPool::Create({.threads = threads, .tile_elems = tile});
    ASSERT_TRUE(pool.ok());
    Shard s(n, DType::kBF16, DType::kBF16, 91);
    std::fill(s.out.begin(), s.out.end(), uint16_t{0x1234});  // the "old params"
    AVec<float> m0(n), m1(n), m2(n);
    AVec<uint16_t> p0(n);
    AdamSave save;
    save.master = m0.data();
    save.exp_avg = m1.data();
    save.exp_avg_sq = m2.data();
    save.param_from = s.out.data();
    save.param_to = p0.data();
    save.param_elem_bytes = 2;
    AdamHyper hs = h;
    hs.stream_state = stream;
    ASSERT_TRUE(AdamStepSaving(**pool, hs, s.View(), save).ok());
    const std::string what = std::to_string(threads) + "/" + std::to_string(tile);
    EXPECT_EQ(0, std::memcmp(s.p.data(), ref.p.data(), n * 4)) << what;
    EXPECT_EQ(0, std::memcmp(s.m.data(), ref.m.data(), n * 4)) << what;
    EXPECT_EQ(0, std::memcmp(s.v.data(), ref.v.data(), n * 4)) << what;
    EXPECT_EQ(s.out, ref.out) << what;
    EXPECT_EQ(0, std::memcmp(m0.data(), before.p.data(), n * 4)) << what;
    EXPECT_EQ(0, std::memcmp(m1.data(), before.m.data(), n * 4)) << what;
    EXPECT_EQ(0, std::memcmp(m2.data(), before.v.data(), n * 4)) << what;
    EXPECT_TRUE(std::all_of(p0.begin(), p0.end(), [](uint16_t x) { return x == 0x1234; })) << what;
  }
  auto pool = KernelPool::Create({.threads = 2});
  ASSERT_TRUE(pool.ok());
  Shard s(n, DType::kBF16, DType::kBF16, 91);
  const Status st = AdamStepSaving(**pool, h, s.View(), AdamSave{});
  EXPECT_TRUE(st.IsInvalidArgument()) << st.ToString();
  EXPECT_EQ(0, std::memcmp(s.p.data(), before.p.data(), n * 4)) << "nothing written";
}

// The 16-bit copy of the new parameter at fp16/bf16 edges (overflow to Inf, subnormals, ties),
// streamed (aligned, long shard) and not: always the scalar RNE of the fp32 master.
TEST_P(AdamTest, ParamOutRoundingAtEdges) {
  const float edges[] = {65519.0f, 65520.0f,        65504.0f,       -70000.0f, 3e-8f,  -6e-8f,
                         1e-45f,   1.0f + 0x1p-11f, 1.0f + 0x1p-8f, -0.0f,     3.4e38f};
  for (std::optional<DType> ot :
       {std::optional<DType>(DType::kF16), std::optional<DType>(DType::kBF16)}) {
    const size_t n = 4096 + 3;
    Shard s(n, DType::kF32, ot, 4);
    for (size_t i = 0; i < n; ++i) {
      s.p[i] = edges[i % std::size(edges)];
      s.g32[i] = 0.0f;  // m = v = 0 after decay: update 0, p stays exactly on the edge
      s.m[i] = 0.0f;
      s.v[i] = 0.0f;
    }
    AdamHyper h;
    ASSERT_TRUE(AdamStep(h, s.View()).ok());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(s.p[i], edges[i % std::size(edges)]) << i;
      const uint16_t want = ot == DType::kF16 ? FloatToHalf(s.p[i]).bits : FloatToBf16(s.p[i]).bits;
      ASSERT_EQ(s.out[i], want) << DTypeName(*ot) << " p=" << s.p[i];
    }
  }
}

STRATA_INSTANTIATE_FOR_TARGETS(AdamTest);

// torch.optim.Adam's _single_tensor_adam on one fp32 CPU element, written from torch's source op
// by op with ATen's fp32 roundings (kernels/adam_math.h explains each); independent of the
// kernel's own element code. python/tests/test_adam_torch.py holds the engine to torch itself.
struct TorchRef {
  float p, m, v;
  void Step(const AdamHyper& h, float grad) {
    float g = grad * h.grad_scale;  // clip_grad_norm_: grad.mul_(clip_coef)
    if (h.weight_decay != 0.0 && h.decoupled_weight_decay) {
      p = p * static_cast<float>(1.0 - h.lr * h.weight_decay);  // param.mul_(1 - lr * wd)
    } else if (h.weight_decay != 0.0) {
      g = std::fma(p, static_cast<float>(h.weight_decay), g);  // grad.add(param, alpha=wd)
    }
    const float w = static_cast<float>(1.0 - h.beta1);  // exp_avg.lerp_(grad, 1 - beta1)
    m = std::abs(w) < 0.5f ? std::fma(w, g - m, m) : std::fma(w - 1.0f, g - m, g);
    v = v * static_cast<float>(h.beta2);  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
    v = std::fma(static_cast<float>(1.0 - h.beta2) * g, g, v);
    const double t = static_cast<double>(h.step);
    const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
    const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
    const double step_size = h.lr / bc1;
    const double bc2_sqrt = std::pow(bc2, 0.5);  // Python's bias_correction2**0.5
    const float denom = std::sqrt(v) / static_cast<float>(bc2_sqrt) + static_cast<float>(h.eps);
    p = p + (static_cast<float>(-step_size) * m) / denom;  // addcdiv_(m, denom, -step_size)
  }
};

bool SameBits(float a, float b) {
  return std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b));
}

// Gradients of every scale: ordinary, tiny (subnormal squares), huge (overflowing squares), zero.
float TorchCaseGrad(std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  switch (rng() % 8) {
    case 0:
      return 0.0f;
    case 1:
      return nd(rng) * 1e-30f;
    case 2:
      return nd(rng) * 1e-42f;
    case 3:
      return nd(rng) * 1e25f;
    default:
      return nd(rng) * 1e-3f;
  }
}

std::vector<AdamHyper> TorchHypers() {
  std::vector<AdamHyper> hs(6);
  hs[0].weight_decay = 0.01;  // AdamW as torch.optim.AdamW's defaults
  hs[1].decoupled_weight_decay = false;  // torch.optim.Adam with L2
  hs[1].weight_decay = 0.1;
  hs[1].lr = 3e-2;
  hs[2].bias_correction = false;
  hs[2].weight_decay = 0.05;
  hs[3].beta1 = 0.3;  // lerp weight 0.7: ATen's other lerp form
  hs[3].beta2 = 0.95;
  hs[3].eps = 1e-6;
  hs[4].grad_scale = 0.37f;  // a clipping coefficient
  hs[4].lr = 0.5;
  hs[5].beta1 = 0.0;
  hs[5].weight_decay = 0.2;
  return hs;
}

// Every target equals torch's order bit for bit: master, m and v, over several steps, from torch's
// zero moments, for fp32 and the fp32 master of the 16-bit paths.
TEST_P(AdamTest, EqualsTorchOrderBitForBit) {
  const std::vector<AdamHyper> hypers = TorchHypers();
  for (size_t n : Sizes()) {
    for (DType gt : kGradTypes) {
      for (size_t hi = 0; hi < hypers.size(); ++hi) {
        if (n > 10000 && hi > 0) continue;  // the large size on one hyper set is enough
        Shard s(n, gt, DType::kBF16, static_cast<uint32_t>(n * 13 + hi));
        std::vector<TorchRef> ref(n);
        for (size_t i = 0; i < n; ++i) {
          s.m[i] = s.v[i] = 0.0f;
          ref[i] = {s.p[i], 0.0f, 0.0f};
        }
        std::mt19937 rng(static_cast<uint32_t>(hi + 1));
        AdamHyper h = hypers[hi];
        for (int step = 1; step <= 4; ++step) {
          h.step = step;
          for (size_t i = 0; i < n; ++i) s.SetGrad(i, TorchCaseGrad(rng));
          ASSERT_TRUE(AdamStep(h, s.View()).ok());
          for (size_t i = 0; i < n; ++i) {
            ref[i].Step(h, s.g32[i]);
            if (SameBits(s.p[i], ref[i].p) && SameBits(s.m[i], ref[i].m) &&
                SameBits(s.v[i], ref[i].v)) {
              continue;
            }
            FAIL() << "n=" << n << " grad=" << DTypeName(gt) << " hyper#" << hi << " step "
                   << step << " i=" << i << ": p " << s.p[i] << " vs " << ref[i].p << ", m "
                   << s.m[i] << " vs " << ref[i].m << ", v " << s.v[i] << " vs " << ref[i].v;
          }
        }
      }
    }
  }
}

TEST(AdamApiTest, ValidationNamesTheField) {
  Shard s(16, DType::kF32, std::nullopt, 1);
  const AVec<float> before = s.p;
  AdamHyper h;
  auto expect_bad = [&](const AdamHyper& hh, const AdamShard& sh, const char* needle) {
    Status st = AdamStep(hh, sh);
    EXPECT_TRUE(st.IsInvalidArgument()) << needle;
    EXPECT_NE(st.message().find(needle), std::string_view::npos) << st.ToString();
  };
  AdamHyper bad = h;
  bad.step = 0;
  expect_bad(bad, s.View(), "step");
  bad = h;
  bad.beta1 = 1.0f;
  expect_bad(bad, s.View(), "beta1");
  bad = h;
  bad.beta2 = -0.1f;
  expect_bad(bad, s.View(), "beta2");
  bad = h;
  bad.eps = 0;
  expect_bad(bad, s.View(), "eps");
  bad = h;
  bad.lr = std::nanf("");
  expect_bad(bad, s.View(), "lr");
  bad = h;
  bad.weight_decay = -1;
  expect_bad(bad, s.View(), "weight_decay");
  AdamShard sh = s.View();
  sh.grad_dtype = DType::kI8;
  expect_bad(h, sh, "grad dtype");
  sh = s.View();
  sh.param_out = s.out.data();
  sh.param_out_dtype = DType::kF32;
  expect_bad(h, sh, "param_out dtype");
  sh = s.View();
  sh.exp_avg = nullptr;
  expect_bad(h, sh, "non-null");
  EXPECT_EQ(s.p, before);  // nothing written on error
  EXPECT_EQ(AdamBytesPerParam(DType::kBF16, DType::kBF16), 28u);
  EXPECT_EQ(AdamBytesPerParam(DType::kF32, std::nullopt), 28u);
  EXPECT_EQ(AdamBytesPerParam(DType::kF32, DType::kF16), 30u);
}

}  // namespace
}  // namespace strata::kernels
