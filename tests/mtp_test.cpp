// Multi-token prediction (docs/model.md): the MTP layer's loss and gradients against an independent fp32 reference
// (tests/mtp_reference.py: transformers' decoder and decoder layer, the MTP composition written from vLLM's
// definition, torch autograd), against finite differences, under every remat policy, and planned as measured.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <list>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "checkpoint/hf_io.h"
#include "checkpoint/hf_layout.h"
#include "checkpoint/sharded.h"
#include "infer/decoder.h"
#include "infer/speculative.h"
#include "model/mtp.h"
#include "planner/plan.h"
#include "train/trainer.h"
#include "train_util.h"
#include "train/schedule.h"
#include "test_util.h"

namespace hs::train {
namespace {

namespace fs = std::filesystem;
using model::ModelConfig;
using model::ParamSet;

ModelConfig tiny_mtp(int64_t L) {
  ModelConfig c = model::preset("tiny+mtp");
  c.layers = L;
  return c;
}

struct Data {
  std::vector<int32_t> in, tg;
  Batch batch(int64_t B, int64_t S) const { return {in.data(), tg.data(), B, S}; }
};
// Targets are the next inputs (as the data loader makes them), some ignored.
Data shifted_data(int64_t B, int64_t S, int64_t V, uint32_t seed) {
  std::mt19937 rng(seed);
  Data d;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> seq(static_cast<size_t>(S + 1));
    for (auto& x : seq) x = static_cast<int32_t>(rng() % V);
    for (int64_t t = 0; t < S; ++t) {
      d.in.push_back(seq[static_cast<size_t>(t)]);
      d.tg.push_back(t % 11 == 4 ? -1 : seq[static_cast<size_t>(t + 1)]);
    }
  }
  return d;
}

// Parameters with spread everywhere (norms away from 0, so that each (1 + w) matters).
void spread(ParamSet& ps, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.1f);
  for (auto& p : ps.all())
    if (!p.spec.is_matrix)
      for (int64_t i = 0; i < p.tensor.numel(); ++i) p.tensor.as<float>()[i] += nd(rng);
}

TEST(MtpShift, ReadsTheNextTokenAndPredictsTheOneAfter) {
  const std::vector<int32_t> in = {10, 11, 12, 13, 20, 21, 22, 23}, tg = {11, 12, -1, 14, 21, 22, 23, -1};
  std::vector<int32_t> next(8), t2(8);
  EXPECT_EQ(model::mtp_shift(in.data(), tg.data(), 2, 4, next.data(), t2.data()), 3);
  EXPECT_EQ(next, (std::vector<int32_t>{11, 12, 13, 14, 21, 22, 23, 0}));
  // Position 2's next target is ignored (a document ends there): its token after next (14) is not counted.
  EXPECT_EQ(t2, (std::vector<int32_t>{12, -1, -1, -1, 22, 23, -1, -1}));
}

// The MTP cross-entropy and the gradient of every parameter (decoder included: the MTP loss reaches it through h_t,
// the embedding and the LM head) against tests/mtp_reference.py, fp32. Ours: the gradients at --mtp-weight 1 minus
// those at 0 (the same main loss both times).
TEST(Mtp, MatchesTheTorchReferenceInFp32) {
  const fs::path python = fs::path(test::source_dir()) / ".venv" / "bin" / "python";
  ASSERT_TRUE(fs::exists(python)) << python << " is missing (run scripts/setup.sh)";
  // torch is a benchmark peer (scripts/requirements-bench.txt, several GB), not in the test list CI installs.
  if (test::run_command("'" + python.string() + "' -c 'import torch, transformers'").rc != 0)
    GTEST_SKIP() << "torch and transformers are not in " << python << ": scripts/setup.sh --bench installs them";
  test::TempDir t;
  const ModelConfig c = tiny_mtp(4);
  MemoryAccountant mem;
  ParamSet ps(c, DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 5);
  spread(ps, 6);
  const int64_t B = 2, S = 24;
  const Data d = shifted_data(B, S, c.vocab, 7);
  // The checkpoint, as Hugging Face names it (fused experts, which transformers' module holds as they are).
  const checkpoint::HfLayout lay = checkpoint::hf_layout(c, checkpoint::ExpertLayout::Fused);
  {
    std::vector<checkpoint::TensorDecl> decls;
    for (const auto& h : lay.hf) decls.push_back({h.name, checkpoint::FileDType::F32, h.shape});
    checkpoint::ShardedWriter w(t / "ckpt", decls, 1ull << 40, {{"format", "pt"}});
    for (const auto& h : lay.hf) {
      const std::vector<float> v = checkpoint::hf_tensor_from(ps, h);
      w.write(h.name, std::as_bytes(std::span(v)));
    }
    w.commit();
    nlohmann::json cj = model::config_to_hf_json(c);
    cj["torch_dtype"] = "float32";
    std::ofstream(t / "ckpt" / "config.json") << cj.dump(2);
    std::ofstream bf(t / "batch.bin", std::ios::binary);
    const int32_t hdr[2] = {static_cast<int32_t>(B), static_cast<int32_t>(S)};
    bf.write(reinterpret_cast<const char*>(hdr), sizeof hdr);
    bf.write(reinterpret_cast<const char*>(d.in.data()), static_cast<std::streamsize>(d.in.size() * 4));
    bf.write(reinterpret_cast<const char*>(d.tg.data()), static_cast<std::streamsize>(d.tg.size() * 4));
  }
  const std::string cmd = "'" + python.string() + "' '" + test::source_dir() + "/tests/mtp_reference.py' '" +
                          (t / "ckpt").string() + "' '" + (t / "batch.bin").string() + "' '" + (t / "ref").string() +
                          "' > '" + (t / "log").string() + "' 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << std::ifstream(t / "log").rdbuf();
  const nlohmann::json ref = nlohmann::json::parse(std::ifstream(t / "ref" / "mtp.json"));

  StepOptions with{RematPolicy::Sublayer, DType::F32}, without = with;
  with.mtp_weight = 1.0;
  std::unique_ptr<ParamSet> g1, g0;
  const StepResult r1 = forward_backward(ps, d.batch(B, S), with, mem, &g1);
  forward_backward(ps, d.batch(B, S), without, mem, &g0);
  EXPECT_EQ(r1.mtp_count, ref["count"].get<int64_t>());
  // One fp32 evaluation each: ~1e-6 relative round-off in a cross-entropy of ~5.5.
  EXPECT_NEAR(r1.mtp_ce, ref["ce"].get<double>(), 1e-5 * ref["ce"].get<double>());
  for (size_t i = 0; i < g1->all().size(); ++i) {
    float* a = g1->all()[i].tensor.as<float>();
    const float* z = g0->all()[i].tensor.as<float>();
    for (int64_t j = 0; j < g1->all()[i].tensor.numel(); ++j) a[j] -= z[j];
  }
  checkpoint::CheckpointReader rr(t / "ref" / "grads.safetensors");
  size_t compared = 0;
  for (const auto& h : lay.hf) {
    ASSERT_TRUE(rr.contains(h.name)) << h.name;
    std::vector<float> want(static_cast<size_t>(numel(h.shape)));
    rr.read_f32(h.name, want);
    const std::vector<float> got = checkpoint::hf_tensor_from(*g1, h);
    double scale = 0, worst = 0;
    for (float v : want) scale = std::max(scale, double(std::fabs(v)));
    for (size_t j = 0; j < want.size(); ++j) worst = std::max(worst, double(std::fabs(got[j] - want[j])));
    // fp32 on both sides, different summation orders through ~10 dependent products: relative to the tensor's
    // largest entry, 1e-4 (the decoder parity tests see 1.3e-4 at worst on whole-model gradients).
    EXPECT_LE(worst, 1e-4 * scale + 1e-9) << h.name << " max |diff| " << worst << " of max " << scale;
    ++compared;
  }
  EXPECT_EQ(compared, lay.hf.size());
}

// The MTP term's gradient against central finite differences of the MTP loss alone (weight 1 minus weight 0), on
// entries of the MTP layer's own tensors and of the shared ones: checks the plumbing in the schedule.
TEST(Mtp, GradientMatchesFiniteDifferences) {
  ModelConfig c = tiny_mtp(4);
  c.experts = 0;  // dense: a smooth loss
  c.intermediate = 48;
  MemoryAccountant mem;
  ParamSet ps(c, DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 3);
  spread(ps, 4);
  const Data d = shifted_data(1, 20, c.vocab, 8);
  StepOptions opt{RematPolicy::Sublayer, DType::F32};
  opt.mtp_weight = 1.0;
  auto mtp_ce = [&] {
    std::unique_ptr<ParamSet> g;
    return forward_backward(ps, d.batch(1, 20), opt, mem, &g).mtp_ce;
  };
  std::unique_ptr<ParamSet> g1, g0;
  forward_backward(ps, d.batch(1, 20), opt, mem, &g1);
  StepOptions plain = opt;
  plain.mtp_weight = 0;
  forward_backward(ps, d.batch(1, 20), plain, mem, &g0);
  std::mt19937 rng(9);
  int checked = 0;
  for (size_t t = 0; t < ps.all().size(); ++t) {
    const std::string& n = ps.all()[t].name;
    if (n.rfind("mtp.", 0) != 0 && n != "embed_tokens.weight" && n != "lm_head.weight" &&
        n.rfind("global.", 0) != 0)
      continue;
    Tensor& w = ps.all()[t].tensor;
    for (int rep = 0; rep < 2; ++rep) {
      const int64_t j = static_cast<int64_t>(rng() % static_cast<uint32_t>(w.numel()));
      float* x = w.as<float>() + j;
      const float orig = *x, h = 1e-2f * std::max(1.0f, std::fabs(orig));
      *x = orig + h;
      const double lp = mtp_ce();
      *x = orig - h;
      const double lm = mtp_ce();
      *x = orig;
      const double fd = (lp - lm) / (2.0 * h);
      const double an = g1->all()[t].tensor.as<float>()[j] - g0->all()[t].tensor.as<float>()[j];
      // As ModelGradient.MatchesFiniteDifferences: ~1e-4 FD noise from fp32 losses, O(h^2) curvature.
      EXPECT_NEAR(an, fd, 2e-3 + 0.03 * std::fabs(fd)) << n << "[" << j << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
}

// Inference drafts with what training trains: the MTP cross-entropy of a sequence computed from the drafter's
// logits (infer::Decoder's hidden states, the final norm's output, fed to infer::MtpDrafter one position at a time)
// equals the training step's mtp_ce on that sequence, both fp32. Catches a drafter that reads another h_t than the
// training step does (e.g. the state before the final norm: a ~1e-2 relative difference here).
TEST(Mtp, DrafterReadsTheStateTrainingTrainsOn) {
  const ModelConfig c = tiny_mtp(4);
  MemoryAccountant mem;
  ParamSet ps(c, DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 11);
  spread(ps, 12);
  {  // a sharper head, so that the cross-entropy moves with h_t
    const TensorView& head = ps.global(model::g::kLmHead);
    for (int64_t i = 0; i < head.numel(); ++i) static_cast<float*>(head.data)[i] *= 10;
  }
  const int64_t S = 16;
  std::mt19937 rng(13);
  std::vector<int32_t> x(static_cast<size_t>(S + 1));
  for (auto& v : x) v = static_cast<int32_t>(rng() % c.vocab);
  const std::vector<int32_t> in(x.begin(), x.end() - 1), tg(x.begin() + 1, x.end());
  StepOptions opt{RematPolicy::Sublayer, DType::F32};
  opt.mtp_weight = 1.0;
  std::unique_ptr<ParamSet> g;
  const StepResult r = forward_backward(ps, Batch{in.data(), tg.data(), 1, S}, opt, mem, &g);
  ASSERT_EQ(r.mtp_count, S - 1);

  infer::Decoder dec(ps, DType::F32, 1, S + 1, mem);
  infer::MtpDrafter mtp(ps, DType::F32, 1, S + 1, mem);
  const int64_t H = c.hidden, V = c.vocab;
  std::vector<float> h(static_cast<size_t>(H)), logits(static_cast<size_t>(V));
  double ce = 0;
  for (int64_t t = 0; t + 1 < S; ++t) {  // position t: reads h_t and x_{t+1}, predicts x_{t+2}
    dec.prefill(0, std::span(&x[static_cast<size_t>(t)], 1), nullptr, false, h.data());
    mtp.prefill(0, t, h.data(), &x[static_cast<size_t>(t + 1)], 1, logits.data(), nullptr, true);
    double mx = -1e300, sum = 0;
    for (float v : logits) mx = std::max(mx, double(v));
    for (float v : logits) sum += std::exp(double(v) - mx);
    ce += mx + std::log(sum) - double(logits[static_cast<size_t>(x[static_cast<size_t>(t + 2)])]);
  }
  ce /= static_cast<double>(S - 1);
  // fp32 on both sides through the same layer kernels in other groupings (the whole sequence at once vs one position
  // at a time): measured 6e-9 relative; 1e-6 leaves room for other CPUs' paths, and reading the state before the
  // final norm instead misses by 9e-4 relative here.
  EXPECT_NEAR(ce, r.mtp_ce, 1e-6 * r.mtp_ce);
}

double max_rel_diff(const ParamSet& a, const ParamSet& b, std::string* where) {
  double worst = 0;
  for (size_t t = 0; t < a.all().size(); ++t) {
    const float *x = a.all()[t].tensor.as<float>(), *y = b.all()[t].tensor.as<float>();
    double scale = 1e-12;
    for (int64_t i = 0; i < a.all()[t].tensor.numel(); ++i) scale = std::max(scale, double(std::fabs(y[i])));
    for (int64_t i = 0; i < a.all()[t].tensor.numel(); ++i) {
      const double r = std::fabs(double(x[i]) - double(y[i])) / scale;
      if (r > worst) {
        worst = r;
        *where = a.all()[t].name;
      }
    }
  }
  return worst;
}

// Every remat policy gives the same loss and gradients with the MTP layer (it runs once, outside the remat), and the
// plan's peak equals the measured one, byte for byte, for both weight dtypes.
TEST(Mtp, EveryRematPolicyAgreesAndPlanEqualsMeasured) {
  const ModelConfig c = tiny_mtp(6);
  const Data d = shifted_data(2, 40, c.vocab, 12);
  // Every run's accountant outlives the gradients kept from the first (base): a set releases into its accountant.
  std::list<MemoryAccountant> accountants;
  std::unique_ptr<ParamSet> base;
  double base_loss = 0;
  for (RematPolicy pol : {RematPolicy::None, RematPolicy::Block, RematPolicy::Sublayer})
    for (DType wdt : {DType::F32, DType::BF16}) {
      MemoryAccountant& real = accountants.emplace_back(false);
      MemoryAccountant plan(true);
      ParamSet pr(c, wdt, real, MemCategory::Parameters, false), pp(c, wdt, plan, MemCategory::Parameters, false);
      model::init_params(pr, 1);
      StepOptions opt{pol, DType::F32};
      opt.mtp_weight = 0.3;
      std::unique_ptr<ParamSet> g1, g2;
      real.reset_peak();
      plan.reset_peak();
      const StepResult r = forward_backward(pr, d.batch(2, 40), opt, real, &g1);
      forward_backward(pp, d.batch(2, 40), opt, plan, &g2);
      EXPECT_EQ(real.at_peak().bytes, plan.at_peak().bytes) << remat_name(pol) << " " << dtype_name(wdt);
      EXPECT_GT(r.mtp_ce, 0.0);
      EXPECT_NEAR(r.loss, r.ce + c.router_aux_coef * r.aux + 0.3 * r.mtp_ce, 1e-9);
      if (wdt != DType::F32) continue;
      if (!base) {
        base = std::move(g1);
        base_loss = r.loss;
        continue;
      }
      EXPECT_NEAR(r.loss, base_loss, 1e-6 * base_loss) << remat_name(pol);
      std::string where;
      EXPECT_LT(max_rel_diff(*g1, *base, &where), 1e-5) << remat_name(pol) << " " << where;
    }
}

// Planner pattern (Planner.PlannedPeakEqualsMeasuredTrainingStep) with the MTP layer trained: the planned
// argument bytes (its parameters, gradients and AdamW moments among them) and temporaries equal a real training
// step's, for every policy and both weight dtypes, on tiny+mtp and small+mtp.
TEST(Mtp, PlannedPeakEqualsMeasuredTrainingStep) {
  for (const char* preset : {"tiny+mtp", "small+mtp"})
    for (RematPolicy pol : {RematPolicy::None, RematPolicy::Block, RematPolicy::Sublayer})
      for (DType w : {DType::F32, DType::BF16}) {
        TrainOptions o = tiny_synthetic_run(1, 32);
        o.model = preset;
        o.weight_dtype = w;
        o.step = {pol, DType::BF16};
        o.step.mtp_weight = 0.3;
        std::ostringstream log;
        TrainSummary s = run_training(o, log);
        planner::PlanRequest r;
        r.model = model::preset(preset);
        r.batch_per_device = 2;
        r.seq = 32;
        r.step.remat = pol;
        r.step.mtp_weight = 0.3;
        r.weight_dtype = w;
        planner::PlanResult p = planner::plan(r);
        EXPECT_EQ(p.argument_bytes, s.argument_bytes) << preset << " " << remat_name(pol) << " " << dtype_name(w);
        EXPECT_EQ(p.temp_bytes, s.temp_bytes) << preset << " " << remat_name(pol) << " " << dtype_name(w);
        // Without the MTP loss the same model plans less temporary memory (the layer does not run).
        r.step.mtp_weight = 0;
        EXPECT_LT(planner::plan(r).temp_bytes, p.temp_bytes) << preset << " " << remat_name(pol);
      }
}

TEST(Mtp, BadUseIsRefusedWithTheFix) {
  MemoryAccountant mem(true);
  const ModelConfig plain = model::preset("tiny");
  ParamSet ps(plain, DType::F32, mem, MemCategory::Parameters, false);
  const Data d = shifted_data(1, 8, plain.vocab, 1);
  StepOptions opt;
  opt.mtp_weight = 0.3;
  std::unique_ptr<ParamSet> g;
  try {
    forward_backward(ps, d.batch(1, 8), opt, mem, &g);
    ADD_FAILURE() << "a model without an MTP layer was trained with --mtp-weight";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("+mtp"), std::string::npos) << e.what();
  }
  opt.mtp_weight = -1;
  EXPECT_THROW(forward_backward(ps, d.batch(1, 8), opt, mem, &g), std::invalid_argument);
}

}  // namespace
}  // namespace hs::train
